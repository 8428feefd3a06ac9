"""What a newcomer meets first: mistakes refused in one line before anything starts, a wrong key, an address
nothing answers at and a dead or frozen node each named within seconds, Ctrl-C that ends everything at once.

Real client and node processes on loopback, the embedded model.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import node_process, run_client, subprocess_env

RUN = [sys.executable, "-m", "diffuse.run", "--quiet"]


def _as_in_a_terminal() -> None:
    """Ctrl-C as a terminal's foreground job takes it: a suite started in the background of a shell runs with
    SIGINT ignored, and a child would keep that (Python then installs no KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Client:
    """``python -m diffuse.run`` in its own process group, its stderr read as it comes."""

    def __init__(self, args: list[str], home: str, cwd):
        self.proc = subprocess.Popen(RUN + args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     env=subprocess_env(home), cwd=cwd, start_new_session=True,
                                     preexec_fn=_as_in_a_terminal)
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


@pytest.fixture(scope="module")
def nodes(diffuse_home):
    """Three nodes of the embedded model, started together: A holds 1/2, B and C each hold 2/2 (A+B and A+C are
    whole rings). Shared by the tests below in file order; the last one freezes B and kills C."""
    from diffuse.plan.shipped import default_model_dir

    procs = [node_process(["--model", default_model_dir(), "--blocks", share, "--ephemeral-key", "--log-level",
                           "WARNING"], env=subprocess_env(diffuse_home)) for share in ("1/2", "2/2", "2/2")]
    try:
        yield [(proc, json.loads(proc.stdout.readline())) for proc in procs]
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait(10)


def _pinned(node) -> str:
    return f"{node[1]['address']}#{node[1]['key']}"


def test_a_wrong_key_and_a_dead_node_each_end_with_a_line_naming_that_node(nodes, tmp_path, diffuse_home,
                                                                            monkeypatch):
    """A+B with B listed under another key than its own, then in B's place an address nothing answers at. Each
    run's last line names that node and the cause, not the route order."""
    import diffuse.client.handshake

    monkeypatch.setattr(diffuse.client.handshake, "HELLO_TIMEOUT_S", 3.0)  # the dead node's hello: 3 s, not 10
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there
    first, second = _pinned(nodes[0]), nodes[1][1]["address"]
    cases = {second: f"{first},{second}#{'0' * 64}", dead: f"{first},{dead}"}
    for named, pinned in cases.items():
        run = run_client(["--prompt", "a red circle moving right", "--nodes", pinned, "--quiet", "--out",
                          str(tmp_path / "o.gif")], diffuse_home)
        last = run.stderr.strip().splitlines()[-1]
        assert run.returncode == 2 and last.startswith(f"error: node {named}:"), run.stderr
        assert "list the nodes in the order" not in last and "Traceback" not in run.stderr, run.stderr
        assert ("was pinned" in last) if named != dead else ("answer" in last or "reach" in last), last


def test_a_dead_or_frozen_node_is_named_within_seconds(nodes, tmp_path, diffuse_home):
    """Two runs at once, A+B and A+C; B frozen (SIGSTOP) under the first and C killed (SIGKILL) under the second:
    each client exits within 15 s naming its node."""
    cases = [(signal.SIGSTOP, nodes[1]), (signal.SIGKILL, nodes[2])]
    clients = [Client(["--prompt", "a red circle moving right", "--steps", "400", "--nodes",
                       f"{_pinned(nodes[0])},{_pinned(node)}", "--out", str(tmp_path / f"o{k}.mp4")], diffuse_home,
                      tmp_path) for k, (_, node) in enumerate(cases)]
    for client in clients:
        client.wait_for("node tcp://")  # the session is open: the pipeline is running
    time.sleep(2.0)
    for how, (proc, _) in cases:
        proc.send_signal(how)
    t0, ended = time.monotonic(), {}
    while len(ended) < len(clients) and time.monotonic() < t0 + 60:
        ended.update({k: time.monotonic() - t0 for k, c in enumerate(clients) if k not in ended and c.proc.poll()
                      is not None})
        time.sleep(0.05)
    for k, ((how, (_, ready)), client) in enumerate(zip(cases, clients)):
        client.finish(timeout=10)
        took = ended.get(k, float("inf"))
        assert client.proc.returncode == 2, (how, client.said)
        assert took < 15, f"{how.name}: {took:.1f} s: {client.said}"
        assert f"node {ready['address']}:" in client.said and "dead or frozen" in client.said, client.said
        assert "Traceback" not in client.said
        # the wait it names is the wait it made: that many pings, each given that long, all unanswered
        from diffuse.client.handshake import PROBE_TIMEOUT_S

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
    assert _group(client.proc.pid) == [], "a process of the run's group was left"  # half a second after the exit


def _group(pgid: int) -> list[str]:
    """The processes of process group ``pgid``, zombies included (a process that has exited but that its parent
    has not reaped, left for the machine's init to collect: here that takes seconds): their command lines."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, _, group = f.read().rsplit(")", 1)[1].split()[:3]
            with open(f"/proc/{pid}/cmdline") as f:
                command = f.read().replace("\0", " ").strip()
        except OSError:
            continue
        if int(group) == pgid:
            found.append(f"{pid} ({state}): {command[:200]}")
    return found
