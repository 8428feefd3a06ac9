"""The launcher process (``python -m diffuse.local.forker``, started by ``diffuse.local.launcher``).

It imports what a node needs once, runs no torch op and starts no thread, and forks each node on request,
running its module as ``__main__`` as ``python -m`` would; it reaps its children and reports their exit
statuses, and ends with the client that started it, once every node it forked has ended and been reaped here
(a process whose parent ends first is left for the machine's init to collect, which may take seconds).

Once ready it ignores Ctrl-C (SIGINT to the terminal's whole process group): the client handles it, stops its
nodes (which got it too, and end) and closes the socket, which ends the launcher."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import threading
from dataclasses import dataclass

from diffuse.local.launcher import MAX_MESSAGE
from diffuse.processes import alive


PRELOAD = ("diffuse.node.server", "diffuse.node.command", "diffuse.node.stage", "diffuse.plan.analysis",
           "diffuse.plan.planner", "diffuse.plan.plugins", "diffuse.plan.modelfiles", "diffuse.wire.sealing",
           "diffuse.lm.heads", "diffuse.lm.embedding", "diffuse.lm.sampling", "diffuse.lm.node_tail",
           "diffuse.lm.node_sampling", "diffusers.models.transformers", "transformers.modeling_utils",
           "transformers.generation")


@dataclass(frozen=True)
class Start:
    """What this launcher had when it started, which each process it forks gets back as a fresh ``python -m``
    would have it: ``folder``, its working folder (``python -m`` puts it first on ``sys.path``), and
    ``interrupt``, its SIGINT handler (Python's, or SIG_IGN where it was started with SIGINT ignored)."""

    folder: str
    interrupt: object


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m diffuse.local.forker", description="fork local nodes on request "
                                 "(started by the client; not a command for people)")
    ap.add_argument("--fd", type=int, required=True, help="the Unix socket (SOCK_SEQPACKET) to the client")
    ap.add_argument("--exit-with", type=int, metavar="PID", help="stop when process PID is gone")
    a = ap.parse_args(argv)
    sock = socket.socket(fileno=a.fd)
    start = Start(os.getcwd(), signal.getsignal(signal.SIGINT))
    try:
        loaded = _preload(a.exit_with)
        why = _unforkable()
        if why:
            _send(sock, {"error": why})
            return 1
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the client's to handle from here on (a node's is reset)
        _send(sock, {"ready": os.getpid(), "preloaded": loaded})
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)  # nobody reads it once it is ready
        os.close(devnull)
        _serve(sock, a.exit_with, start)
        _reap_all(sock)
    except KeyboardInterrupt:  # Ctrl-C while it imports: nothing forked yet
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
    """Tell the client; one that no longer listens is not told (the socket's end ends the serving loop)."""
    try:
        sock.send(json.dumps(msg).encode())
    except OSError:
        pass


def _serve(sock: socket.socket, parent: int | None, start: Start) -> None:
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
            _fork(sock, json.loads(raw), fds, own, start)
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


def _reap_all(sock: socket.socket) -> None:
    """Wait for every process forked here to end, telling the client of each exit while it listens: none is
    left for init to reap. The client stops its nodes before it closes the socket; a node of a client that is
    gone ends by its ``--exit-with``."""
    signal.set_wakeup_fd(-1)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return
        _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _fork(sock: socket.socket, request: dict, fds: list[int], own: tuple[int, ...], start: Start) -> None:
    try:
        if len(fds) != 3:
            raise OSError(f"a request came with {len(fds)} descriptors, not 3")
        pid = os.fork()
    except OSError as exc:
        _send(sock, {"error": f"fork failed: {exc}"})
        pid = None
    if pid == 0:
        try:
            _child(request, fds, own, start)
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(1)
    for fd in fds:
        os.close(fd)
    if pid is not None:
        _send(sock, {"pid": pid})


def _child(request: dict, fds: list[int], own: tuple[int, ...], start: Start) -> None:
    """Become ``python ARGS`` as the caller asked for it, then exit with its status; never returns."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, start.interrupt)  # as ``python -m`` starts (the launcher ignores it once ready)
    for fd in own:
        os.close(fd)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    if sys.path and sys.path[0] == start.folder:  # ``python -m`` puts the folder it starts in first
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
