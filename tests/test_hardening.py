"""A node and a client survive hostile or careless peers; sessions belong to whoever opened them.

Real node processes, real ZeroMQ sockets on loopback, real libsodium sealing:
each bad message below is sent the way an attacker on the network would send it.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
import time

import cbor2
import families
import numpy as np
import pytest
import torch
import zmq

from conftest import THREADS, run_reference, subprocess_env

WAN_ARGS = families.call_args("wan")


# --------------------------------------------------------------------------- helpers


def _node(model: str, blocks: str | None, extra=(), home: str | None = None):
    cmd = [sys.executable, "-m", "diffuse.node", "--model", model, "--threads", str(THREADS), *extra]
    cmd += ["--blocks", blocks] if blocks else []
    if "--key-file" not in extra and home is None:
        cmd.append("--ephemeral-key")
    with tempfile.TemporaryFile("w+") as log:  # a file, not a pipe: a chatty node never blocks on it
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=subprocess_env(home))
        line = proc.stdout.readline()
        if not line:
            proc.wait(30)
            log.seek(0)
            raise AssertionError(f"node did not start: {log.read()[-2000:]}")
    return proc, json.loads(line)


def _stop(*procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def _client(model: str, nodes: list[str], tmp_path, home: str, extra=(), save: str | None = None):
    cmd = [sys.executable, "-m", "diffuse.run", "--model", model, "--nodes", ",".join(nodes), "--quiet",
           "--threads", str(THREADS), "--timeout", "60", "--out", str(tmp_path / "x.mp4"), *extra]
    if save:
        cmd += ["--save-array", save]
    for k, v in WAN_ARGS.items():
        cmd += ["--arg", f"{k}={json.dumps(v)}"]
    return subprocess.run(cmd, env=subprocess_env(home), capture_output=True, text=True, timeout=300, cwd=tmp_path)


def _said(run) -> str:
    return " ".join(run.stderr.split())


def _push(address: str, *messages: list[bytes]) -> None:
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(address)
    for m in messages:
        sock.send_multipart(m)
    sock.close()


def _request_raw(address: str, parts: list[bytes]) -> dict:
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_multipart(parts)
        assert sock.poll(10_000), "the node did not answer"
        return cbor2.loads(sock.recv())
    finally:
        sock.close()


def _sealed_by_hop(hop, header: bytes, tensor_frames: list[bytes]) -> list[bytes]:
    """A message sealed under a session's real hop key (so it authenticates) but built by hand."""
    from diffuse.plan import WIRE_VERSION
    from transport import seal

    hop.sent += 1  # the real sender moves on past this counter: no nonce is used twice
    counter = hop.sent
    env = cbor2.dumps({"v": WIRE_VERSION, "s": hop.session, "c": counter, "n": 2 + len(tensor_frames)})
    return [env, seal.seal_frame(hop.key, counter, 1, env, header)] + [
        seal.seal_frame(hop.key, counter, 2 + i, env, f) for i, f in enumerate(tensor_frames)]


class WanRing:
    """Two real local nodes holding halves of the tiny Wan; a pipeline here whose stack runs through
    whichever ring was opened last."""

    def __init__(self, model: str):
        import diffusers

        from diffuse.localnodes import start_local_nodes
        from diffuse.planner import analyze, make_plan

        torch.set_num_threads(THREADS)
        subject, draft = analyze(model)
        self.nodes = start_local_nodes(model, 2, THREADS, extra=["--log-level", "INFO"])
        self.plan = make_plan(subject, draft, [n.address for n in self.nodes], [n.key for n in self.nodes])
        self.pipe = diffusers.DiffusionPipeline.from_pretrained(model)
        self.pipe.set_progress_bar_config(disable=True)
        self.splitter = None
        self.expected = None
        self.rings = []

    def open(self, control_log: list | None = None):
        from diffuse.ring import Ring

        ring = Ring(self.plan, timeout_s=30)
        if control_log is not None:  # every control message the client sends, as it went on the wire
            request = ring.transport.request
            ring.transport.request = lambda a, m, t: (control_log.append((a, m)), request(a, m, t))[1]
        ring.open()
        self.rings.append(ring)
        return ring

    def generate(self, ring) -> np.ndarray:
        from diffuse.standin import Splitter

        if self.splitter is None:
            self.splitter = Splitter(self.pipe.transformer, self.plan, ring)
            self.splitter.install()
        self.splitter.ring = ring
        with torch.no_grad():
            out = self.pipe(**WAN_ARGS, generator=torch.Generator("cpu").manual_seed(0), output_type="np")[0]
        if self.expected is None:
            self.expected = out
        return out

    def status(self, k: int, **extra) -> dict:
        from diffuse.plugins import transport_for

        return transport_for(self.nodes[k].address).request(self.nodes[k].address, {"op": "status", **extra}, 10.0)

    def data_address(self, k: int) -> str:
        from diffuse.plugins import transport_for

        hello = transport_for(self.nodes[k].address).request(self.nodes[k].address, {"op": "hello", "wire": [1]}, 10.0)
        return hello["data"]

    def log(self, k: int) -> str:
        with open(self.nodes[k].log_path) as f:
            return f.read()

    def close(self) -> None:
        from diffuse.localnodes import stop_local_nodes

        for ring in self.rings:
            ring.close()
        stop_local_nodes(self.nodes)


@pytest.fixture(scope="module")
def wan(models, diffuse_home):
    env = WanRing(models("wan"))
    try:
        yield env
    finally:
        env.close()


# --------------------------------------------------------------------------- 1. one bad message never kills a node


def test_bad_messages_are_logged_and_the_node_keeps_serving(wan):
    ring = wan.open()
    first = wan.generate(ring)
    data0, control0 = ring.outbox.address, wan.nodes[0].address

    def envelope(**fields):
        env = dict({"v": 1, "s": ring.sid, "c": ring.send_hop.sent + 1, "n": 3}, **fields)
        return [cbor2.dumps(env), b"x" * 40, b"y" * 40]

    _push(data0,
          envelope(s=[1, 2, 3]),  # (a) a session id that is a list (unhashable)
          envelope(c=2 ** 70),  # (b) a live session id with a counter no nonce can hold
          envelope(c=0),
          [b"\xff" * 300, b"x"],  # an envelope far too large to be one
          # (d) authenticated (sealed under the session's hop key) but malformed headers
          _sealed_by_hop(ring.send_hop, cbor2.dumps([1, 2, 3]), []),
          _sealed_by_hop(ring.send_hop, cbor2.dumps({"op": "call", "tensors": [{"dtype": "float32"}]}), [b"\0" * 4]),
          _sealed_by_hop(ring.send_hop, cbor2.dumps({"op": "call", "tensors": [{"dtype": "float32", "shape": [-4]}]}),
                         [b"\0" * 4]),
          _sealed_by_hop(ring.send_hop, b"\xff\xfe", []))
    # (c) a control request in two parts, then one that is not CBOR: each gets an error, not a dead socket
    two_parts = _request_raw(control0, [cbor2.dumps({"op": "hello", "wire": [1]}), b"more"])
    assert two_parts["ok"] is False and "2 parts" in two_parts["error"]
    assert _request_raw(control0, [b"\xff\xff"])["ok"] is False
    assert _request_raw(control0, [cbor2.dumps({"op": "status", "session": [1]})])["ok"] is True
    time.sleep(1.0)

    assert wan.status(0)["ok"] and wan.nodes[0].proc.poll() is None
    second = wan.generate(ring)  # the same session still works, byte for byte
    ring.close()
    assert np.array_equal(first, second)
    log = wan.log(0)
    for reason in ("envelope's session id is not 16 bytes", "envelope's counter is not an integer in [1, 2**64)",
                   "is too large to be one", "header is a list, not a map", "malformed tensor description",
                   "malformed tensor shape", "header is not CBOR", "control request came in 2 parts",
                   "control request is not CBOR"):
        assert reason in log, reason
    assert "Traceback" not in log


# --------------------------------------------------------------------------- 2. sessions belong to their opener


def test_replayed_open_is_refused_and_sessions_answer_only_their_opener(wan):
    from transport.seal import load_identity

    control: list = []
    ring = wan.open(control)
    first = wan.generate(ring)
    t = ring.transport
    opens = [(a, m) for a, m in control if m.get("op") == "open"]
    assert len(opens) == 2

    def refusal(address, message) -> str:
        reply = t.request(address, message, 10.0)
        assert "box" in reply, reply  # the node knew who asked, so it seals its answer
        inner, sender = t.open_control(reply, ring.identity)
        assert inner["ok"] is False
        return inner["error"]

    for address, captured in opens:
        # the very message the client sent, replayed: it must not reset the live session's hop counters
        assert "stale or replayed open" in refusal(address, captured)
        # the same sealed open presented as a close must not end the session either
        assert "is not for 'close'" in refusal(address, dict(captured, op="close"))

    # another client key can neither close the session nor open one under its id
    stranger = load_identity(None)
    for k, stage in enumerate(ring.plan.route):
        close = dict(t.seal_control({"op": "close", "session": ring.sid}, ring._keys[k], stranger), op="close")
        reply = t.request(stage.address, close, 10.0)
        inner, sender = t.open_control(reply, stranger)
        assert sender == ring._keys[k]
        assert "opened by another client key" in inner["error"]
        hello = t.request(stage.address, {"op": "hello", "wire": [1]}, 10.0)
        payload = {"op": "open", "session": ring.sid, "challenge": hello["challenge"],
                   "model": ring.plan.model.content_hash, "slices": [], "in_key": os.urandom(32),
                   "out_key": os.urandom(32), "next": ring.inbox.address}
        inner, _ = t.open_control(t.request(stage.address, dict(t.seal_control(payload, ring._keys[k], stranger),
                                                                op="open"), 10.0), stranger)
        assert "already in use" in inner["error"]

    second = wan.generate(ring)  # nothing above touched the session
    assert np.array_equal(first, second)
    ring.close()
    # a closed session's id is never opened again, even with a fresh challenge
    hello = t.request(ring.plan.route[0].address, {"op": "hello", "wire": [1]}, 10.0)
    address, captured = opens[0]
    payload = {"op": "open", "session": ring.sid, "challenge": hello["challenge"], "model": ring.plan.model.content_hash,
               "slices": [], "in_key": os.urandom(32), "out_key": os.urandom(32), "next": ring.inbox.address}
    assert "already in use on this node, or was" in refusal(
        address, dict(t.seal_control(payload, ring._keys[0], ring.identity), op="open"))


def test_client_takes_only_replies_sealed_by_the_node_for_the_operation(wan):
    from diffuse.errors import NodeError
    from transport.seal import load_identity

    ring = wan.open()
    t = ring.transport
    address, real = ring.plan.route[0].address, ring._keys[0]
    impostor = load_identity(None)
    answers = iter([
        {"ok": True},  # a plain "yes": anyone could have sent it
        t.seal_control({"ok": True, "re": "close"}, ring.identity.public, impostor),  # sealed, by another key
        # the client's own sealed request sent back as if from the node: crypto_box keys are the same
        # from both ends, so it opens "from the node", but it answers no operation
        dict(t.seal_control({"ok": True, "op": "close"}, real, ring.identity), **{"from": real}),
        # sealed and answering, but another operation (a reply swapped between requests)
        dict(t.seal_control({"ok": True, "re": "open"}, real, ring.identity), **{"from": real}),
    ])
    original = t.request
    t.request = lambda a, m, timeout: next(answers)
    try:
        with pytest.raises(NodeError, match="without sealing the reply"):
            ring._sealed_request(address, "close", {"session": ring.sid}, real, 5)
        with pytest.raises(NodeError, match="sealed by another key than the node's"):
            ring._sealed_request(address, "close", {"session": ring.sid}, real, 5)
        for _ in range(2):
            with pytest.raises(NodeError, match="does not answer close"):
                ring._sealed_request(address, "close", {"session": ring.sid}, real, 5)
    finally:
        t.request = original
    ring.close()
    assert ring.node_stats and all(ns.get("messages") == 0 for ns in ring.node_stats)  # a real, sealed close


# --------------------------------------------------------------------------- 5. junk at the client


def test_junk_on_the_client_inbox_is_dropped_and_the_run_goes_on(wan):
    from transport.seal import new_key

    from diffuse.transport_api import Hop

    ring = wan.open()
    first = wan.generate(ring)
    dropped = ring.stats.dropped
    forged_hop = Hop(ring.sid, new_key())  # the right session id, sealed under a key nobody agreed
    _push(ring.inbox.address,
          [b"not cbor at all"],
          [cbor2.dumps({"v": 1, "s": os.urandom(16), "c": 1, "n": 2}), b"x"],
          ring.transport.seal(forged_hop, {"op": "result", "seq": 1, "out": None}, []))
    time.sleep(0.5)
    second = wan.generate(ring)
    assert np.array_equal(first, second)
    assert ring.stats.dropped - dropped == 3
    ring.close()


# --------------------------------------------------------------------------- 6. nothing leaks per session


def test_sessions_leave_no_sockets_and_errors_stay_bounded(wan):
    from diffuse.node import MAX_ERRORS

    def count(what):
        return [wan.status(k)[what] for k in (0, 1)]

    sessions, outboxes = count("sessions"), count("outboxes")
    for _ in range(3):
        ring = wan.open()
        assert count("outboxes") == [n + 1 for n in outboxes]  # one per session, not one per address forever
        ring.close()
    assert count("outboxes") == outboxes and count("sessions") == sessions
    # data for sessions nobody opened: each is noted for `status`, but only the latest few are kept
    junk = [[cbor2.dumps({"v": 1, "s": os.urandom(16), "c": 1, "n": 2}), b"x"] for _ in range(MAX_ERRORS + 50)]
    _push(wan.data_address(0), *junk)
    deadline = time.monotonic() + 20
    while wan.log(0).count("unknown session") < len(junk) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert wan.status(0)["errors_kept"] == MAX_ERRORS


# --------------------------------------------------------------------------- 3. a client identity that lasts


def test_client_key_lets_an_allowed_client_in_and_keeps_others_out(models, tmp_path, diffuse_home):
    from transport.seal import load_identity

    model = models("wan")
    allowed_file, other_file = tmp_path / "keys" / "allowed.key", tmp_path / "keys" / "other.key"
    allowed = load_identity(str(allowed_file))
    node_home = str(tmp_path / "node-home")  # no --key-file: the node's key goes to $DIFFUSE_HOME/node.key
    proc, ready = _node(model, "all", ["--allow-client", allowed.public_hex], home=node_home)
    pinned = [f"{ready['address']}#{ready['key']}"]
    try:
        ok = _client(model, pinned, tmp_path, diffuse_home, ["--client-key", str(allowed_file)],
                     save=str(tmp_path / "ok.npy"))
        refused = _client(model, pinned, tmp_path, diffuse_home, ["--client-key", str(other_file)])
        ephemeral = _client(model, pinned, tmp_path, diffuse_home)
    finally:
        _stop(proc)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert f"client key {allowed.public_hex}" in _said(ok)
    # the other identity was created for the run (0600), shown, and refused
    assert stat.S_IMODE(os.stat(other_file).st_mode) == 0o600
    assert f"client key {load_identity(str(other_file)).public_hex}" in _said(refused)
    for run in (refused, ephemeral):
        assert run.returncode == 2
        assert "this node does not serve your client key" in _said(run)
        assert "Traceback" not in run.stderr
    key_file = os.path.join(node_home, "node.key")
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    with open(key_file, "rb") as f:
        assert f.read()[:32].hex() == ready["key"]


# --------------------------------------------------------------------------- 8. mistakes get clear errors


def test_address_key_and_file_mistakes_are_clear_errors(models, tmp_path, wan):
    model = models("wan")
    no_scheme = _client(model, ["127.0.0.1:7000"], tmp_path, str(tmp_path))
    assert no_scheme.returncode == 2
    assert "has no scheme: write it as tcp://HOST:PORT" in _said(no_scheme)

    bad = subprocess.run([sys.executable, "-m", "diffuse.node", "--model", model, "--allow-client", "zz"],
                         env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert "'zz' is not a client public key (64 hex digits" in _said(bad)
    assert "Traceback" not in bad.stderr

    home = tmp_path / "damaged-home"
    home.mkdir()
    (home / "known_nodes.json").write_text("{not json")
    damaged = _client(model, [n.address for n in wan.nodes], tmp_path, str(home))  # unpinned: the file is read
    assert damaged.returncode == 2
    assert f"the known-nodes file {home / 'known_nodes.json'} cannot be read" in _said(damaged)
    for run in (no_scheme, damaged):
        assert "Traceback" not in run.stderr


def test_attention_is_checked_before_any_block_is_loaded(models, diffuse_home):
    from diffuse.errors import NodeError
    from diffuse.planner import analyze, make_plan
    from diffuse.plugins import transport_for
    from diffuse.ring import Ring

    model = models("wan")
    proc, ready = _node(model, None)  # loads what each session asks for
    try:
        t = transport_for(ready["address"])
        before = t.request(ready["address"], {"op": "status"}, 10.0)["params"]
        subject, draft = analyze(model)
        ring = Ring(make_plan(subject, draft, [ready["address"]], [ready["key"]]), timeout_s=10, attention="fast")
        with pytest.raises(NodeError, match="unknown attention path 'fast'"):
            ring.open()
        assert t.request(ready["address"], {"op": "status"}, 10.0)["params"] == before
    finally:
        _stop(proc)


def test_a_transport_plugin_missing_methods_is_refused_with_its_name():
    from diffuse.errors import PluginError
    from diffuse.hookspecs import hookimpl
    from diffuse.plugins import plugin_manager, transport_for

    class HalfTransport:
        scheme = "half"

        def request(self, address, message, timeout_s):
            return {}

    class Plugin:
        @hookimpl
        def diffuse_transport(self, scheme):
            return HalfTransport() if scheme == "half" else None

    pm = plugin_manager()
    pm.register(Plugin(), name="half-transport")
    try:
        with pytest.raises(PluginError, match=r"plugin 'half-transport' breaks the transport contract: the "
                                              r"HalfTransport it returns for half:// lacks envelope, inbox"):
            transport_for("half://somewhere")
        assert transport_for("tcp://127.0.0.1:1").scheme == "tcp"
    finally:
        pm.unregister(name="half-transport")
    with pytest.raises(PluginError, match="has no scheme: write it as tcp://HOST:PORT"):
        transport_for("127.0.0.1:7000")


# --------------------------------------------------------------------------- 7. uneven shares


def _plan(holds_stacks=(("blocks", 4), ("single", 2)), nodes=2):
    from diffuse.plan import ModelIdentity, SlicingPlan, StackPlan, Stage

    return SlicingPlan(model=ModelIdentity("m", "transformer", "X", "h"),
                       stacks=[StackPlan(p, n, "x") for p, n in holds_stacks],
                       route=[Stage(f"tcp://n{i}:1") for i in range(nodes)])


def _r(stack, a, b):
    return {"stack": stack, "start": a, "stop": b}


def test_route_from_what_nodes_hold_checks_the_chain():
    from diffuse.errors import DiffuseError
    from diffuse.ring import route_from_holds

    plan = _plan()
    assert route_from_holds(plan, [[_r("blocks", 0, 1)], [_r("blocks", 1, 4), _r("single", 0, 2)]])
    assert [[str(s) for s in st.slices] for st in plan.route] == [
        ["blocks[0:1]", "single[0:0]"], ["blocks[1:4]", "single[0:2]"]]  # n0 hands single on untouched
    plan = _plan()
    assert not route_from_holds(plan, [[_r("blocks", 0, 1)], None])  # a node that loads on demand: even split
    assert plan.route[0].slices == []
    for holds, why in [
        ([[_r("blocks", 0, 1), _r("single", 0, 2)], [_r("blocks", 2, 4)]], r"blocks\[1:2\] is held by no node before tcp://n1:1"),
        ([[_r("blocks", 0, 2), _r("single", 0, 2)], [_r("blocks", 1, 4)]], r"blocks\[1:2\] is held twice"),
        ([[_r("blocks", 0, 1), _r("single", 0, 2)], [_r("blocks", 1, 3)]], r"blocks\[3:4\] is held by no node"),
    ]:
        with pytest.raises(DiffuseError, match=why):
            route_from_holds(_plan(), holds)
    # a node after the one holding a stack's last blocks holds nothing of it: it passes the result on
    plan = _plan()
    assert route_from_holds(plan, [[_r("blocks", 0, 4), _r("single", 0, 2)], [_r("blocks", 4, 4)]])
    assert [str(s) for s in plan.route[1].slices] == ["blocks[4:4]", "single[2:2]"]


def test_uneven_blocks_run_byte_identical_to_the_whole_model(models, tmp_path, diffuse_home):
    model = models("wan")
    reference = run_reference(model, WAN_ARGS, str(tmp_path / "reference.npy"))
    one, ready1 = _node(model, "blocks[0:1]")
    three, ready3 = _node(model, "blocks[1:4]")
    try:
        run = _client(model, [f"{r['address']}#{r['key']}" for r in (ready1, ready3)], tmp_path, diffuse_home,
                      save=str(tmp_path / "uneven.npy"))
    finally:
        _stop(one, three)
    assert run.returncode == 0, run.stderr[-2000:]
    said = _said(run)
    assert f"node {ready1['address']}: blocks[0:1]" in said and f"node {ready3['address']}: blocks[1:4]" in said
    assert np.load(tmp_path / "uneven.npy").tobytes() == reference.tobytes()
