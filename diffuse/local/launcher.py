"""A pre-imported launcher for local nodes: ``python -m MODULE`` processes forked from one that has
already imported what they need.

A node spends seconds importing torch, diffusers and transformers before it loads a single block.
The launcher (``python -m diffuse.local.launcher``, one per client process and environment, started on first
use) imports all that once, runs no torch op and starts no thread of its own, and forks each node on
request. A forked node is its own process with its own pid, the stdin/stdout/stderr the caller gave,
the caller's environment and working directory; it runs its module as ``__main__`` as
``python -m`` would. The caller gets a ``subprocess.Popen``-like handle (pid, stdout, poll, wait,
send_signal, terminate, kill); exit statuses come back from the launcher, which reaps its children.

``DIFFUSE_LAUNCHER=0`` turns it off: nodes start as plain subprocesses. A launcher that fails to start
or to fork says so in one warning line, and nodes start as plain subprocesses from then on.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from diffuse.processes import alive

READY_TIMEOUT_S = 120.0  # a launcher's imports (torch, diffusers, transformers) on a loaded machine
REPLY_TIMEOUT_S = 30.0  # a fork answered with its pid
MAX_LAUNCHERS = 3  # launchers kept at once (one per environment seen); the oldest is closed first
MAX_MESSAGE = 1 << 18  # one request: the environment and the command line
OFF = ("0", "off", "no", "false")
# read at run time only, so they may differ between requests served by one launcher
VOLATILE_ENV = ("DIFFUSE_HOME", "DIFFUSE_LAUNCHER", "PYTEST_CURRENT_TEST")
PRELOAD = ("diffuse.node.server", "diffuse.plan.analysis", "diffuse.plan.planner", "diffuse.plan.plugins", "diffuse.wire.sealing",
           "diffuse.node.stage", "diffuse.plan.modelfiles", "diffuse.lm.heads", "diffuse.lm.embedding", "diffuse.lm.sampling",
           "diffuse.lm.node_tail", "diffuse.lm.node_sampling",
           "diffusers.models.transformers", "transformers.modeling_utils", "transformers.generation")


class LauncherError(Exception):
    pass


# --------------------------------------------------------------------------- the caller's side


class LaunchedProcess:
    """A process forked by a launcher, seen as ``subprocess.Popen`` shows one."""

    def __init__(self, launcher: "Launcher", pid: int, args: list[str], stdin, stdout, stderr):
        self.launcher, self.pid, self.args = launcher, pid, args
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.launcher.exit_code(self.pid, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = self.launcher.exit_code(self.pid, left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never a signal to a pid that may already belong to someone else
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __repr__(self) -> str:
        return f"<LaunchedProcess pid={self.pid} returncode={self.returncode}>"


class Launcher:
    """One launcher process and the socket to it; safe to use from several threads."""

    def __init__(self, env: dict, cwd: str):
        import tempfile

        self.lock = threading.Lock()
        self.exits: dict[int, int] = {}  # reported, not yet asked for
        self.closed = False
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        self.log = tempfile.TemporaryFile("w+")  # what it says before it is ready, for the warning if it fails
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "diffuse.local.launcher", "--fd", str(theirs.fileno()), "--exit-with",
                 str(os.getpid())], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.log,
                pass_fds=(theirs.fileno(),), env=env, cwd=cwd)
        finally:
            theirs.close()
        self.ready = False

    def wait_ready(self, timeout: float | None = None) -> None:
        timeout = READY_TIMEOUT_S if timeout is None else timeout
        if self.ready:
            return
        with self.lock:
            if self.ready:
                return
            msg = self._receive(time.monotonic() + timeout)
            if msg is None or "ready" not in msg:
                self.log.seek(0)
                said = [line.strip() for line in self.log.read().splitlines() if line.strip()]
                why = (msg or {}).get("error") or (said[-1] if said else None) or (
                    "no answer in {:.0f} s".format(timeout) if msg is None and self.proc.poll() is None
                    else "it exited")
                self.log.close()
                raise LauncherError(why)
            self.ready = True
            self.log.close()

    def spawn(self, args: list[str], env: dict, cwd: str, fds: tuple[int, int, int]) -> int:
        """Fork ``python ARGS`` (ARGS starting with ``-m MODULE``) with these stdin/stdout/stderr; its pid."""
        self.wait_ready()
        with self.lock:
            request = json.dumps({"args": args, "env": env, "cwd": cwd}).encode()
            try:
                socket.send_fds(self.sock, [request], list(fds))
            except OSError as exc:
                raise LauncherError(f"the launcher is gone ({exc})") from exc
            deadline = time.monotonic() + REPLY_TIMEOUT_S
            while True:
                msg = self._receive(deadline)
                if msg is None:
                    raise LauncherError("the launcher did not answer a fork" if not self.closed else
                                        "the launcher is gone")
                if "pid" in msg:
                    return msg["pid"]
                if "error" in msg:
                    raise LauncherError(msg["error"])

    def exit_code(self, pid: int, timeout: float) -> int | None:
        """The exit status of a process this launcher forked (as ``Popen.returncode`` gives it), waiting at
        most ``timeout`` seconds for it; None while it runs."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while pid not in self.exits:
                if self.closed:
                    # no launcher to report it: gone (or a zombie of another reaper) is all that can be told
                    if not _running(pid):
                        self.exits[pid] = -signal.SIGKILL
                    break
                if self._receive(deadline) is None and time.monotonic() >= deadline:
                    break
            return self.exits.pop(pid, None)  # the handle keeps it from here on

    def _receive(self, deadline: float) -> dict | None:
        """One message from the launcher (exit statuses are recorded on the way), or None at the deadline or
        once the launcher is gone. Called with the lock held."""
        while not self.closed:
            left = max(0.0, deadline - time.monotonic())
            if not select.select([self.sock], [], [], left)[0]:
                return None
            try:
                raw = self.sock.recv(MAX_MESSAGE)
            except OSError:
                raw = b""
            if not raw:
                self.close()
                return None
            msg = json.loads(raw)
            if "exit" in msg:
                self.exits[msg["exit"]] = msg["code"]
                continue
            return msg
        return None

    def stop(self) -> None:
        """Close, and end the launcher itself (one that failed)."""
        self.close()
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        """Closing the socket ends the launcher; what it forked runs on (local nodes end with their client)."""
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass


_launchers: dict[tuple, Launcher] = {}
_lock = threading.Lock()
_failed: str | None = None


def enabled(env: dict | None = None) -> bool:
    """Whether nodes start from a launcher: on unless DIFFUSE_LAUNCHER is 0/off, and where fork exists."""
    value = (os.environ if env is None else env).get("DIFFUSE_LAUNCHER", "1").strip().lower()
    return value not in OFF and _failed is None and hasattr(os, "fork") and hasattr(socket, "send_fds") \
        and sys.platform.startswith("linux")


def _launcher(env: dict, cwd: str) -> Launcher:
    # what a process reads while it imports must be what the launcher had when it imported
    key = (sys.executable, tuple(sorted((k, v) for k, v in env.items() if k not in VOLATILE_ENV)))
    with _lock:
        found = _launchers.get(key)
        if found is not None and not found.closed and found.proc.poll() is None:
            return found
        while len(_launchers) >= MAX_LAUNCHERS:
            _launchers.pop(next(iter(_launchers))).close()
        _launchers[key] = Launcher(env, cwd)
        return _launchers[key]


def warm(env: dict | None = None, cwd: str | None = None) -> None:
    """Start the launcher for this environment now, without waiting for it: its imports overlap with the
    caller's own work until the first node is asked for."""
    env = dict(os.environ if env is None else env)
    if enabled(env):
        try:
            _launcher(env, cwd or os.getcwd())
        except (OSError, subprocess.SubprocessError) as exc:
            _fail(str(exc))


def spawn(args: list[str], stdin=None, stdout=None, stderr=None, env: dict | None = None, cwd: str | None = None,
          text: bool = True):
    """``subprocess.Popen([sys.executable, *args], ...)`` for ``args`` = ``["-m", MODULE, ...]``, forked from a
    launcher where one is enabled (a ``LaunchedProcess``), else a plain ``subprocess.Popen``. stdin, stdout and
    stderr: None (this process's), ``subprocess.PIPE``, ``subprocess.DEVNULL``, ``subprocess.STDOUT`` (stderr
    only), a descriptor or a file."""
    env = dict(os.environ if env is None else env)
    cwd = os.fspath(cwd) if cwd is not None else os.getcwd()
    if len(args) >= 2 and args[0] == "-m" and enabled(env):
        found = None
        try:
            found = _launcher(env, cwd)
            return _spawn(found, list(args), stdin, stdout, stderr, env, cwd, text)
        except (LauncherError, OSError, subprocess.SubprocessError) as exc:
            if found is not None:
                found.stop()
            _fail(str(exc))
    return subprocess.Popen([sys.executable, *args], stdin=stdin, stdout=stdout, stderr=stderr, env=env, cwd=cwd,
                            text=text)


def _fail(why: str) -> None:
    global _failed
    if _failed is None:
        _failed = why
        print(f"warning: the node launcher failed ({why}); starting nodes as plain processes (set "
              "DIFFUSE_LAUNCHER=0 to skip it)", file=sys.stderr, flush=True)


def _spawn(launcher: Launcher, args, stdin, stdout, stderr, env, cwd, text) -> LaunchedProcess:
    opened: list[int] = []  # ours to close once the launcher holds its copies
    ends: dict[str, object] = {}

    def fd_for(name: str, how, inherit: int, writing: bool) -> int:
        if how is None:
            try:
                os.fstat(inherit)
                return inherit
            except OSError:  # closed here: the child gets nothing there either
                how = subprocess.DEVNULL
        if how == subprocess.DEVNULL:
            fd = os.open(os.devnull, os.O_WRONLY if writing else os.O_RDONLY)
            opened.append(fd)
            return fd
        if how == subprocess.PIPE:
            r, w = os.pipe()
            mine, theirs = (r, w) if writing else (w, r)
            mode = ("r" if writing else "w") + ("" if text else "b")
            ends[name] = open(mine, mode, buffering=-1 if writing or not text else 1)
            opened.append(theirs)
            return theirs
        return how if isinstance(how, int) else how.fileno()

    try:
        fds = [fd_for("stdin", stdin, 0, False), fd_for("stdout", stdout, 1, True)]
        fds.append(fds[1] if stderr == subprocess.STDOUT else fd_for("stderr", stderr, 2, True))
        pid = launcher.spawn(args, env, cwd, tuple(fds))
    except BaseException:
        for end in ends.values():
            end.close()
        raise
    finally:
        for fd in opened:
            os.close(fd)
    return LaunchedProcess(launcher, pid, [sys.executable, *args], ends.get("stdin"), ends.get("stdout"),
                           ends.get("stderr"))


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# --------------------------------------------------------------------------- the launcher process


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m diffuse.local.launcher", description="fork local nodes on request "
                                 "(started by the client; not a command for people)")
    ap.add_argument("--fd", type=int, required=True, help="the Unix socket (SOCK_SEQPACKET) to the client")
    ap.add_argument("--exit-with", type=int, metavar="PID", help="stop when process PID is gone")
    a = ap.parse_args(argv)
    sock = socket.socket(fileno=a.fd)
    global _start_dir
    _start_dir = os.getcwd()
    try:
        loaded = _preload(a.exit_with)
        why = _unforkable()
        if why:
            _send(sock, {"error": why})
            return 1
        _send(sock, {"ready": os.getpid(), "preloaded": loaded})
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)  # nobody reads it once it is ready
        os.close(devnull)
        _serve(sock, a.exit_with)
    except KeyboardInterrupt:  # Ctrl-C in the client's terminal reaches the whole process group
        pass
    finally:
        sock.close()
    return 0


def _preload(parent: int | None) -> list[str]:
    """Import what a node imports (every module that imports here, and the installed plugins' modules), then
    freeze what exists so forked nodes share those pages instead of copying them when the collector runs."""
    import gc
    import importlib
    from importlib.metadata import entry_points

    loaded = []
    names = list(PRELOAD) + sorted({ep.module for ep in entry_points(group="diffuse")})
    for name in names:
        if parent is not None and not alive(parent):  # the client gave up (a refusal after it asked for this): no point going on
            os._exit(0)
        try:
            importlib.import_module(name)
            loaded.append(name)
        except Exception:  # a node that needs it fails to import it itself, and says so in its own log
            pass
    gc.collect()
    gc.freeze()
    return loaded


def _unforkable() -> str | None:
    """Why forking here would be unsafe, if it would: a thread started by an import. Libraries' BLAS thread
    pools stop themselves at fork, so one fork of a child that exits at once leaves only threads that would
    not have stopped."""
    if threading.active_count() > 1:
        return f"an import started threads: {', '.join(t.name for t in threading.enumerate()[1:])}"
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    return f"an import left {threads - 1} native threads running" if threads > 1 else None


def _send(sock: socket.socket, msg: dict) -> None:
    sock.send(json.dumps(msg).encode())


def _serve(sock: socket.socket, parent: int | None) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup descriptor hears of each exit
    signal.set_wakeup_fd(wake_w)
    own = (sock.fileno(), wake_r, wake_w)
    while True:
        ready = select.select([sock, wake_r], [], [], 1.0)[0]
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
        _reap(sock)
        if sock in ready:
            try:
                raw, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 3)
            except OSError:
                return
            if not raw:
                return  # the client is gone
            _fork(sock, json.loads(raw), fds, own)
        if parent is not None and not alive(parent):
            return


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _fork(sock: socket.socket, request: dict, fds: list[int], own: tuple[int, ...]) -> None:
    try:
        if len(fds) != 3:
            raise OSError(f"a request came with {len(fds)} descriptors, not 3")
        pid = os.fork()
    except OSError as exc:
        _send(sock, {"error": f"fork failed: {exc}"})
        pid = None
    if pid == 0:
        try:
            _child(request, fds, own)
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(1)
    for fd in fds:
        os.close(fd)
    if pid is not None:
        _send(sock, {"pid": pid})


# --------------------------------------------------------------------------- a forked process

_start_dir = ""  # the launcher's own working folder when it started


def _child(request: dict, fds: list[int], own: tuple[int, ...]) -> None:
    """Become ``python ARGS`` as the caller asked for it, then exit with its status; never returns."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in own:
        os.close(fd)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    if sys.path and sys.path[0] == _start_dir:  # ``python -m`` puts the folder it starts in first
        sys.path[0] = request["cwd"]
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _fresh_process_state()
    args = request["args"]
    module = args[1]
    sys.argv = [module, *args[2:]]
    code = 0
    try:
        import runpy

        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except KeyboardInterrupt:
        import traceback

        traceback.print_exc()
        code = -1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _finish(code)


def _fresh_process_state() -> None:
    """What a new interpreter would not share with its siblings: random seeds, the temporary folder it read
    from the environment, standard streams over the descriptors it was given."""
    import io

    for name in ("tempfile",):
        if name in sys.modules:
            sys.modules[name].tempdir = None
    if "random" in sys.modules:
        sys.modules["random"].seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    streams = []
    for fd, mode in ((0, "r"), (1, "w"), (2, "w")):
        try:
            raw = io.FileIO(fd, mode, closefd=False)
        except OSError:
            streams.append(None)
            continue
        tty = raw.isatty()
        buffered = raw if unbuffered and mode == "w" else (
            io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw))
        streams.append(io.TextIOWrapper(buffered, encoding=sys.__stdout__.encoding if sys.__stdout__ else None,
                                        errors="backslashreplace" if fd == 2 else "strict",
                                        line_buffering=tty or fd == 2, write_through=unbuffered and mode == "w"))
    sys.stdin, sys.stdout, sys.stderr = streams
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = streams


def _exit_status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _finish(code: int) -> None:
    """Exit as the interpreter would: threads that are not daemons joined, exit handlers run, streams
    flushed; a KeyboardInterrupt that ended it ends it by SIGINT."""
    import atexit

    try:
        threading._shutdown()
    except Exception:
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    if code == -1:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


if __name__ == "__main__":
    os._exit(main())  # no interpreter teardown of everything imported: Ctrl-C ends it at once
