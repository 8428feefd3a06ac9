"""Ctrl-C of a default ``python -m diffuse.run``, as a terminal sends it (SIGINT to the whole process group):
the run exits 130 and nothing it started outlives it by more than a second, not even unreaped (a launcher
or node left to end after its parent waits for the machine's init to collect it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from conftest import ROOT, subprocess_env


def test_ctrl_c_of_a_default_run_leaves_no_process_of_its_group(tmp_path):
    run = subprocess.Popen([sys.executable, "-m", "diffuse.run", "--prompt", "a dog", "--steps", "5000", "--out",
                            str(tmp_path / "out.mp4")], cwd=ROOT, env=subprocess_env(str(tmp_path / "home")),
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           start_new_session=True, preexec_fn=_as_in_a_terminal)
    group = run.pid
    said: list[bytes] = []
    denoising = threading.Event()

    def read() -> None:
        for chunk in iter(lambda: run.stderr.read1(4096), b""):
            said.append(chunk)
            if b"denoising: step" in b"".join(said[-2:]):
                denoising.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert denoising.wait(90), b"".join(said).decode(errors="replace")[-2000:]
        started = _members(group)
        assert len(started) >= 3, started  # the client and its two local nodes (and their launcher)
        os.killpg(group, signal.SIGINT)
        code = run.wait(10)
        time.sleep(1.0)
        left = _members(group)
        assert code == 130, b"".join(said).decode(errors="replace")[-2000:]
        assert left == {}, f"still there 1 s after the run exited: {left} (of {started})"
    finally:
        if _members(group):
            os.killpg(group, signal.SIGKILL)
        run.wait(10)


def _as_in_a_terminal() -> None:
    """Ctrl-C as a terminal's foreground job takes it, also where the suite itself runs with SIGINT ignored (in
    the background of a shell), which a child would keep."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _members(group: int) -> dict[int, str]:
    """The processes of process group ``group`` and their states, zombies included."""
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    state, _, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
            except (OSError, ValueError):
                continue
            if int(pgrp) == group:
                found[int(name)] = state
    return found
