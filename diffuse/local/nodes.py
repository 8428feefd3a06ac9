"""Starting node processes on this machine (``--local-nodes N``) and stopping them.

Nodes are forked from a pre-imported launcher (``diffuse.local.launcher``), so each is ready in well under a
second plus its block loading; ``DIFFUSE_LAUNCHER=0`` starts them as plain ``python -m diffuse.node``
processes instead."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field

from diffuse.local import launcher
from diffuse.errors import DiffuseError

READY_TIMEOUT_S = 180.0


class LocalNode:
    def __init__(self, proc, log_path: str, address: str, key: str, data: str = ""):
        self.proc, self.log_path, self.address, self.key, self.data = proc, log_path, address, key, data

    def log_tail(self, n: int = 20) -> str:
        try:
            with open(self.log_path) as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""


class LocalNodes(list):
    """The nodes started here, in route order; ``stop()`` ends them all. ``client``: the one client identity
    they serve (``diffuse.wire.sealing.Identity``), or None if they serve any."""

    client = None

    def stop(self, hurry: bool = False) -> None:
        stop_local_nodes(self, 0.5 if hurry else 1.5)


def node_env() -> dict:
    """The environment local nodes start in."""
    offline = os.environ.get("DIFFUSE_HUB_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "0"))
    return dict(os.environ, HF_HUB_OFFLINE="1", DIFFUSE_HUB_OFFLINE=offline, PYTHONUNBUFFERED="1")


def warm_launcher() -> None:
    """Start the nodes' launcher now, without waiting: its imports overlap with the client's own loading."""
    launcher.POOL.warm(node_env())


@dataclass(frozen=True)
class LocalStart:
    """How local nodes start (``start_local_nodes``).

    ``scheme``: the transport they listen on. ``extra``: more node flags for every node; ``each``: more for
    each node in turn. ``groups`` G: each run of n/G nodes holds the whole stacks (one ring per group of
    branches). ``client``: the identity (``diffuse.wire.sealing.Identity``) of the one client they serve
    (``--allow-client``), as a run's own nodes do, so that no other user of this machine can open sessions on
    them; None: any. ``fixed`` False: nodes started without ``--blocks``, which load the slices each
    session's plan gives them."""

    scheme: str = "tcp"
    extra: tuple[str, ...] | list[str] = ()
    groups: int = 1
    client: object = None
    fixed: bool = True
    each: list[list[str]] | None = None


@dataclass
class LocalNodesPlan:
    """How many local nodes to start, at how many torch threads, and why."""

    count: int
    threads: int
    notes: list[str] = field(default_factory=list)


def plan_local_nodes(asked: int, stacks, patches: int, threads: int | None) -> LocalNodesPlan:
    """At one patch only one node computes at a time, so each may use the client's thread count, which
    keeps the bits of a whole run; with patches the nodes compute at once and share the cores."""
    import torch

    if asked < 1:
        raise DiffuseError("--local-nodes must be at least 1")
    notes = []
    longest = max((s.length for s in stacks), default=1)
    count = min(asked, longest)
    if count < asked:
        notes.append(f"{asked - count} of {asked} local nodes would hold no block (the longest stack has "
                     f"{longest}): starting {count}")
    if threads is None:
        threads = torch.get_num_threads() if patches == 1 else max(1, (os.cpu_count() or 2) // count)
    return LocalNodesPlan(count, threads, notes)


def local_nodes_plan(asked: int, stacks, patches: int, threads: int | None, groups: int = 1) -> LocalNodesPlan:
    """``plan_local_nodes`` for each of ``groups`` groups of branches alike (``asked`` nodes a group)."""
    plan = plan_local_nodes(asked, stacks, patches, threads)
    return plan if groups == 1 else LocalNodesPlan(plan.count * groups, plan.threads, plan.notes)


def start_local_nodes(model: str, n: int, threads: int | None = None, start: LocalStart | None = None,
                      **given) -> LocalNodes:
    """Start ``n`` nodes holding even slices of every stack; wait until each prints its address. How they
    start: ``start``, or the ``LocalStart`` fields ``given`` by name (``scheme=``, ``extra=``, ``groups=``,
    ``client=``, ``fixed=``, ``each=``)."""
    from diffuse.wire.transport import transport_for

    from diffuse.plan.hubmodel import complete_model

    complete_model(model)  # a Hub model's blocks, fetched here with progress: these nodes together hold them all
    start = start or LocalStart(**given)
    scheme, extra, groups, client, fixed, each = (start.scheme, start.extra, start.groups, start.client,
                                                  start.fixed, start.each)
    transport = transport_for(f"{scheme}://")
    nodes = LocalNodes()
    nodes.client = client
    if client is not None:
        extra = [*extra, "--allow-client", client.public_hex]
    env = node_env()
    if on_accelerator(extra):  # CUDA cannot be used in a process forked from one that imported it: plain starts
        env["DIFFUSE_LAUNCHER"] = "0"
    try:
        per = n // groups
        for i in range(n):
            listen = transport.local_listen(f"node-{os.getpid()}-{i}")
            log_fd, log_path = tempfile.mkstemp(prefix=f"diffuse-node{i + 1}-", suffix=".log")
            args = ["-m", "diffuse.node", "--model", model, "--listen", listen,
                    *(["--blocks", f"{i % per + 1}/{per}"] if fixed else []), "--ephemeral-key",
                    "--exit-with", str(os.getpid()), *extra, *(each[i] if each else [])]
            if threads:
                args += ["--threads", str(threads)]
            proc = launcher.POOL.spawn(args, stdout=subprocess.PIPE, stderr=log_fd, env=env)
            os.close(log_fd)
            nodes.append(LocalNode(proc, log_path, "", ""))
        for i, node in enumerate(nodes):
            line = _read_ready(node)
            node.address, node.key = line["address"], line["key"]
            node.data = line.get("data", "")  # the data address it bound (what it advertises may differ)
            # keep draining stdout so a chatty node never blocks on a full pipe
            threading.Thread(target=node.proc.stdout.read, daemon=True).start()
        return nodes
    except BaseException:
        stop_local_nodes(nodes)
        raise


def on_accelerator(args) -> bool:
    """Whether node flags ``args`` name a device other than the CPU (``--device auto`` may find one)."""
    args = list(args)
    for i, arg in enumerate(args):
        value = arg.split("=", 1)[1] if arg.startswith("--device=") else args[i + 1] if arg == "--device" and \
            i + 1 < len(args) else None
        if value is not None:
            return value != "cpu"
    return False


def _read_ready(node: LocalNode) -> dict:
    result: dict = {}

    def read():
        for raw in node.proc.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            if isinstance(msg, dict) and "diffuse_node" in msg:
                result.update(msg)
                return

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(READY_TIMEOUT_S)
    if not result:
        if not t.is_alive():  # its output ended: the node is exiting, if not yet reaped
            try:
                node.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        code = node.proc.poll()
        if code is None:
            raise DiffuseError(f"a local node was silent for {READY_TIMEOUT_S:.0f} s and is not ready; its log:\n"
                               f"{node.log_tail()}")
        said = [ln for ln in node.log_tail(40).splitlines() if ln.startswith("error: ")]
        if said:  # the node's own one-line error says why
            raise DiffuseError(f"a local node exited (status {code}) before it was ready: {said[-1][7:]}")
        raise DiffuseError(f"a local node exited (status {code}) before it was ready; its log:\n{node.log_tail()}")
    return result


def stop_local_nodes(nodes: list[LocalNode], grace_s: float = 1.5) -> None:
    """SIGTERM, then SIGKILL for a node still there after ``grace_s`` (one busy in a block, or frozen)."""
    for node in nodes:
        if node.proc.poll() is None:
            node.proc.terminate()
    deadline = time.monotonic() + grace_s
    for node in nodes:
        try:
            node.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            node.proc.kill()
            try:
                node.proc.wait(1.0)  # reaped here (or by its launcher), not left for init
            except subprocess.TimeoutExpired:
                pass
        try:
            os.unlink(node.log_path)
        except OSError:
            pass
