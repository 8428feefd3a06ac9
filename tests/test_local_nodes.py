"""Local nodes never outlive the client that started them; forked from the pre-imported launcher, each is
still a process of its own, started as the caller asked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from conftest import subprocess_env


def test_local_nodes_stop_when_their_client_dies_without_cleaning_up(models):
    model = models("wan")
    code = (
        "import os\n"
        "from diffuse.local.nodes import start_local_nodes\n"
        f"nodes = start_local_nodes({model!r}, 2, threads=1)\n"
        "print(os.getpid(), *[n.proc.pid for n in nodes], flush=True)\n"
        "os._exit(0)  # as if killed: no finally, no terminate\n"
    )
    run = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True,
                         timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    client, *pids = [int(p) for p in run.stdout.split()]
    assert len(pids) == 2
    # nor does the launcher they were forked from (it, like them, names the client it serves; it ends once it
    # has reaped them)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (any(_running(p) for p in pids) or _serving(client).stdout.strip()):
        time.sleep(0.2)
    assert not any(_running(p) for p in pids)
    left = _serving(client)
    assert left.returncode == 1 and left.stdout.strip() == "", f"a launcher or node left running: {left}"


def _serving(client: int) -> subprocess.CompletedProcess:
    """``pgrep`` for the processes started for ``client`` (launcher and nodes name it with --exit-with)."""
    return subprocess.run(["pgrep", "-f", "--", f"--exit-with {client}( |$)"], capture_output=True, text=True)


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

    from diffuse.local.nodes import plan_local_nodes
    from diffuse.plan.contracts import StackPlan

    stacks = [StackPlan(path="blocks", length=4, block_class="B"), StackPlan(path="single", length=2, block_class="S")]
    capped = plan_local_nodes(9, stacks, patches=1, threads=None)
    assert capped.count == 4 and capped.threads == torch.get_num_threads()
    assert capped.notes == ["5 of 9 local nodes would hold no block (the longest stack has 4): starting 4"]
    shared = plan_local_nodes(2, stacks, patches=4, threads=None)
    assert shared.count == 2 and not shared.notes and shared.threads == max(1, (os.cpu_count() or 2) // 2)
    assert plan_local_nodes(3, stacks, patches=1, threads=5).threads == 5


def test_a_launched_process_is_its_own_with_the_callers_streams_environment_and_folder(tmp_path):
    """Forked from the launcher: its own pid, the stdout and stderr given, the caller's environment and
    folder, run as ``__main__``, its exit status; torch's thread counts and a seeded computation as in a
    fresh ``python -m`` (what makes split runs equal whole ones)."""
    from diffuse.local import launcher

    env = subprocess_env(str(tmp_path / "home"))  # a value read at run time differs from the launcher's own
    plain = subprocess.run([sys.executable, "-m", "process_probe", "3"], env=env, cwd=tmp_path, capture_output=True,
                           text=True, timeout=120)
    with open(tmp_path / "err.log", "w") as err:
        proc = launcher.POOL.spawn(["-m", "process_probe", "3"], stdout=subprocess.PIPE, stderr=err, env=env, cwd=tmp_path)
    assert isinstance(proc, launcher.LaunchedProcess)
    said = json.loads(proc.stdout.readline())
    assert proc.wait(30) == 3 == plain.returncode
    assert said["pid"] == proc.pid != os.getpid()
    assert said["cwd"] == str(tmp_path) and said["home"] == str(tmp_path / "home") and said["argv"] == ["3"]
    assert said["name"] == "__main__"
    expected = json.loads(plain.stdout)
    for key in ("threads", "interop_threads", "draw"):
        assert said[key] == expected[key], key
    assert (tmp_path / "err.log").read_text() == "probe: on stderr\n" == plain.stderr


def test_without_the_launcher_or_when_it_fails_nodes_start_as_plain_processes(tmp_path):
    """DIFFUSE_LAUNCHER=0: plain subprocesses, nothing said. A launcher that fails (here: not ready in time):
    one warning line, then plain subprocesses from then on."""
    code = (
        "import subprocess, sys\n"
        "from diffuse.local import launcher\n"
        "launcher.READY_TIMEOUT_S = float(sys.argv[1])\n"
        "for _ in range(2):\n"
        "    p = launcher.POOL.spawn(['-m', 'platform'], stdout=subprocess.PIPE)\n"
        "    print(type(p).__name__, p.stdout.read().strip() != '', p.wait(30), flush=True)\n"
    )
    off = subprocess.run([sys.executable, "-c", code, "120"], env=dict(subprocess_env(), DIFFUSE_LAUNCHER="0"),
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert off.returncode == 0 and off.stderr == "", off.stderr
    assert off.stdout.splitlines() == ["Popen True 0"] * 2
    failing = subprocess.run([sys.executable, "-c", code, "0"], env=subprocess_env(), capture_output=True, text=True,
                             timeout=120, cwd=tmp_path)
    assert failing.returncode == 0, failing.stderr
    assert failing.stdout.splitlines() == ["Popen True 0"] * 2
    lines = failing.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: the node launcher failed (no answer in 0 s)"), lines
