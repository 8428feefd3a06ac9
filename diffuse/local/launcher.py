"""A pre-imported launcher for local nodes: ``python -m MODULE`` processes forked from one that has
already imported what they need.

A node spends seconds importing torch, diffusers and transformers before it loads a single block.
The launcher (``python -m diffuse.local.forker``, one per client process and environment, started on first
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


READY_TIMEOUT_S = 120.0  # a launcher's imports (torch, diffusers, transformers) on a loaded machine
REPLY_TIMEOUT_S = 30.0  # a fork answered with its pid
MAX_LAUNCHERS = 3  # launchers kept at once (one per environment seen); the oldest is closed first
MAX_MESSAGE = 1 << 18  # one request: the environment and the command line
OFF = ("0", "off", "no", "false")
# read at run time only, so they may differ between requests served by one launcher
VOLATILE_ENV = ("DIFFUSE_HOME", "DIFFUSE_LAUNCHER", "PYTEST_CURRENT_TEST")


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
                [sys.executable, "-m", "diffuse.local.forker", "--fd", str(theirs.fileno()), "--exit-with",
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

    def end(self, wait_s: float) -> None:
        """Close, and reap the launcher: it ends as soon as the nodes it forked have ended (one still
        importing has forked none, and is killed); one still there after ``wait_s`` is killed."""
        self.close()
        if not self.ready:
            self.proc.kill()
        try:
            self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        """Closing the socket ends the launcher once what it forked has ended (local nodes end with their
        client), and it reaps them first."""
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass


class LauncherPool:
    """Launchers kept for reuse, one per environment seen (at most ``MAX_LAUNCHERS``, the oldest closed first),
    and whether one failed (then nodes start as plain processes from then on).

    A launcher is a child of this process that imported what this process's environment imports, so every
    run in the process may fork from it: ``POOL`` is the process's own, deliberately shared, and it is the
    one object of this module that holds state."""

    def __init__(self):
        self._launchers: dict[tuple, Launcher] = {}
        self._lock = threading.Lock()
        self.failed: str | None = None  # why a launcher failed, once one has

    def enabled(self, env: dict | None = None) -> bool:
        """Whether nodes start from a launcher: on unless DIFFUSE_LAUNCHER is 0/off, none failed, and fork
        exists."""
        value = (os.environ if env is None else env).get("DIFFUSE_LAUNCHER", "1").strip().lower()
        return value not in OFF and self.failed is None and hasattr(os, "fork") and hasattr(socket, "send_fds") \
            and sys.platform.startswith("linux")

    def launcher(self, env: dict, cwd: str) -> Launcher:
        # what a process reads while it imports must be what the launcher had when it imported
        key = (sys.executable, tuple(sorted((k, v) for k, v in env.items() if k not in VOLATILE_ENV)))
        with self._lock:
            found = self._launchers.get(key)
            if found is not None and not found.closed and found.proc.poll() is None:
                return found
            while len(self._launchers) >= MAX_LAUNCHERS:
                self._launchers.pop(next(iter(self._launchers))).close()
            self._launchers[key] = Launcher(env, cwd)
            return self._launchers[key]

    def warm(self, env: dict | None = None, cwd: str | None = None) -> None:
        """Start the launcher for this environment now, without waiting for it: its imports overlap with the
        caller's own work until the first node is asked for."""
        env = dict(os.environ if env is None else env)
        if self.enabled(env):
            try:
                self.launcher(env, cwd or os.getcwd())
            except (OSError, subprocess.SubprocessError) as exc:
                self.fail(str(exc))

    def spawn(self, args: list[str], stdin=None, stdout=None, stderr=None, env: dict | None = None,
              cwd: str | None = None, text: bool = True):
        """``subprocess.Popen([sys.executable, *args], ...)`` for ``args`` = ``["-m", MODULE, ...]``, forked from
        a launcher where one is enabled (a ``LaunchedProcess``), else a plain ``subprocess.Popen``. stdin, stdout
        and stderr: None (this process's), ``subprocess.PIPE``, ``subprocess.DEVNULL``, ``subprocess.STDOUT``
        (stderr only), a descriptor or a file."""
        env = dict(os.environ if env is None else env)
        cwd = os.fspath(cwd) if cwd is not None else os.getcwd()
        if len(args) >= 2 and args[0] == "-m" and self.enabled(env):
            found = None
            try:
                found = self.launcher(env, cwd)
                return _spawn(found, list(args), stdin, stdout, stderr, env, cwd, text)
            except (LauncherError, OSError, subprocess.SubprocessError) as exc:
                if found is not None:
                    found.stop()
                self.fail(str(exc))
        return subprocess.Popen([sys.executable, *args], stdin=stdin, stdout=stdout, stderr=stderr, env=env,
                                cwd=cwd, text=text)

    def close(self, wait_s: float = 1.0) -> None:
        """End every launcher and reap it: what a process calls before it ends, so that no launcher (and no
        node it forked) is left to end after it, for the machine's init to collect."""
        with self._lock:
            found, self._launchers = list(self._launchers.values()), {}
        for each in found:
            each.end(wait_s)

    def fail(self, why: str) -> None:
        if self.failed is None:
            self.failed = why
            print(f"warning: the node launcher failed ({why}); starting nodes as plain processes (set "
                  "DIFFUSE_LAUNCHER=0 to skip it)", file=sys.stderr, flush=True)


POOL = LauncherPool()


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


# --------------------------------------------------------------------------- a forked process
