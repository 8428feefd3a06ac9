"""Local nodes never outlive the client that started them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from conftest import subprocess_env


def test_local_nodes_stop_when_their_client_dies_without_cleaning_up(models):
    model = models("wan")
    code = (
        "import os\n"
        "from diffuse.localnodes import start_local_nodes\n"
        f"nodes = start_local_nodes({model!r}, 2, threads=1)\n"
        "print(*[n.proc.pid for n in nodes], flush=True)\n"
        "os._exit(0)  # as if killed: no finally, no terminate\n"
    )
    run = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True,
                         timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    pids = [int(p) for p in run.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_running(p) for p in pids):
        time.sleep(0.2)
    assert not any(_running(p) for p in pids)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has exited; it only waits for its (gone) parent's reaper
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
