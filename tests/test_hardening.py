"""A node and a client survive hostile or careless peers; sessions belong to whoever opened them.

Real node processes, real ZeroMQ sockets on loopback, real libsodium sealing:
each bad message below is sent the way an attacker on the network would send it.
"""

from __future__ import annotations

import json
import os
import re
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

from conftest import THREADS, Reference, node_process, run_client, subprocess_env

WAN_ARGS = families.call_args("wan")


# --------------------------------------------------------------------------- helpers


def _node(model: str, blocks: str | None, extra=(), home: str | None = None, log_path: str | None = None):
    args = ["--model", model, "--threads", str(THREADS), *extra]
    args += ["--blocks", blocks] if blocks else []
    if "--key-file" not in extra and home is None:
        args.append("--ephemeral-key")
    # a file, not a pipe: a chatty node never blocks on it
    with (open(log_path, "w+") if log_path else tempfile.TemporaryFile("w+")) as log:
        proc = node_process(args, stderr=log, env=subprocess_env(home))
        line = proc.stdout.readline()
        if not line:
            proc.wait(30)
            log.seek(0)
            raise AssertionError(f"node did not start: {log.read()[-2000:]}")
    return proc, json.loads(line)


def _nodes(model: str, slices: list[str]):
    """Nodes holding these slices, started together (each still has its own log file)."""
    procs, logs = [], []
    for blocks in slices:
        log = tempfile.TemporaryFile("w+")
        procs.append(node_process(["--model", model, "--threads", str(THREADS), "--blocks", blocks, "--ephemeral-key"],
                                  stderr=log))
        logs.append(log)
    out = []
    for proc, log in zip(procs, logs):
        with log:
            line = proc.stdout.readline()
            if not line:
                proc.wait(30)
                log.seek(0)
                raise AssertionError(f"node did not start: {log.read()[-2000:]}")
        out.append((proc, json.loads(line)))
    return out


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
    argv = ["--model", model, "--nodes", ",".join(nodes), "--quiet", "--threads", str(THREADS), "--timeout", "60",
            "--out", str(tmp_path / "x.mp4"), *extra]
    if save:
        argv += ["--save-array", save]
    for k, v in WAN_ARGS.items():
        argv += ["--arg", f"{k}={json.dumps(v)}"]
    return run_client(argv, home)


def _said(run) -> str:
    return " ".join(run.stderr.split())


def _push(address: str, *messages: list[bytes], hop=None, server: bytes | None = None) -> None:
    """Send ``messages`` to a data address as a raw PUSH peer; with ``hop`` (a ``frames.Hop``) and ``server`` (the
    data port's CURVE key), holding the CURVE keys that hop's real sending end holds (without: a stranger, whom
    the receiver never lets in)."""
    from test_sessions_bounded import admitted

    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    if hop is not None:
        admitted(sock, hop.key, server)
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
    from diffuse.wire import sealing
    from diffuse.plan.contracts import WIRE_VERSION

    hop.sent += 1  # the real sender moves on past this counter: no nonce is used twice
    counter = hop.sent
    env = cbor2.dumps({"v": WIRE_VERSION, "s": hop.session, "c": counter, "n": 2 + len(tensor_frames)})
    return [env, sealing.seal_frame(hop.key, counter, 1, env, header)] + [
        sealing.seal_frame(hop.key, counter, 2 + i, env, f) for i, f in enumerate(tensor_frames)]


class WanRing:
    """Two real local nodes holding halves of the tiny Wan; a pipeline loaded by plain diffusers here,
    split again and again over them (``diffuse.split``), several sessions open at once."""

    def __init__(self, model: str):
        import diffusers

        from diffuse.local.nodes import start_local_nodes

        torch.set_num_threads(THREADS)
        self.nodes = start_local_nodes(model, 2, THREADS, extra=["--log-level", "INFO"])
        self.pinned = [f"{n.address}#{n.key}" for n in self.nodes]
        self.pipe = diffusers.DiffusionPipeline.from_pretrained(model)
        self.pipe.set_progress_bar_config(disable=True)
        self.expected = None
        self.splits = []

    def open(self, control_log: list | None = None):
        """A new session over the two nodes (its ``diffuse.client.ring.Ring``), left open until ``close``."""
        import diffuse
        from diffuse.client.handshake import Handshake

        split = diffuse.split(self.pipe, nodes=self.pinned, timeout=30)
        request = Handshake._request
        if control_log is not None:  # every control message the client sends, as it goes to the transport
            Handshake._request = lambda hs, k, m, t: (control_log.append((hs.plan.route[k].address, m)),
                                                      request(hs, k, m, t))[1]
        try:
            split.__enter__()
        finally:
            Handshake._request = request
        self.splits.append(split)
        return split.ring

    def _split_of(self, ring):
        return next(s for s in self.splits if s.ring is ring)

    def generate(self, ring) -> np.ndarray:
        split = self._split_of(ring)
        split.splitter.attach(ring)  # the pipeline runs through whichever session is asked for
        with torch.no_grad():
            out = self.pipe(**WAN_ARGS, generator=torch.Generator("cpu").manual_seed(0), output_type="np")[0]
        if self.expected is None:
            self.expected = out
        return out

    def close_ring(self, ring) -> None:
        split = self._split_of(ring)
        split.__exit__(None, None, None)
        self.splits.remove(split)

    def status(self, k: int, **extra) -> dict:
        from diffuse.wire.transport import transport_for

        return transport_for(self.nodes[k].address).request(self.nodes[k].address, {"op": "status", **extra}, 10.0)

    def data_address(self, k: int) -> str:
        from diffuse.wire.transport import transport_for

        hello = transport_for(self.nodes[k].address).request(self.nodes[k].address, {"op": "hello", "wire": [1]}, 10.0)
        return hello["data"]

    def log(self, k: int) -> str:
        with open(self.nodes[k].log_path) as f:
            return f.read()

    def close(self) -> None:
        try:
            for split in list(self.splits):
                split.__exit__(None, None, None)
        finally:
            self.nodes.stop()


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
    channel, sid = ring.channel, ring.handshake.sid
    data0, control0 = channel.outbox.address, wan.nodes[0].address

    def envelope(**fields):
        env = dict({"v": 1, "s": sid, "c": channel.send_hop.sent + 1, "n": 3}, **fields)
        return [cbor2.dumps(env), b"x" * 40, b"y" * 40]

    _push(data0,
          envelope(s=[1, 2, 3]),  # (a) a session id that is a list (unhashable)
          envelope(c=2 ** 70),  # (b) a live session id with a counter no nonce can hold
          envelope(c=0),
          [b"\xff" * 300, b"x"],  # an envelope far too large to be one
          # (d) authenticated (sealed under the session's hop key) but malformed headers
          _sealed_by_hop(channel.send_hop, cbor2.dumps([1, 2, 3]), []),
          _sealed_by_hop(channel.send_hop, cbor2.dumps({"op": "call", "tensors": [{"dtype": "float32"}]}),
                         [b"\0" * 4]),
          _sealed_by_hop(channel.send_hop,
                         cbor2.dumps({"op": "call", "tensors": [{"dtype": "float32", "shape": [-4]}]}), [b"\0" * 4]),
          _sealed_by_hop(channel.send_hop, b"\xff\xfe", []), hop=channel.send_hop, server=ring.handshake.keys[0])
    # (c) a control request in two parts, then one that is not CBOR: each gets an error, not a dead socket
    two_parts = _request_raw(control0, [cbor2.dumps({"op": "hello", "wire": [1]}), b"more"])
    assert two_parts["ok"] is False and "2 parts" in two_parts["error"]
    assert _request_raw(control0, [b"\xff\xff"])["ok"] is False
    assert _request_raw(control0, [cbor2.dumps({"op": "status", "session": [1]})])["ok"] is True
    time.sleep(1.0)

    assert wan.status(0)["ok"] and wan.nodes[0].proc.poll() is None
    second = wan.generate(ring)  # the same session still works, byte for byte
    wan.close_ring(ring)
    assert np.array_equal(first, second)
    log = wan.log(0)
    for reason in ("envelope's session id is not 16 bytes", "envelope's counter is not an integer in [1, 2**64)",
                   "is too large to be one", "header is a list, not a map", "malformed tensor description",
                   "malformed tensor shape", "header is not CBOR", "control request came in 2 parts",
                   "control request is not CBOR"):
        assert reason in log, reason
    assert "Traceback" not in log


# --------------------------------------------------------------------------- 2. sessions belong to their opener


def _stage_payload(ring, k: int, sid: bytes, challenge) -> dict:
    """A well-formed sealed-open payload for route position ``k`` (only the session id is wrong)."""
    from diffuse.plan.messages import StagePlan

    plan = ring.plan
    stage = StagePlan(plan.model.content_hash, plan.compute_dtype, plan.route[k].slices,
                      ring.channel.inbox.address if ring.channel else "tcp://127.0.0.1:1")
    return {"op": "open", "session": sid, "challenge": challenge, "in_key": os.urandom(32),
            "out_key": os.urandom(32), "stage": stage.to_dict()}


def test_replayed_open_is_refused_and_sessions_answer_only_their_opener(wan):
    from diffuse.wire.sealing import load_identity, open_control, seal_control

    control: list = []
    ring = wan.open(control)
    first = wan.generate(ring)
    hs = ring.handshake
    t = hs.transports[0]
    opens = [(a, m) for a, m in control if m.get("op") == "open"]
    assert len(opens) == 2

    def refusal(address, message) -> str:
        reply = t.request(address, message, 10.0)
        assert "box" in reply, reply  # the node knew who asked, so it seals its answer
        inner, sender = open_control(reply, ring.identity)
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
        close = dict(seal_control({"op": "close", "session": hs.sid}, hs.keys[k], stranger), op="close")
        reply = t.request(stage.address, close, 10.0)
        inner, sender = open_control(reply, stranger)
        assert sender == hs.keys[k]
        assert "opened by another client key" in inner["error"]
        hello = t.request(stage.address, {"op": "hello", "wire": [1]}, 10.0)
        payload = _stage_payload(ring, k, hs.sid, hello["challenge"])
        inner, _ = open_control(t.request(stage.address, dict(seal_control(payload, hs.keys[k], stranger),
                                                              op="open"), 10.0), stranger)
        assert "already in use" in inner["error"]

    second = wan.generate(ring)  # nothing above touched the session
    assert np.array_equal(first, second)
    wan.close_ring(ring)
    # a closed session's id is never opened again, even with a fresh challenge
    address = ring.plan.route[0].address
    hello = t.request(address, {"op": "hello", "wire": [1]}, 10.0)
    payload = _stage_payload(ring, 0, hs.sid, hello["challenge"])
    assert "already in use on this node, or was" in refusal(
        address, dict(seal_control(payload, hs.keys[0], ring.identity), op="open"))


def test_client_takes_only_replies_sealed_by_the_node_for_the_operation(wan):
    from diffuse.errors import NodeError
    from diffuse.wire.sealing import load_identity, seal_control

    ring = wan.open()
    hs = ring.handshake
    t = hs.transports[0]
    real = hs.keys[0]
    impostor = load_identity(None)
    answers = iter([
        {"ok": True},  # a plain "yes": anyone could have sent it
        seal_control({"ok": True, "re": "close"}, ring.identity.public, impostor),  # sealed, by another key
        # the client's own sealed request sent back as if from the node: crypto_box keys are the same
        # from both ends, so it opens "from the node", but it answers no operation
        dict(seal_control({"ok": True, "op": "close"}, real, ring.identity), **{"from": real}),
        # sealed and answering, but another operation (a reply swapped between requests)
        dict(seal_control({"ok": True, "re": "open"}, real, ring.identity), **{"from": real}),
    ])
    original = t.request
    t.request = lambda a, m, timeout: next(answers)
    try:
        with pytest.raises(NodeError, match="without sealing the reply"):
            hs.sealed(0, "close", {"session": hs.sid}, 5)
        with pytest.raises(NodeError, match="sealed by another key than the node's"):
            hs.sealed(0, "close", {"session": hs.sid}, 5)
        for _ in range(2):
            with pytest.raises(NodeError, match="does not answer close"):
                hs.sealed(0, "close", {"session": hs.sid}, 5)
    finally:
        t.request = original
    wan.close_ring(ring)
    reports = ring.node_reports
    # a real, sealed close of the still-open session, from both nodes
    assert len(reports) == 2 and all(r.get("ok") is True and r.get("messages") == 0 for r in reports), reports


# --------------------------------------------------------------------------- 5. junk at the client


def test_junk_on_the_client_inbox_is_dropped_and_the_run_goes_on(wan):
    from diffuse.wire.frames import Hop, seal_message
    from diffuse.wire.sealing import new_key

    ring = wan.open()
    first = wan.generate(ring)
    channel = ring.channel
    dropped = channel.stats.dropped
    forged_hop = Hop(ring.handshake.sid, new_key())  # the right session id, sealed under a key nobody agreed
    _push(channel.inbox.address,
          [b"not cbor at all"],
          [cbor2.dumps({"v": 1, "s": os.urandom(16), "c": 1, "n": 2}), b"x"],
          seal_message(forged_hop, {"op": "result", "seq": 1, "out": None}, []), hop=channel.recv_hop,
          server=channel.inbox.server_public)
    _push(channel.inbox.address, [b"from a stranger"])  # no CURVE keys: the inbox never lets it in
    time.sleep(0.5)
    second = wan.generate(ring)
    assert np.array_equal(first, second)
    assert channel.stats.dropped - dropped == 3
    wan.close_ring(ring)


# --------------------------------------------------------------------------- 6. nothing leaks per session


def test_sessions_leave_no_sockets_and_errors_stay_bounded(wan):
    from diffuse.node.server import MAX_QUEUED

    def count(what):
        return [wan.status(k)[what] for k in (0, 1)]

    sessions, outboxes = count("sessions"), count("outboxes")
    for _ in range(3):
        ring = wan.open()
        if wan.expected is None:  # what a clean session gives, to compare with after the junk
            wan.generate(ring)
        assert count("outboxes") == [n + 1 for n in outboxes]  # one per session, not one per address forever
        assert count("sessions") == [n + 1 for n in sessions]
        wan.close_ring(ring)
    assert count("outboxes") == outboxes and count("sessions") == sessions
    # status is cheap and tells a stranger nothing it keeps about errors or what the node holds in memory
    status = wan.status(0)
    assert {"sessions", "outboxes", "slices"} <= set(status)
    assert not {"params", "last_error", "errors_kept"} & set(status), status
    # data for sessions nobody opened, more than the compute thread's queue holds: each is logged with the
    # session it names (or dropped unqueued, and that logged), and the node keeps answering at once
    junk_ids = [os.urandom(16) for _ in range(MAX_QUEUED + 50)]
    before = wan.log(0)
    sender = wan.open()  # junk sent on a session's own admitted connection (from a stranger it never arrives)
    _push(wan.data_address(0), *[[cbor2.dumps({"v": 1, "s": s, "c": 1, "n": 2}), b"x"] for s in junk_ids],
          hop=sender.channel.send_hop, server=sender.handshake.keys[0])
    t0 = time.monotonic()
    assert wan.status(0)["ok"] is True
    assert time.monotonic() - t0 < 2.0, "status answered slowly after the junk"

    def noted():
        new = wan.log(0)[len(before):]
        named = sum(f"unknown session {s.hex()[:8]}" in new for s in junk_ids)
        return named, new.count("dropped a data message:")

    deadline = time.monotonic() + 20
    while sum(noted()) < len(junk_ids) and time.monotonic() < deadline:
        time.sleep(0.2)
    named, unqueued = noted()
    assert named > 0 and named + unqueued == len(junk_ids), (named, unqueued)
    t0 = time.monotonic()
    assert wan.status(0)["ok"] is True and time.monotonic() - t0 < 2.0
    wan.close_ring(sender)
    assert count("sessions") == sessions  # junk opened nothing
    ring = wan.open()  # and a real session still runs, bit for bit as before
    assert np.array_equal(wan.generate(ring), wan.expected)
    wan.close_ring(ring)
    assert "Traceback" not in wan.log(0)


# --------------------------------------------------------------------------- 3. a client identity that lasts


def test_client_key_lets_an_allowed_client_in_and_keeps_others_out(models, tmp_path, diffuse_home):
    from diffuse.wire.sealing import load_identity

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


def test_a_runs_own_local_nodes_serve_only_its_client_key(wan):
    """Nodes a run starts on this machine serve that run's client identity; another user of the machine
    (any other key) is refused, while the run goes on byte for byte."""
    import diffuse
    from diffuse.errors import NodeError

    with diffuse.split(wan.pipe, local_nodes=2, timeout=30) as split:
        split.splitter.attach(split.ring)
        with torch.no_grad():
            first = wan.pipe(**WAN_ARGS, generator=torch.Generator("cpu").manual_seed(0), output_type="np")[0]
        pinned = [f"{n.address}#{n.key}" for n in split.local_nodes]
        with pytest.raises(NodeError, match="this node does not serve your client key"):
            with diffuse.split(wan.pipe, nodes=pinned, timeout=30):
                pass
        split.splitter.attach(split.ring)
        with torch.no_grad():
            second = wan.pipe(**WAN_ARGS, generator=torch.Generator("cpu").manual_seed(0), output_type="np")[0]
    assert np.array_equal(first, second)
    assert np.array_equal(first, wan.generate(wan.open()))  # what two nodes open to any client make


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


def _block_params_in_files(model: str) -> int:
    """Elements of every ``blocks.*`` tensor in the transformer's safetensors files, read here directly."""
    import glob

    from safetensors import safe_open

    total = 0
    files = glob.glob(os.path.join(model, "transformer", "*.safetensors"))
    assert files, "the transformer has no safetensors files"
    for f in files:
        with safe_open(f, "pt") as st:
            for name in st.keys():
                if name.startswith("blocks."):
                    total += int(np.prod(st.get_slice(name).get_shape(), dtype=np.int64))
    return total


def test_attention_is_checked_before_any_block_is_loaded(models, tmp_path, diffuse_home):
    import diffuse
    from diffuse.errors import NodeError
    from diffuse.wire.transport import transport_for

    model = models("wan")
    log_path = tmp_path / "node.log"
    proc, ready = _node(model, None, log_path=str(log_path))  # loads what each session asks for
    pinned = [f"{ready['address']}#{ready['key']}"]
    try:
        t = transport_for(ready["address"])
        before = t.request(ready["address"], {"op": "status"}, 10.0)["sessions"]
        torch.set_num_threads(THREADS)
        pipe = diffuse.from_pretrained(model)
        with pytest.raises(NodeError, match="unknown attention path 'fast'"):
            with diffuse.split(pipe, nodes=pinned, timeout=10, attention="fast"):
                pass
        # the refused open left no session behind, and loaded nothing
        assert t.request(ready["address"], {"op": "status"}, 10.0)["sessions"] == before
        assert not re.search(r"loaded \d+ blocks", log_path.read_text())
        # a real session then holds exactly the node's slice (here every block): nothing more is alive there
        with diffuse.split(pipe, nodes=pinned, timeout=10) as split:
            assert t.request(ready["address"], {"op": "status"}, 10.0)["sessions"] == before + 1
        assert t.request(ready["address"], {"op": "status"}, 10.0)["sessions"] == before
        report = split.node_reports[0]
        assert report.get("ok") is True, report
        expected = _block_params_in_files(model)
        assert expected > 0 and report["params"] == expected, (report["params"], expected)
        assert len(re.findall(r"loaded \d+ blocks", log_path.read_text())) == 1
    finally:
        _stop(proc)


def test_a_transport_plugin_missing_methods_is_refused_with_its_name():
    from diffuse.errors import PluginError
    from diffuse.plan.hookspecs import hookimpl
    from diffuse.plan.plugins import plugin_manager
    from diffuse.wire.transport import transport_for

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
        # the contract is sockets only (sealing is core): every socket method but the one it has is named
        with pytest.raises(PluginError, match=r"plugin 'half-transport' breaks the transport contract: the "
                                              r"HalfTransport it returns for half:// lacks inbox, inbox_address, "
                                              r"local_listen, outbox, serve \(see diffuse.wire.transport.Transport\)"):
            transport_for("half://somewhere")
        assert transport_for("tcp://127.0.0.1:1").scheme == "tcp"
    finally:
        pm.unregister(name="half-transport")
    with pytest.raises(PluginError, match="has no scheme: write it as tcp://HOST:PORT"):
        transport_for("127.0.0.1:7000")


# --------------------------------------------------------------------------- 7. uneven shares


def _plan(stacks=(("blocks", 4), ("single", 2)), nodes=2):
    from diffuse.plan.contracts import ModelIdentity, SlicingPlan, StackPlan, Stage

    return SlicingPlan(model=ModelIdentity("m", "transformer", "X", "h"),
                       stacks=tuple(StackPlan(p, n, "x") for p, n in stacks),
                       route=tuple(Stage(f"tcp://n{i}:1") for i in range(nodes)))


def _r(stack, a, b):
    from diffuse.plan.contracts import Slice

    return Slice(stack, a, b)


def _route(plan) -> list[list[str]]:
    return [[str(s) for s in st.slices] for st in plan.route]


def test_route_from_what_nodes_hold_checks_the_chain():
    from diffuse.errors import DiffuseError
    from diffuse.client.handshake import route_from_slices

    plan = _plan()
    new = route_from_slices(plan, [[_r("blocks", 0, 1)], [_r("blocks", 1, 4), _r("single", 0, 2)]])
    assert _route(new) == [["blocks[0:1]", "single[0:0]"], ["blocks[1:4]", "single[0:2]"]]  # n0 hands single on
    assert [st.address for st in new.route] == ["tcp://n0:1", "tcp://n1:1"]
    assert _route(plan) == [[], []]  # plans are never changed: a new one is returned
    plan = _plan()
    same = route_from_slices(plan, [[_r("blocks", 0, 1)], None])  # a node that loads on demand: even split
    assert same is plan and plan.route[0].slices == ()
    for held, why in [
        ([[_r("blocks", 0, 1), _r("single", 0, 2)], [_r("blocks", 2, 4)]],
         r"blocks\[1:2\] is held by no node before tcp://n1:1"),
        ([[_r("blocks", 0, 2), _r("single", 0, 2)], [_r("blocks", 1, 4)]], r"blocks\[1:2\] is held twice"),
        ([[_r("blocks", 0, 1), _r("single", 0, 2)], [_r("blocks", 1, 3)]], r"blocks\[3:4\] is held by no node"),
    ]:
        with pytest.raises(DiffuseError, match=why):
            route_from_slices(_plan(), held)
    # a node after the one holding a stack's last blocks holds nothing of it: it passes the result on
    new = route_from_slices(_plan(), [[_r("blocks", 0, 4), _r("single", 0, 2)], [_r("blocks", 4, 4)]])
    assert _route(new) == [["blocks[0:4]", "single[0:2]"], ["blocks[4:4]", "single[2:2]"]]


def test_a_hello_with_slices_the_model_lacks_is_refused():
    """What a node says it holds goes through ``check_slices`` before any route is made of it: a stack
    in two pieces, a range outside the stack, a reversed range, a stack the model lacks, a malformed entry."""
    from diffuse.errors import DiffuseError
    from diffuse.plan.contracts import ContractError, check_slices

    assert issubclass(ContractError, DiffuseError)
    lengths = _plan().lengths
    assert check_slices([_r("blocks", 0, 1), {"stack": "single", "start": 0, "stop": 2}], lengths) == [
        _r("blocks", 0, 1), _r("single", 0, 2)]
    for given, why in [
        ([_r("blocks", 0, 1), _r("blocks", 2, 4)], r"two slices of blocks: a node's slice of a stack is one contiguous"),
        ([_r("blocks", 0, 1), _r("blocks", 1, 2)], r"two slices of blocks"),
        ([_r("blocks", 2, 5)], r"slice blocks\[2:5\]: blocks has 4 blocks"),
        ([_r("blocks", -1, 2)], r"blocks has 4 blocks"),
        ([_r("blocks", 3, 1)], r"slice blocks\[3:1\]: blocks has 4 blocks"),
        ([_r("nope", 0, 1)], r"the model has no stack 'nope'"),
        ([{"stack": "blocks", "start": 0}], r"malformed slice"),
        ([{"stack": "blocks", "start": True, "stop": 2}], r"malformed slice"),
        ({"stack": "blocks", "start": 0, "stop": 2}, r"slices must be a list"),
    ]:
        with pytest.raises(ContractError, match=why):
            check_slices(given, lengths)


def test_uneven_blocks_run_byte_identical_to_the_whole_model(models, tmp_path, diffuse_home):
    model = models("wan")
    reference = Reference(model, WAN_ARGS, str(tmp_path / "reference.npy"))  # side by side with the split run
    (one, ready1), (three, ready3) = _nodes(model, ["blocks[0:1]", "blocks[1:4]"])
    try:
        run = _client(model, [f"{r['address']}#{r['key']}" for r in (ready1, ready3)], tmp_path, diffuse_home,
                      save=str(tmp_path / "uneven.npy"))
    finally:
        _stop(one, three)
    assert run.returncode == 0, run.stderr[-2000:]
    said = _said(run)
    assert f"node {ready1['address']}: blocks[0:1]" in said and f"node {ready3['address']}: blocks[1:4]" in said
    assert np.load(tmp_path / "uneven.npy").tobytes() == reference.result().tobytes()


# --------------------------------------------------------------------------- 10. what the first node learns


def test_the_first_node_of_a_default_language_model_run_receives_no_token_ids(tmp_path_factory, diffuse_home,
                                                                              monkeypatch):
    """Every message sealed to the first node of a Qwen2 run, as that node opens it: by default hidden states
    only (floating point, no token ids in any header); with ``embedding_on_node`` the same answer, and the
    passes carry the token ids (so the look can tell)."""
    import lm_models

    import diffuse
    from diffuse.wire import frames
    from diffuse.local.nodes import start_local_nodes
    from diffuse.lm.client_media import build_inputs

    model_dir = lm_models.build("qwen2", str(tmp_path_factory.mktemp("first-node") / "qwen2"))
    inputs, _ = build_inputs(model_dir, "Tell me a story about the moon.")
    prompt = inputs["input_ids"][0].tolist()
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    seal, received, answers = frames.seal_message, {}, {}
    nodes = start_local_nodes(model_dir, 2, THREADS)
    try:
        for on_node in (False, True):
            model = diffuse.from_pretrained(model_dir)
            got = received[on_node] = []
            with diffuse.split(model, nodes=[f"{n.address}#{n.key}" for n in nodes], timeout=60,
                               embedding_on_node=on_node) as split:
                first = split.ring.channel.send_hop  # the client's hop into the first node
                monkeypatch.setattr(frames, "seal_message", lambda hop, header, tensors: (
                    got.append((dict(header), [t.detach().clone() for t in tensors])) if hop is first else None,
                    seal(hop, header, tensors))[1])
                out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
                monkeypatch.setattr(frames, "seal_message", seal)
            answers[on_node] = out[0, len(prompt):].tolist()
    finally:
        nodes.stop()
        torch.set_num_threads(threads)

    def carries_ids(header: dict, tensors: list) -> bool:
        ints = [t for t in tensors if not t.is_floating_point()]
        return "embed" in header or any(t.flatten().tolist()[:len(prompt)] == prompt for t in ints)

    assert answers[False] == answers[True] and len(answers[False]) == 4
    default, opted = received[False], received[True]
    assert len(default) == 4 and len(opted) == 4  # the prompt's pass, then one per new token but the last
    assert not any(carries_ids(h, ts) for h, ts in default)
    assert all(any(t.is_floating_point() for t in ts) for _, ts in default)  # the hidden states instead
    assert carries_ids(*opted[0]) and all("embed" in h for h, _ in opted)
