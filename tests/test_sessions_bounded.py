"""What one session may cost a node is bounded, and a session never harms another.

Real node processes (two holding halves of the tiny Wan, on a short lease and a
small node-wide buffer cap), real ZeroMQ sockets on loopback, real sealing. The
hostile sessions below are opened the way any allowed client could open them:
a sealed open whose next hop is this test's own socket, then calls sealed under
the session's real hop key.
"""

from __future__ import annotations

import os
import signal
import socket
import time

import numpy as np
import pytest
import torch
import zmq

from test_hardening import WanRing

LEASE_S = 4.0  # the nodes' (and this process's clients') session lease here
NODE_BUFFER = 3 << 20  # the nodes' cap on all sessions' kept tensors: far above what a tiny Wan run keeps


@pytest.fixture(scope="module")
def ring_env(models, diffuse_home):
    saved = {k: os.environ.get(k) for k in ("DIFFUSE_SESSION_LEASE_S", "DIFFUSE_NODE_BUFFER_BYTES")}
    os.environ["DIFFUSE_SESSION_LEASE_S"] = str(LEASE_S)
    os.environ["DIFFUSE_NODE_BUFFER_BYTES"] = str(NODE_BUFFER)
    try:
        env = WanRing(models("wan"))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    os.environ["DIFFUSE_SESSION_LEASE_S"] = str(LEASE_S)  # this process's clients ping well inside it
    try:
        env.ring = env.open()
        env.expected = env.generate(env.ring)
        yield env
    finally:
        os.environ.pop("DIFFUSE_SESSION_LEASE_S", None) if saved["DIFFUSE_SESSION_LEASE_S"] is None else \
            os.environ.__setitem__("DIFFUSE_SESSION_LEASE_S", saved["DIFFUSE_SESSION_LEASE_S"])
        env.close()


class Hostile:
    """A session opened on node ``k`` by a client of its own, handing on to ``next`` (default: this
    test's inbox, where its replies are read)."""

    def __init__(self, env: WanRing, k: int, dtype: str = "float32", next: str | None = None,
                 address: str | None = None):
        from diffuse.wire import frames
        from diffuse.plan.messages import StagePlan
        from diffuse.wire.transport import transport_for
        from diffuse.wire.sealing import load_identity, open_control, seal_control

        self.env, self.k = env, k
        self.address = address or env.nodes[k].address
        self.t = transport_for(self.address)
        self.inbox = None
        if next is None:
            self.inbox = self.t.inbox("tcp://127.0.0.1:0")
            next = self.inbox.address
        self.sid, in_key, out_key = os.urandom(16), os.urandom(32), os.urandom(32)
        self.send_hop, self.recv_hop = frames.Hop(self.sid, in_key), frames.Hop(self.sid, out_key)
        plan = env.ring.plan
        hello = self.t.request(self.address, {"op": "hello", "wire": [1]}, 10.0)
        stage = StagePlan(plan.model.content_hash, dtype, plan.route[k].slices, next)
        me = load_identity(None)
        payload = {"op": "open", "session": self.sid, "challenge": hello["challenge"], "in_key": in_key,
                   "out_key": out_key, "stage": stage.to_dict()}
        reply = self.t.request(self.address, dict(seal_control(payload, hello["key"], me), op="open"), 60.0)
        self.reply, _ = open_control(reply, me)
        self.me, self.node_key = me, hello["key"]
        self.stack = plan.route[k].slices[0].stack
        self.outbox = zmq.Context.instance().socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.LINGER, 0)
        admitted(self.outbox, in_key, hello["key"])  # the node's data port lets in only an open session's ends
        self.outbox.connect(hello["data"])
        self.seq = 0

    def send(self, header: dict, tensors=()) -> None:
        from diffuse.wire import frames

        self.seq += 1
        self.outbox.send_multipart(frames.seal_message(self.send_hop, dict({"seq": self.seq}, **header),
                                                       list(tensors)))

    def call(self, **fields) -> None:
        tensors = fields.pop("_tensors", ())
        self.send(dict({"op": "call", "stack": self.stack}, **fields), tensors)

    def answer(self, timeout: float = 10.0) -> dict:
        from diffuse.wire import frames

        raw = self.inbox.recv(timeout)
        assert raw is not None, "no answer came"
        header, _ = frames.open_message(self.recv_hop, raw)
        return header

    def ping(self) -> dict:
        return self.t.request(self.address, {"op": "ping", "session": self.sid}, 5.0)

    def close(self, tell: bool = True) -> None:
        from diffuse.wire.sealing import seal_control

        if tell and self.reply.get("ok"):
            self.t.request(self.address, dict(seal_control({"op": "close", "session": self.sid}, self.node_key,
                                                           self.me), op="close"), 10.0)
        self.outbox.close()
        if self.inbox is not None:
            self.inbox.close()


def admitted(sock, hop_key: bytes, server: bytes) -> None:
    """Give a raw PUSH socket (not yet connected) the CURVE keys a session's sending end holds: its own pair,
    made from the key of its hop, and the key of the data port it sends to (``server``)."""
    from diffuse.wire.tokens import curve_client

    for option, key in zip((zmq.CURVE_SERVERKEY, zmq.CURVE_PUBLICKEY, zmq.CURVE_SECRETKEY),
                           (server, *curve_client(hop_key))):
        sock.setsockopt(option, key)


def _sessions(env, k: int) -> int:
    return env.status(k)["sessions"]


def _until(what, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if what():
            return time.monotonic() - t0
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout} s")


# --------------------------------------------------------------------------- 1. dtype isolation


def _generate(env, split) -> np.ndarray:
    from test_hardening import WAN_ARGS

    split.splitter.attach(split.ring)
    with torch.no_grad():
        return env.pipe(**WAN_ARGS, generator=torch.Generator("cpu").manual_seed(0), output_type="np")[0]


def test_a_session_in_another_dtype_leaves_a_running_one_alone(ring_env, models):
    import diffuse
    from test_hardening import _node, _stop

    env = ring_env
    proc, ready = _node(models("wan"), None)  # loads what each session asks for
    try:
        split = diffuse.split(env.pipe, nodes=[f"{ready['address']}#{ready['key']}"], timeout=30)
        split.__enter__()
        try:
            assert np.array_equal(_generate(env, split), env.expected)
            other = Hostile(env, 0, dtype="bfloat16", address=ready["address"])  # bfloat16 copies, on the same node
            assert other.reply["ok"], other.reply
            assert np.array_equal(_generate(env, split), env.expected)  # the float32 session is untouched
            other.close()
        finally:
            split.__exit__(None, None, None)
    finally:
        _stop(proc)
    # a node started with --blocks serves the dtype it loaded, and says so in one line
    h = Hostile(env, 0, dtype="bfloat16")
    h.close()
    assert h.reply["ok"] is False
    assert "serves that dtype only; the client asks bfloat16" in h.reply["error"], h.reply
    assert "\n" not in h.reply["error"]


# --------------------------------------------------------------------------- 2. kept tensors bounded


def _frames_of(n: int, size: int):
    from diffuse.plan.calltree import digest

    ts = [torch.full((size // 4,), float(i + 1)) for i in range(n)]
    return ts, [digest(t) for t in ts]


def test_slot_caches_are_bounded_per_session_and_per_node(ring_env):
    env = ring_env
    tree = {"args": [{"$t": 0}], "kwargs": {}}
    rmap = {"single": True, "outputs": [0], "names": ["x"]}
    a = Hostile(env, 0)
    b = Hostile(env, 0)
    try:
        # a session asks to keep 1 MiB: four fresh 512 KiB tensors in four slots keep only the last two
        ts, ds = _frames_of(4, 512 << 10)
        a.call(tree=tree, rmap=rmap, slot_bytes=1 << 20, slots=[["f", 0]] + [["f", i + 1, d] for i, d in enumerate(ds)],
               _tensors=[torch.zeros(4)] + ts)
        a.answer()  # (the blocks refuse this made-up call; what matters is what was kept)
        a.call(slots=[["f", 0], ["h", ds[0]]], _tensors=[torch.zeros(4)])
        said = a.answer()
        assert said["op"] == "error" and "no longer holds" in said["message"], said
        # more than the node allows a session: refused, in one line
        a.call(slot_bytes=1 << 40, slots=[["f", 0]], _tensors=[torch.zeros(4)])
        said = a.answer()
        assert said["op"] == "error" and "this node keeps 256 MiB at most" in said["message"], said
        # the node's cap over all sessions: a holds ~1 MiB, b may not keep 2.5 MiB more
        ts, ds = _frames_of(5, 512 << 10)
        b.call(tree=tree, rmap=rmap, slot_bytes=4 << 20, slots=[["f", 0]] + [["f", i + 1, d] for i, d in enumerate(ds)],
               _tensors=[torch.zeros(4)] + ts)
        said = b.answer()
        assert said["op"] == "error" and "no room for this one's" in said["message"], said
    finally:
        a.close()
        b.close()
    assert "Traceback" not in env.log(0)
    assert np.array_equal(env.generate(env.ring), env.expected)  # real sessions are far under every cap


# --------------------------------------------------------------------------- 3. a stuck next hop


def test_a_next_hop_that_never_reads_fails_only_its_own_session(ring_env):
    env = ring_env
    sink = socket.socket()  # accepts connections (the kernel does) and never reads a byte
    sink.bind(("127.0.0.1", 0))
    sink.listen(4)
    hop = f"tcp://127.0.0.1:{sink.getsockname()[1]}"
    h = Hostile(env, 0, next=hop)
    try:
        for _ in range(200):  # results pass through a node untouched: each goes straight to the stuck hop
            h.send({"op": "result", "stack": h.stack, "out": {"$t": 0}}, [torch.zeros(16 << 10)])
        waited = _until(lambda: h.ping().get("failed"), 10.0)
        said = h.ping()
        assert said["session_known"] is False and hop in said["failed"] and "takes no messages" in said["failed"]
        t0 = time.monotonic()
        assert np.array_equal(env.generate(env.ring), env.expected)
        took = time.monotonic() - t0
        print(f"stuck hop noticed in {waited:.1f} s; a run on the same node then took {took:.1f} s")
        assert took < 30
    finally:
        h.close(tell=False)
        sink.close()


# --------------------------------------------------------------------------- 4. leases


def test_sessions_of_a_vanished_client_or_a_frozen_node_are_reaped(ring_env):
    env = ring_env
    before = [_sessions(env, k) for k in (0, 1)]
    gone = [Hostile(env, k) for k in (0, 1)]  # their client never sends nor pings again
    assert [_sessions(env, k) for k in (0, 1)] == [n + 1 for n in before]
    frozen = env.nodes[1].proc
    os.kill(frozen.pid, signal.SIGSTOP)
    try:
        took = _until(lambda: _sessions(env, 0) == before[0], LEASE_S + 6)  # node 1 stays frozen past its lease
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    took_frozen = _until(lambda: _sessions(env, 1) == before[1], LEASE_S + 6)
    print(f"lease {LEASE_S} s: vanished client's session reaped in {took:.1f} s, "
          f"frozen node's {took_frozen:.1f} s after it resumed")
    for h in gone:
        assert h.ping()["session_known"] is False
        h.close(tell=False)
    # a client that is alive keeps its session between passes, however long it pauses (background pings)
    assert np.array_equal(env.generate(env.ring), env.expected)


# --------------------------------------------------------------------------- 5. the hop that failed is named


def test_a_lost_pass_names_the_hop_where_it_stopped(ring_env):
    import diffuse
    from diffuse.errors import NodeError
    from diffuse.client.handshake import Handshake

    env = ring_env
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_address = f"tcp://127.0.0.1:{dead.getsockname()[1]}"
    dead.close()  # nothing listens there: node 0 can never hand anything on to it
    hello = Handshake.hello

    def wrong_data_address(hs, k, expect_key=None):
        said = hello(hs, k, expect_key)
        return dict(said, data=dead_address) if k == 1 else said

    Handshake.hello = wrong_data_address
    try:
        split = diffuse.split(env.pipe, nodes=env.pinned, timeout=3)
        split.__enter__()
    finally:
        Handshake.hello = hello
    try:
        split.splitter.attach(split.ring)
        with pytest.raises(NodeError) as err:
            env.pipe(**env_args(), generator=torch.Generator("cpu").manual_seed(0), output_type="np")
    finally:
        split.__exit__(None, None, None)
    said = str(err.value)
    assert said.startswith(f"node {env.nodes[0].address}: did not hand pass #1 on to its next hop "
                           f"{env.nodes[1].address}"), said


def env_args():
    from test_hardening import WAN_ARGS

    return WAN_ARGS


# --------------------------------------------------------------------------- 6. malformed calls, one line each


def test_malformed_authenticated_calls_are_answered_in_one_line(ring_env):
    env = ring_env
    h = Hostile(env, 0)
    t = [torch.zeros(4)]
    rmap = {"single": True, "outputs": [0], "names": ["x"]}
    bad = [
        dict(tree={"args": [{"$t": 5}], "kwargs": {}}, rmap=rmap, slots=[["f", 0]]),  # tensor number out of range
        dict(tree={"args": {"$t": 0}, "kwargs": {}}, rmap=rmap, slots=[["f", 0]]),  # args not a list
        dict(tree={"args": [{"$what": 0}], "kwargs": {}}, rmap=rmap, slots=[["f", 0]]),  # unknown marker
        dict(tree={"args": [{"$t": 0, "x": 1}], "kwargs": {1: 2}}, rmap=rmap, slots=[["f", 0]]),
        dict(tree={"args": [{"$t": 0}], "kwargs": {}}, rmap=rmap, slots={"0": 1}),  # slots not a list
        dict(tree={"args": [{"$t": 0}], "kwargs": {}}, rmap=rmap, slots=[["f", 0]], layer_trees={"0": [1]}),
        dict(tree={"args": [{"$t": 0}], "kwargs": {}}, rmap=rmap, slots=[["f", 0]], state={"kind": 3}),
        dict(tree={"args": [{"$t": 0}], "kwargs": {}}, rmap=[1], slots=[["f", 0]]),
        dict(tree={"args": [{"$t": 0}], "kwargs": {}}, rmap=rmap, slots=[["f", 0]], patch={"branch": "x"}),
        dict(tree={"args": [{"$t": 0}], "kwargs": {}}, rmap=rmap, slots=[["f", 0]], seq="one"),
        dict(tree={"args": [{"$t": 0}], "kwargs": {}}, rmap=rmap, slots=[["f", 0]], slot_bytes=-1),
        dict(tree={"args": [{"$t": 0}], "kwargs": {}}, rmap=rmap, slots=[["f", 0]]),  # blocks refuse the shapes
    ]
    try:
        for fields in bad:
            h.call(_tensors=t, **fields)
            said = h.answer()
            assert said["op"] == "error", (fields, said)
            assert said["node"] == env.nodes[0].address
            assert said["message"] and "\n" not in said["message"] and len(said["message"]) <= 2000, said
    finally:
        h.close()
    assert "Traceback" not in env.log(0)
    assert np.array_equal(env.generate(env.ring), env.expected)


# --------------------------------------------------------------------------- 7. nobody freezes the control thread


def test_a_stranger_cannot_freeze_a_nodes_control_thread(ring_env):
    """While node 0 runs a long pass of a real client, strangers' sessions flood its data port (junk sealed
    under no key; calls sealed under their own hop key, more than the compute thread's queue holds) and
    close. Junk never takes a place in that queue; the closes and the node's hellos are answered at once."""
    import queue
    import threading

    import cbor2

    from diffuse.node.server import MAX_QUEUED
    from test_hardening import WAN_ARGS

    env = ring_env
    ring, split = env.ring, env._split_of(env.ring)
    sent: queue.Queue = queue.Queue()
    ring.send = lambda *a, **k: (type(ring).send(ring, *a, **k), sent.put(time.monotonic()))[0]
    # one step, one call (no guidance) of ~21,000 tokens: node 0 computes for seconds
    big = dict(WAN_ARGS, height=512, width=512, num_frames=81, guidance_scale=1.0, num_inference_steps=1)
    done: dict = {}

    def client():
        split.splitter.attach(ring)
        try:
            with torch.no_grad():
                done["out"] = env.pipe(**big, generator=torch.Generator("cpu").manual_seed(0), output_type="latent")[0]
        except BaseException as exc:
            done["error"] = exc

    junk, squat = Hostile(env, 0), Hostile(env, 0)
    log_before = len(env.log(0))
    worker = threading.Thread(target=client)
    worker.start()
    try:
        sent.get(timeout=120)  # the pass went to node 0
        for c in range(1, MAX_QUEUED + 145):  # the stranger's own session id, frames sealed under no key
            junk.outbox.send_multipart([cbor2.dumps({"v": 1, "s": junk.sid, "c": c, "n": 3}), b"x" * 64, b"y" * 64])
        for _ in range(MAX_QUEUED + 16):  # authentic, and more than the queue holds
            squat.call(tree={"args": [{"$t": 0}], "kwargs": {}}, slots=[["f", 0]], _tensors=[torch.zeros(4)])
        time.sleep(0.3)  # the floods reach the node
        closing = threading.Thread(target=lambda: (junk.close(), squat.close()))
        closing.start()
        time.sleep(0.1)
        t0 = time.monotonic()
        junk.t.request(junk.address, {"op": "hello", "wire": [1]}, 10.0)
        hello_s = time.monotonic() - t0
        closing.join(10.0)
        closed = not closing.is_alive()
    finally:
        worker.join(120)
        del ring.send
    log = env.log(0)[log_before:]
    print(f"hello answered in {hello_s:.3f} s while node 0 computed with its queue full")
    assert hello_s < 1.0 and closed
    assert log.count("failed authentication") >= MAX_QUEUED + 144, log[-2000:]
    assert log.count("already wait for the compute thread") <= 16, log[-2000:]  # junk took no place in the queue
    assert "error" not in done and torch.isfinite(done["out"]).all()
    assert np.array_equal(env.generate(env.ring), env.expected)


# --------------------------------------------------------------------------- 8. per-pass records bounded


def test_a_long_sessions_per_pass_records_stay_bounded(ring_env):
    """A session of more calls than a node keeps records of: its close reply lists the latest only (bytes in
    and busy time per pass), while its totals count every message."""
    from diffuse.node.server import MAX_PASS_LOG
    from diffuse.wire.sealing import open_control, seal_control

    env = ring_env
    h = Hostile(env, 0)
    calls = MAX_PASS_LOG + 300
    try:
        for start in range(0, calls, 8):  # no more in flight than the node's sending end keeps for a session
            n = min(8, calls - start)
            for _ in range(n):  # refused by the blocks (a made-up call), each answered with an error
                h.call(tree={"args": [{"$t": 0}], "kwargs": {}}, slots=[["f", 0]], _tensors=[torch.zeros(4)])
            for _ in range(n):
                assert h.answer()["op"] == "error"
        reply = h.t.request(h.address, dict(seal_control({"op": "close", "session": h.sid}, h.node_key, h.me),
                                            op="close"), 10.0)
        said, _ = open_control(reply, h.me)
    finally:
        h.close(tell=False)
    assert said["ok"] and said["messages"] == calls
    for records in (said["hop_bytes"], said["busy_log"]):
        assert len(records) == MAX_PASS_LOG
        assert [seq for seq, _ in records] == list(range(calls - MAX_PASS_LOG + 1, calls + 1))


# --------------------------------------------------------------------------- 9. only the session's client renews it


def test_only_pings_that_prove_the_sessions_key_renew_it(ring_env):
    """Pings by session id alone are answered but renew nothing: such a session is reaped at its lease. Pings
    carrying the MAC of the id under the session's hop key (what its client sends) keep it."""
    from diffuse.wire.tokens import ping_proof

    env = ring_env
    bare, proven = Hostile(env, 0), Hostile(env, 0)
    proof = ping_proof(proven.send_hop.key, proven.sid)
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < LEASE_S + 2.5:
            said = bare.ping()
            assert said.get("renewed") is not True, said
            kept = proven.t.request(proven.address, {"op": "ping", "session": proven.sid, "proof": proof}, 5.0)
            assert kept["session_known"] is True and kept["renewed"] is True, kept
            time.sleep(0.5)
        assert bare.ping()["session_known"] is False  # reaped at its lease, pinged all along
        forged = proven.t.request(proven.address, {"op": "ping", "session": proven.sid, "proof": bytes(16)}, 5.0)
        assert forged["session_known"] is True and forged["renewed"] is False
    finally:
        bare.close(tell=False)
        proven.close()
