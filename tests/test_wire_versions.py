"""Wire versions are negotiated per node and per hop; version 2's keys are agreed, forward secret; hellos
cannot be flooded into pushing out a client's challenge.

Real node processes, real ZeroMQ sockets on loopback, real libsodium: one node started with ``--wire 1``
(the previous version only) and one speaking both serve one client in one ring.
"""

from __future__ import annotations

import time

import cbor2
import numpy as np
import pytest
import torch
import zmq

from conftest import THREADS, run_reference
from diffuse.plan.contracts import WIRE_VERSION as NEWEST
from test_hardening import WAN_ARGS, _client, _node, _said, _stop


class Mixed:
    """Two nodes of the tiny Wan with lasting keys: ``old`` holds the first half and speaks wire 1 only,
    ``both`` holds the second half and speaks every version."""

    def __init__(self, model: str, folder):
        self.model = model
        self.key_files = {name: str(folder / f"{name}.key") for name in ("old", "both")}
        self.log_paths = {name: str(folder / f"{name}.log") for name in ("old", "both")}
        self.old, self.old_ready = _node(model, "1/2", ["--wire", "1", "--key-file", self.key_files["old"]],
                                         log_path=self.log_paths["old"])
        self.both, self.both_ready = _node(model, "2/2", ["--key-file", self.key_files["both"]],
                                           log_path=self.log_paths["both"])
        self.pinned = [f"{r['address']}#{r['key']}" for r in (self.old_ready, self.both_ready)]

    def identity(self, name: str):
        from diffuse.wire.sealing import load_identity

        return load_identity(self.key_files[name])  # what a thief of the node's key file would hold

    def log(self, name: str) -> str:
        with open(self.log_paths[name]) as f:
            return f.read()


@pytest.fixture(scope="module")
def mixed(models, tmp_path_factory):
    env = Mixed(models("wan"), tmp_path_factory.mktemp("wire-versions"))
    try:
        yield env
    finally:
        _stop(env.old, env.both)


@pytest.fixture(scope="module")
def recorded(mixed, diffuse_home):
    """One session through the mixed ring, in this process, with everything it put on the wire recorded:
    each control request and its reply, the data messages the client sent and received, and the output."""
    import diffusers

    import diffuse
    from diffuse.client.handshake import Handshake

    torch.set_num_threads(THREADS)
    pipe = diffusers.DiffusionPipeline.from_pretrained(mixed.model)
    pipe.set_progress_bar_config(disable=True)
    control, sent, received = [], [], []
    request = Handshake._request

    def recording(hs, k, msg, timeout):
        reply = request(hs, k, msg, timeout)
        control.append((hs.plan.route[k].address, msg, reply))
        return reply

    Handshake._request = recording
    try:
        with diffuse.split(pipe, nodes=mixed.pinned, timeout=30) as split:
            channel = split.ring.channel
            send, recv = channel.outbox.send, channel.inbox.recv
            channel.outbox.send = lambda frames: (sent.append([bytes(f) for f in frames]), send(frames))[1]
            channel.inbox.recv = lambda t: (lambda got: (got is not None and received.append([bytes(f) for f in got]),
                                                         got)[1])(recv(t))
            with torch.no_grad():
                out = pipe(**WAN_ARGS, generator=torch.Generator("cpu").manual_seed(0), output_type="np")[0]
            hops = (channel.send_hop, channel.recv_hop)
    finally:
        Handshake._request = request
    return {"split": split, "out": out, "control": control, "sent": sent, "received": received, "hops": hops}


def _captured(recorded, address: str, op: str) -> tuple[dict, dict]:
    return next((m, r) for a, m, r in recorded["control"] if a == address and m.get("op") == op)


# --------------------------------------------------------------------------- (a) a mixed ring


def test_a_version_1_node_and_a_node_of_every_version_serve_one_client_byte_identically(mixed, recorded, tmp_path):
    reference = run_reference(mixed.model, WAN_ARGS, str(tmp_path / "reference.npy"))
    assert recorded["out"].tobytes() == reference.tobytes()
    hs = recorded["split"].ring.handshake
    assert hs.wire == {mixed.old_ready["address"]: 1, mixed.both_ready["address"]: NEWEST}
    # each hop runs the highest version both its ends speak: into and out of the old node 1, back to the client the newest
    assert [h.wire for h in recorded["hops"]] == [1, NEWEST]
    assert "opened (wire 1; hops in 1, out 1)" in mixed.log("old")
    assert f"opened (wire {NEWEST}; hops in 1, out {NEWEST})" in mixed.log("both")
    assert {cbor2.loads(m[0])["v"] for m in recorded["sent"]} == {1}
    assert {cbor2.loads(m[0])["v"] for m in recorded["received"]} == {NEWEST}
    assert "Traceback" not in mixed.log("old") + mixed.log("both")


# --------------------------------------------------------------------------- (b) nothing in common


def test_a_node_with_no_version_in_common_is_refused_naming_both_sides(mixed, tmp_path, diffuse_home, monkeypatch):
    import diffuse.client.handshake
    from diffuse.wire.transport import transport_for

    monkeypatch.setattr(diffuse.client.handshake, "WIRE_VERSIONS", (2,))  # a client that no longer speaks version 1
    run = _client(mixed.model, mixed.pinned, tmp_path, diffuse_home)
    assert run.returncode == 2
    said = _said(run)
    assert (f"node {mixed.old_ready['address']}: speaks wire versions [1], this client speaks [2]: nothing in "
            "common") in said, said
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) <= 2, run.stderr
    # an older client, which cannot name the node's versions itself, hears both from the node
    address = mixed.old_ready["address"]
    reply = transport_for(address).request(address, {"op": "hello", "wire": [2]}, 10.0)
    assert reply["ok"] is False and reply["speaks"] == [1]
    assert reply["error"] == "this node speaks wire versions [1]; the client offers [2]"


def test_two_nodes_that_cannot_hand_on_to_each_other_are_refused_naming_both():
    from diffuse.errors import DiffuseError
    from diffuse.client.handshake import hop_versions

    assert hop_versions(["tcp://a:1", "tcp://b:1", "tcp://c:1"], [[1], [1, 2], [1, 2]], [1, 2, 2]) == [1, 1, 2, 2]
    with pytest.raises(DiffuseError, match=r"nodes tcp://a:1 \(wire versions \[1\]\) and tcp://b:1 \(wire versions "
                                           r"\[2\]\) speak no version in common"):
        hop_versions(["tcp://a:1", "tcp://b:1"], [[1], [2]], [1, 2])


# --------------------------------------------------------------------------- (c) forward secrecy


def _byte_strings(x) -> list[bytes]:
    if isinstance(x, bytes):
        return [x]
    if isinstance(x, dict):
        return [b for v in x.values() for b in _byte_strings(v)]
    if isinstance(x, (list, tuple)):
        return [b for v in x for b in _byte_strings(v)]
    return []


def _opens(key: bytes, wire: int, session: bytes, message: list[bytes]) -> bool:
    from diffuse.errors import WireError
    from diffuse.wire.frames import Hop, open_message

    try:
        header, _ = open_message(Hop(session, key, wire=wire), message)
    except WireError:
        return False
    return header.get("op") in ("call", "result")


def test_a_recorded_session_opens_with_a_stolen_node_key_at_wire_1_but_not_at_wire_2(mixed, recorded):
    import pysodium

    from diffuse.errors import WireError
    from diffuse.wire.sealing import agree, open_control, open_transcript, open_with

    sid = recorded["split"].ring.handshake.sid
    # wire 1: the old node's key file opens its recorded open, whose in-hop key opens what the client sent
    open_v1, _ = _captured(recorded, mixed.old_ready["address"], "open")
    payload, client = open_control(open_v1, mixed.identity("old"))
    assert _opens(payload["in_key"], 1, sid, recorded["sent"][0])
    # wire 2: the other node's key file opens its recorded open too, but no key in it, nor any the thief can
    # make from it, opens what that node sent back; the client's own hop key does (the capture is real)
    open_v2, reply_v2 = _captured(recorded, mixed.both_ready["address"], "open")
    node = mixed.identity("both")
    payload, client = open_control(open_v2, node)
    assert payload["wire"] == NEWEST and "in_key" not in payload and "out_key" not in payload  # sealed as at 2
    hello = next(r for a, m, r in recorded["control"] if a == mixed.both_ready["address"] and m.get("op") == "hello")
    client_eph, node_eph = payload["eph"], hello["eph"]
    candidates = [b for b in _byte_strings(payload) + _byte_strings(hello) if len(b) == 32]
    candidates += [pysodium.crypto_scalarmult_curve25519(node.secret, client_eph),
                   pysodium.crypto_scalarmult_curve25519(node.secret, client),
                   *pysodium.crypto_kx_server_session_keys(node.public, node.secret, client_eph),
                   # the agreed key, with the node's long-term key standing in for the fresh one it dropped
                   agree("node", node, node, client, client_eph,
                         open_transcript(client, client_eph, node.public, node_eph, sid, payload["challenge"]))]
    for candidate in candidates:
        with pytest.raises(WireError):
            open_with(candidate, payload["keys"], sid + payload["challenge"])
    returned = recorded["received"][0]
    assert not any(_opens(c, NEWEST, sid, returned) for c in candidates)
    assert _opens(recorded["hops"][1].key, NEWEST, sid, returned)
    # the node's sealed reply names the session and challenge it answers, not only the operation
    inner, sender = open_control(reply_v2, recorded["split"].ring.identity)
    assert sender == node.public and inner["re"] == "open"
    assert inner["session"] == sid and inner["challenge"] == payload["challenge"]


def test_a_genuine_sealed_reply_replayed_to_another_request_is_refused(mixed, recorded):
    from diffuse.errors import NodeError

    hs = recorded["split"].ring.handshake
    k = [s.address for s in hs.plan.route].index(mixed.both_ready["address"])
    _, close_reply = _captured(recorded, mixed.both_ready["address"], "close")
    t = hs.transports[k]
    original = t.request
    t.request = lambda a, m, timeout: close_reply  # the node's real answer to the session's close, played again
    try:
        with pytest.raises(NodeError, match="its sealed close reply answers another session or request"):
            hs.sealed(k, "close", {"session": hs.sid}, 5)
    finally:
        t.request = original


# --------------------------------------------------------------------------- (d) hello flood


def _flood(address: str, n: int, timeout_s: float = 30.0) -> int:
    """``n`` hellos at a node from eight sockets at once; how many it answered with a challenge."""
    ctx = zmq.Context.instance()
    socks = [ctx.socket(zmq.REQ) for _ in range(8)]
    poller = zmq.Poller()
    hello = cbor2.dumps({"op": "hello", "wire": [1, 2]})
    for s in socks:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(address)
        poller.register(s, zmq.POLLIN)
        s.send(hello)
    sent, answered, deadline = len(socks), 0, time.monotonic() + timeout_s
    try:
        while answered < n and time.monotonic() < deadline:
            for s, _ in poller.poll(1000):
                answered += isinstance(cbor2.loads(s.recv()).get("challenge"), bytes)
                if sent < n:
                    s.send(hello)
                    sent += 1
    finally:
        for s in socks:
            s.close()
    return answered


def test_a_hello_flood_between_a_clients_hello_and_its_open_does_not_spend_its_challenge(mixed, diffuse_home):
    import diffuse
    from diffuse.client.handshake import Handshake

    pipe = diffuse.from_pretrained(mixed.model)
    hello = Handshake.hello
    flooded = []

    def hello_then_flood(hs, k, expect_key=None):
        answer = hello(hs, k, expect_key)
        t0 = time.monotonic()
        flooded.append((_flood(hs.plan.route[k].address, 3000), time.monotonic() - t0))
        return answer

    Handshake.hello = hello_then_flood
    try:
        with diffuse.split(pipe, nodes=mixed.pinned, timeout=30) as split:
            assert len(split.ring.handshake.opened) == 2
    finally:
        Handshake.hello = hello
    # every hello (the client asks each node what it holds, then again right before opening) was flooded
    assert len(flooded) >= 2 and all(n == 3000 for n, _ in flooded), flooded
    print(f"hello floods: {', '.join(f'{n} in {s:.2f} s' for n, s in flooded)}")
    assert all(r.get("ok") is True for r in split.node_reports), split.node_reports


def test_challenges_are_checked_by_their_mac_spent_once_and_expire_with_their_period():
    from diffuse.node.control import STALE, Challenges

    ch = Challenges(period_s=3600, max_spent=2)
    a, b, c = ch.issue(), ch.issue(), ch.issue()
    forged = a[:-1] + bytes([a[-1] ^ 1])
    assert ch.take(forged) == STALE and ch.take(b"x" * len(a)) == STALE and ch.take(None) == STALE
    assert ch.ephemeral(a).public == ch.ephemeral(a).public != ch.ephemeral(b).public  # the node's fresh key, remade
    assert ch.take(a) is None and ch.take(a) == STALE  # spent once
    assert ch.take(b) is None
    assert "accepted 2 opens" in ch.take(c)  # full: refused, never a spent challenge forgotten
    short = Challenges(period_s=0.2)
    late = short.issue()
    time.sleep(0.45)  # two periods on: the secret that made it is gone, and the fresh key made from it
    assert short.take(late) == STALE and short.ephemeral(late) is None
    assert len(short.periods) <= 2
