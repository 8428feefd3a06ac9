"""What a newcomer meets first: mistakes refused in one line before anything starts, a dead or
frozen node named within seconds, Ctrl-C that ends everything at once.

Real client and node processes on loopback, the embedded model.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import node_process, run_client, subprocess_env

RUN = [sys.executable, "-m", "diffuse.run", "--quiet"]


class Client:
    """``python -m diffuse.run`` in its own process group, its stderr read as it comes."""

    def __init__(self, args: list[str], home: str, cwd):
        self.proc = subprocess.Popen(RUN + args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     env=subprocess_env(home), cwd=cwd, start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self.reader.start()

    def wait_for(self, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None, "".join(self.lines)
            assert time.monotonic() < deadline, "".join(self.lines)
            time.sleep(0.1)

    def finish(self, timeout: float) -> float:
        t0 = time.monotonic()
        self.proc.wait(timeout)
        self.reader.join(5)
        return time.monotonic() - t0

    @property
    def said(self) -> str:
        return " ".join("".join(self.lines).split())


@pytest.mark.parametrize("args,why", [
    (["--steps", "-3"], "argument --steps: -3 is less than 1"),
    (["--steps", "0"], "argument --steps: 0 is less than 1"),
    (["--prompt", "x", "--height", "33"], "have to be divisible by 16"),
    (["--prompt", "x", "--arg", "guidance_scale=abc"], "--arg guidance_scale=abc: WanPipeline takes a number"),
    ([], "Provide either `prompt` or `prompt_embeds`"),
    (["--prompt", "x", "--nodes", "tcp://127.0.0.1:7#nothex"], "is not a public key"),
    (["--prompt", "x", "--nodes", "127.0.0.1:7"], "has no scheme"),
])
def test_bad_values_are_one_line_exit_2_and_nothing_starts(args, why, tmp_path, diffuse_home, monkeypatch):
    """The first case in a real process, as typed; the others through the command's own code in this one."""
    if args == ["--steps", "-3"]:
        run = subprocess.run(RUN + args + ["--out", str(tmp_path / "o.mp4")], capture_output=True, text=True,
                             env=subprocess_env(diffuse_home), timeout=120, cwd=tmp_path)
    else:
        monkeypatch.chdir(tmp_path)
        run = run_client(["--quiet", *args, "--out", str(tmp_path / "o.mp4")], diffuse_home)
    assert run.returncode == 2, run.stderr
    assert why in " ".join(run.stderr.split())
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert "starting" not in run.stderr and not (tmp_path / "o.mp4").exists()


def _nodes(shares, home: str):
    """Nodes of the embedded model holding these shares, started together."""
    from diffuse.default_model import default_model_dir

    procs = [node_process(["--model", default_model_dir(), "--blocks", share, "--ephemeral-key", "--log-level",
                           "WARNING"], env=subprocess_env(home)) for share in shares]
    return [(proc, json.loads(proc.stdout.readline())) for proc in procs]


def test_a_dead_or_frozen_node_is_named_within_seconds(tmp_path, diffuse_home):
    """Node 2 frozen (SIGSTOP) under one run, then, thawed, killed (SIGKILL) under the next: each client exits
    within 15 s naming that node."""
    nodes = _nodes(("1/2", "2/2"), diffuse_home)
    runs = []
    try:
        addresses = ",".join(f"{r['address']}#{r['key']}" for _, r in nodes)
        for how in (signal.SIGSTOP, signal.SIGKILL):
            client = Client(["--prompt", "a red circle moving right", "--steps", "400", "--nodes", addresses,
                             "--out", str(tmp_path / "o.mp4")], diffuse_home, tmp_path)
            client.wait_for("node tcp://")  # the session is open: the pipeline is running
            time.sleep(2.0)
            nodes[1][0].send_signal(how)
            runs.append((how, client, client.finish(timeout=60)))
            if how == signal.SIGSTOP:
                nodes[1][0].send_signal(signal.SIGCONT)  # thawed, it serves the next run until it is killed
    finally:
        for proc, _ in nodes:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait(10)
    assert [how for how, _, _ in runs] == [signal.SIGSTOP, signal.SIGKILL]
    for how, client, took in runs:
        assert client.proc.returncode == 2, (how, client.said)
        assert took < 15, f"{how.name}: {took:.1f} s: {client.said}"
        assert f"node {nodes[1][1]['address']}:" in client.said and "dead or frozen" in client.said, client.said
        assert "Traceback" not in client.said
        # the wait it names is the wait it made: that many pings, each given that long, all unanswered
        from diffuse.handshake import PROBE_TIMEOUT_S

        said = re.search(r"no answer to (a ping|(\d+) pings in a row), each given ([\d.]+) s", client.said)
        assert said and float(said.group(3)) == PROBE_TIMEOUT_S, client.said
        assert took >= int(said.group(2) or 1) * PROBE_TIMEOUT_S, (took, client.said)


def test_ctrl_c_ends_the_run_and_its_local_nodes_within_two_seconds(tmp_path, diffuse_home):
    client = Client(["--prompt", "a red circle moving right", "--steps", "400", "--out", str(tmp_path / "o.mp4")],
                    diffuse_home, tmp_path)
    client.wait_for("node tcp://")
    time.sleep(1.0)
    os.killpg(client.proc.pid, signal.SIGINT)  # what a terminal does: the whole process group
    took = client.finish(timeout=30)
    assert took < 2.0, f"{took:.1f} s: {client.said}"
    assert client.proc.returncode == 130, client.said
    assert "Traceback" not in client.said and "interrupted" in client.said
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", "--", f"--exit-with {client.proc.pid}( |$)"], capture_output=True, text=True)
    assert left.returncode == 1 and left.stdout.strip() == "", f"local nodes (or their launcher) left running: {left}"
    assert _group(client.proc.pid) == [], "a process of the run's group was left running"  # a second after Ctrl-C


def _group(pgid: int) -> list[str]:
    """The live processes of process group ``pgid`` (zombies, which have exited, left out): their command lines."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, _, group = f.read().rsplit(")", 1)[1].split()[:3]
            with open(f"/proc/{pid}/cmdline") as f:
                command = f.read().replace("\0", " ").strip()
        except OSError:
            continue
        if int(group) == pgid and state != "Z":
            found.append(f"{pid}: {command[:200]}")
    return found
