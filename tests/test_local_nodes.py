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


def test_no_more_local_nodes_start_than_the_longest_stack_has_blocks():
    """A local node that would hold no block is not started, and the run says so; at one patch each node
    gets the client's thread count (one computes at a time), with patches they share the cores."""
    import torch

    from diffuse.api import plan_local_nodes
    from diffuse.plan import StackPlan

    stacks = [StackPlan(path="blocks", length=4, block_class="B"), StackPlan(path="single", length=2, block_class="S")]
    capped = plan_local_nodes(9, stacks, patches=1, threads=None)
    assert capped.count == 4 and capped.threads == torch.get_num_threads()
    assert capped.notes == ["5 of 9 local nodes would hold no block (the longest stack has 4): starting 4"]
    shared = plan_local_nodes(2, stacks, patches=4, threads=None)
    assert shared.count == 2 and not shared.notes and shared.threads == max(1, (os.cpu_count() or 2) // 2)
    assert plan_local_nodes(3, stacks, patches=1, threads=5).threads == 5
