"""A seeded fuzzer at a real node's control and data sockets: the node shrugs off every malformed message.

More than 10,000 messages per run (random bytes, random frame counts, truncated and oversized CBOR, deep
nesting, shared-reference bombs, wrong types, huge claimed sizes, garbage ciphertext, unknown sessions, and
sealed payloads of the wrong shape), then opens right in every field but one or two, each with a fresh
challenge, so that every check of an open is reached and refuses (counted by the words of each refusal:
every check must be seen, and no other refusal); afterwards the node is alive, its resident memory is within 10% of
before, it logged no traceback, and a real run through it is byte-identical to one before the fuzz.
``DIFFUSE_FUZZ_SEED`` picks another seed, ``DIFFUSE_FUZZ_MESSAGES`` another count (default 10,500).
"""

from __future__ import annotations

import os
import random
import socket
import struct
import time

import cbor2
import numpy as np
import pytest
import zmq

from test_bounds import Target, _claim, _close_as, _open_as, ask_raw, hello_answered_within
from test_hardening import _client, _stop
from transport.zmq_ring import MAX_CONTROL_BYTES
from diffuse.plan.contracts import WIRE_VERSION as NEWEST

SEED = int(os.environ.get("DIFFUSE_FUZZ_SEED", "20240611"))
MESSAGES = int(os.environ.get("DIFFUSE_FUZZ_MESSAGES", "10500"))
DEEP_OPENS = 200  # opens right but for one or two fields, each refused by a later check than the challenge


@pytest.fixture(scope="module")
def fuzzed(models, tmp_path_factory):
    node = Target(models("wan"), str(tmp_path_factory.mktemp("fuzz") / "node.log"))
    try:
        yield node
    finally:
        _stop(node.proc)


def _stage(payload: dict) -> dict:
    """An open payload's stage plan, to break a field of (a throwaway map where it is already no map)."""
    return payload["stage"] if isinstance(payload.get("stage"), dict) else {}


class Fuzzer:
    """Malformed messages, each made from a seeded generator (the same seed, the same messages)."""

    def __init__(self, seed: int, node_key: bytes, live_session: bytes):
        from diffuse.wire.sealing import load_identity

        self.rng = random.Random(seed)
        self.node_key, self.live = node_key, live_session
        self.stranger = load_identity(None)

    def blob(self, n: int | None = None) -> bytes:
        return self.rng.randbytes(self.rng.randrange(0, 600) if n is None else n)

    def value(self, depth: int = 0):
        """Any CBOR value cbor2 writes: the wrong type for whatever field it lands in."""
        r = self.rng
        kind = r.randrange(10 if depth < 4 else 7)
        return [lambda: r.randrange(-2 ** 70, 2 ** 70), lambda: r.random() * 1e300, lambda: None,
                lambda: r.random() < 0.5, lambda: self.blob(r.randrange(40)),
                lambda: "".join(chr(r.randrange(32, 0x2FF)) for _ in range(r.randrange(20))),
                lambda: r.choice(["hello", "ping", "status", "open", "close", "call", "", "x" * 300]),
                lambda: [self.value(depth + 1) for _ in range(r.randrange(6))],
                lambda: {str(self.value(depth + 1))[:20]: self.value(depth + 1) for _ in range(r.randrange(6))},
                lambda: {r.randrange(100): 1}][kind]()

    def nested(self) -> bytes:
        depth = self.rng.randrange(10, 3000)
        opener = self.rng.choice([b"\x81", b"\xa1\x61k"])
        return b"\xa1\x62op" + opener * depth + b"\x00"

    def bomb(self) -> bytes:
        x: list = [self.value()]
        for _ in range(self.rng.randrange(8, 60)):
            x = [x, x]
        return cbor2.dumps({"op": self.rng.choice(["hello", "status", "open"]), "wire": x}, value_sharing=True)

    def request(self) -> dict:
        r = self.rng
        op = r.choice(["hello", "ping", "status", "open", "close", "nope", None, 7, [1], {"a": 1}])
        msg = {"op": op}
        for _ in range(r.randrange(4)):
            msg[r.choice(["wire", "session", "from", "nonce", "box", "challenge", "x"])] = self.value()
        if op in ("open", "close") and r.random() < 0.7:  # a well-formed box that is garbage inside
            msg.update({"from": self.blob(32), "nonce": self.blob(24), "box": self.blob()})
        return msg

    def sealed(self) -> dict:
        """A payload really sealed to the node's key by a stranger: it opens, and is malformed inside."""
        from diffuse.wire.sealing import seal_control

        r = self.rng
        op = r.choice(["open", "close"])
        payload = {"op": r.choice([op, op, "close", 3])}
        for name in r.sample(["session", "challenge", "in_key", "out_key", "stage"], r.randrange(6)):
            payload[name] = self.value()
        if r.random() < 0.3:
            payload["stage"] = {"model_hash": self.value(), "dtype": r.choice(["float32", "bfloat16", 5, "torch"]),
                                "slices": self.value(), "next": self.value(), "attention": self.value()}
        return dict(seal_control(payload, self.node_key, self.stranger), op=op)

    def deep_open(self, hello: dict, live: bytes) -> dict:
        """An open sealed to the node by a stranger, right in every field but one or two (a fresh challenge
        from ``hello``, a fresh session id, 32-byte keys, a stage plan of this model): it passes the open's
        first checks and is refused by a later one."""
        from diffuse.plan.messages import StagePlan

        r = self.rng
        stage = StagePlan(hello["model"], "float32", (), "tcp://127.0.0.1:1").to_dict()
        p = {"op": "open", "wire": 1, "session": os.urandom(16), "challenge": hello["challenge"],
             "in_key": os.urandom(32), "out_key": os.urandom(32), "stage": stage}
        for _ in range(r.choice([1, 1, 1, 2])):
            r.choice(self.BREAKS)(self, p, live)
        return p

    BREAKS = [
        lambda f, p, live: p.update(wire=f.rng.choice([0, 7, "1", None, 2 ** 70])),
        lambda f, p, live: p.update(offered=[1, 2]),  # both speak 2: an open at 1 is a downgrade
        lambda f, p, live: p.update(challenge=f.rng.choice([f.blob(36), bytes(p["challenge"] or b"")[:-1] + b"x",
                                                            None])),
        lambda f, p, live: p.update(session=f.rng.choice([f.blob(15), f.blob(17), "s" * 16, None])),
        lambda f, p, live: p.update(session=live),  # in use
        lambda f, p, live: p.update({f.rng.choice(["in_key", "out_key"]): f.rng.choice([f.blob(31), None, "k" * 32])}),
        lambda f, p, live: p.update(stage=f.rng.choice([None, [], [p["stage"]], dict(_stage(p), extra=1)])),
        lambda f, p, live: _stage(p).update({f.rng.choice(["model_hash", "dtype", "next", "attention"]): 5}),
        lambda f, p, live: _stage(p).update(attention=f.rng.choice(["fast", "", "eager "])),
        lambda f, p, live: _stage(p).update(wire_in=f.rng.choice(["1", None]), wire_out=1),
        lambda f, p, live: _stage(p).update(wire_in=f.rng.choice([NEWEST + 1, 99]), wire_out=1),  # no node speaks them
        lambda f, p, live: _stage(p).update(slices=f.rng.choice([
            "all", [{"stack": "nope", "start": 0, "stop": 1}], [{"stack": "blocks", "start": 0, "stop": 99}],
            [{"stack": "blocks", "start": 0, "stop": 1}, {"stack": "blocks", "start": 1, "stop": 2}],
            [{"stack": "blocks", "start": 1}]])),
        lambda f, p, live: _stage(p).update(model_hash=f.blob(32).hex()),
        lambda f, p, live: _stage(p).update(dtype=f.rng.choice(["float99", "Tensor", "nn"])),
        lambda f, p, live: p.update(wire=2),  # without the fresh key a wire-2 open needs
        lambda f, p, live: p.update(wire=2, eph=f.blob(32), keys=f.blob(80)),  # keys sealed under no agreed key
    ]

    def control(self) -> list[bytes]:
        """One control message, as frames after (or instead of) the REQ delimiter."""
        r = self.rng
        pick = r.randrange(12)
        if pick == 0:
            body = self.blob()
        elif pick == 1:
            body = cbor2.dumps(self.request())[: r.randrange(1, 40)]  # truncated
        elif pick == 2:
            body = cbor2.dumps({"op": "hello", "pad": self.blob(r.choice([300 << 10, 1100 << 10]))})  # oversized
        elif pick == 3:
            body = self.nested()
        elif pick == 4:
            body = self.bomb()
        elif pick == 5:
            body = cbor2.dumps(self.sealed())
        elif pick == 6:
            raw = bytearray(cbor2.dumps(self.request()))
            for _ in range(r.randrange(1, 4)):
                raw[r.randrange(len(raw))] = r.randrange(256)  # flipped bytes
            body = bytes(raw)
        else:
            body = cbor2.dumps(self.request())
        frames = [b"", body]
        if r.random() < 0.15:  # random frame counts: no delimiter, extra parts, nothing at all
            frames = [self.blob(r.randrange(30)) for _ in range(r.randrange(0, 5))] or [b""]
        return frames

    def data(self) -> list[bytes]:
        """One data message: an envelope (good, bad or absent) and frames that never open."""
        r = self.rng
        env = {"v": r.choice([1, 1, 1, 0, 2 ** 70, "1"]), "s": r.choice([self.live, self.live, os.urandom(16),
                                                                          self.value()]),
               "c": r.choice([1, r.randrange(1, 2 ** 64), 0, -1, 2 ** 64, self.value()]),
               "n": r.choice([2, 3, r.randrange(70000), self.value()])}
        pick = r.randrange(6)
        if pick == 0:
            first = self.blob(r.randrange(300))
        elif pick == 1:
            first = cbor2.dumps(env)[: r.randrange(1, 30)]
        elif pick == 2:
            first = cbor2.dumps({k: v for k, v in env.items() if r.random() < 0.7})
        else:
            first = cbor2.dumps(env)
        return [first] + [self.blob() for _ in range(r.randrange(0, 5))]


def _settle(node: Target, limit_s: float = 60.0) -> None:
    """Until the node has worked off what it was sent: its CPU time stops moving (bounded)."""
    deadline = time.monotonic() + limit_s
    last = node.cpu_s()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = node.cpu_s()
        if now - last < 0.02:
            return
        last = now
    raise AssertionError(f"the node was still busy {limit_s:.0f} s after the fuzz")


def _fuzz(node: Target, fuzzer: Fuzzer, control: int, data: int, claims: int, key: bytes) -> int:
    """Send the messages, interleaved; returns how many were sent. Data goes on a connection admitted as the
    live session's (``key``: its hop key into the node), so that it reaches the node's door."""
    from test_sessions_bounded import admitted

    ctx = zmq.Context.instance()
    sent = 0

    def fresh(kind, address, as_live=False):
        s = ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDTIMEO, 10_000)
        s.setsockopt(zmq.SNDHWM, 100_000)
        if as_live:
            admitted(s, key, node.key)
        s.connect(address)
        return s

    dealer, push = fresh(zmq.DEALER, node.address), fresh(zmq.PUSH, node.data, as_live=True)
    try:
        todo = ["c"] * control + ["d"] * data
        fuzzer.rng.shuffle(todo)
        for i, kind in enumerate(todo):
            if kind == "c":
                frames = fuzzer.control()
                if sum(map(len, frames)) > MAX_CONTROL_BYTES:  # the node hangs up on its sender: a socket of its own
                    own = fresh(zmq.DEALER, node.address)
                    own.send_multipart(frames)
                    own.close(5000)
                else:
                    dealer.send_multipart(frames)
            else:
                push.send_multipart(fuzzer.data())
            sent += 1
            if i % 500 == 499:  # new peers now and then (what they queued still goes; their answers do not)
                dealer.close(5000)
                dealer = fresh(zmq.DEALER, node.address)
        for _ in range(claims):  # a frame announced far bigger than the node takes, then nothing
            assert _claim(node.data, fuzzer.rng.choice([1 << 33, 1 << 40, (1 << 63) - 1]))[0]
            sent += 1
    finally:
        dealer.close(5000)
        push.close(5000)
    return sent


# the checks of an open, in the order the node makes them, each by the words of its refusal
OPEN_CHECKS = {
    "downgrade": "refusing a downgrade", "wire version": "the open uses wire version",
    "challenge": "stale or replayed open", "session id": "the session id must be",
    "session in use": "already in use on this node", "keys": "must be a 32-byte key",
    "wire-2 keys": "a wire-2 open needs", "agreed keys": "failed to open under the agreed key",
    "stage shape": "malformed stage plan", "stage strings": "must be a string", "attention": "unknown attention path",
    "hop versions": "wire_in and wire_out must be integers", "slices": "slice", "hop wire": "asked for wire versions",
    "model": "serves a different model", "dtype": "unknown compute dtype",
}


def _deep_opens(node: Target, fuzzer: Fuzzer, live: bytes, count: int) -> dict:
    """``count`` opens that pass the first checks, each sent with a fresh challenge; every one must be refused.
    How many each check refused, by ``OPEN_CHECKS`` (and "other": a refusal of none of those words)."""
    from diffuse.wire.sealing import open_control, seal_control

    seen: dict[str, int] = {}
    for _ in range(count):
        payload = fuzzer.deep_open(node.ask({"op": "hello", "wire": [1, 2]}), live)
        said, _ = open_control(node.ask(dict(seal_control(payload, node.key, fuzzer.stranger), op="open")),
                               fuzzer.stranger)
        if said["ok"]:
            _close_as(node, fuzzer.stranger, payload["session"])
        assert said["ok"] is False, payload  # not one opened
        why = next((name for name, words in OPEN_CHECKS.items() if words in said["error"]), "other")
        seen[why] = seen.get(why, 0) + 1
        if why == "other":
            print("refused otherwise:", said["error"][:200])
    return seen


def _run_fuzz(node: Target, tmp_path, home: str, control: int, data: int) -> None:
    before = _client(node.model, [node.pinned], tmp_path, home, save=str(tmp_path / "before.npy"))
    assert before.returncode == 0, before.stderr[-2000:]
    from diffuse.wire.sealing import load_identity

    owner = load_identity(None)
    live = _open_as(node, owner)  # a session the fuzz aims garbage ciphertext at
    assert live["ok"] is True, live
    _settle(node)
    rss0 = node.rss()
    log0 = len(node.log())
    t0 = time.monotonic()
    fuzzer = Fuzzer(SEED, node.key, live["session"])
    sent = _fuzz(node, fuzzer, control, data, claims=20, key=live["in_key"])
    checks = _deep_opens(node, fuzzer, live["session"], DEEP_OPENS)
    _settle(node)
    took = time.monotonic() - t0
    rss1 = node.rss()
    said = node.log()[log0:]
    refused, rejected = said.count("control request refused"), said.count("rejected a message")
    print(f"node: {refused} control requests refused, {rejected} data messages rejected, "
          f"{said.count('dropped a data message')} dropped unqueued")
    print(f"fuzz: {sent} messages (seed {SEED}) in {took:.1f} s; node RSS {rss0 >> 20} -> {rss1 >> 20} MiB")
    print(f"opens refused, by the check that refused them: {dict(sorted(checks.items()))}")
    assert set(checks) == set(OPEN_CHECKS), checks  # every check of an open was reached, and nothing else refused
    assert sent >= control + data
    assert rejected + said.count("dropped a data message") == data  # every data message was seen, and refused
    assert refused > control // 2
    assert node.proc.poll() is None
    status = ask_raw(node.address, cbor2.dumps({"op": "status"}), 5.0)
    assert status and status["ok"] is True and status["sessions"] == 1, status  # the fuzz opened nothing
    assert abs(rss1 - rss0) <= rss0 // 10, (rss0, rss1)
    after = _client(node.model, [node.pinned], tmp_path, home, save=str(tmp_path / "after.npy"))
    assert after.returncode == 0, after.stderr[-2000:]
    assert np.load(tmp_path / "after.npy").tobytes() == np.load(tmp_path / "before.npy").tobytes()
    assert _close_as(node, owner, live["session"])["ok"] is True
    log = node.log()
    assert "Traceback" not in log, log[log.index("Traceback") - 500:][:3000]


def test_a_fuzzed_node_stays_alive_bounded_and_exact(fuzzed, tmp_path, diffuse_home):
    _run_fuzz(fuzzed, tmp_path, diffuse_home, control=MESSAGES // 2, data=MESSAGES - MESSAGES // 2)


def _stream_claim(address: str, size: int, send: int, plain: bool) -> int:
    """Speak ZMTP 3.0 to a data ``address`` as a stranger (NULL, or PLAIN with made-up credentials), announce
    one frame of ``size`` bytes and send up to ``send`` of them: how many the receiver took before it hung up."""
    host, port = address.split("://", 1)[1].rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=5)
    taken = 0
    try:
        mechanism = b"PLAIN" if plain else b"NULL"
        conn.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\0") + b"\0" + b"\0" * 31)
        if plain:
            body = b"\x05HELLO" + b"\x10" + os.urandom(16) + b"\x10" + os.urandom(16)
        else:
            body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 4) + b"PUSH"
        conn.sendall(b"\x04" + bytes([len(body)]) + body)
        conn.sendall(b"\x02" + struct.pack(">Q", size))
        chunk = b"\0" * (1 << 20)
        while taken < send:
            conn.sendall(chunk)
            taken += len(chunk)
    except (BrokenPipeError, ConnectionResetError, socket.timeout):
        pass
    finally:
        conn.close()
    return taken


def _curve_stranger(address: str, server: bytes, hop_key: bytes | None = None) -> zmq.Socket:
    """A real ZeroMQ sending end toward a data ``address`` that holds ``server`` as the port's CURVE key and a
    client key of its own (from ``hop_key`` when given, as a session's end makes it; else one no session has)."""
    from test_sessions_bounded import admitted

    s = zmq.Context.instance().socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    admitted(s, hop_key or os.urandom(32), server)
    s.connect(address)
    return s


def test_strangers_claiming_huge_frames_on_the_data_port_cost_the_node_nothing(fuzzed):
    """Eight strangers at once, each announcing a 2 GiB frame (under the node's 4 GiB cap) and sending 96 MiB
    of it, while four more hold the node's key and a CURVE key of their own: none is let past the
    connection's handshake, so the node buffers none of it."""
    import threading

    node = fuzzed
    before = ask_raw(node.address, cbor2.dumps({"op": "status"}))["refused_connections"]
    rss0 = node.rss()
    taken: list[int] = []
    t0 = time.monotonic()
    threads = [threading.Thread(target=lambda i=i: taken.append(_stream_claim(node.data, 2 << 30, 96 << 20, i % 2)))
               for i in range(8)]
    for t in threads:
        t.start()
    keyed = [_curve_stranger(node.data, node.key) for _ in range(4)]
    for s in keyed:
        s.send(b"\0" * (1 << 20), zmq.NOBLOCK)
    for t in threads:
        t.join(60)
    took = time.monotonic() - t0
    time.sleep(0.5)
    for s in keyed:
        s.close()
    grown = node.rss() - rss0
    refused = ask_raw(node.address, cbor2.dumps({"op": "status"}))["refused_connections"] - before
    print(f"\n8 strangers claiming 2 GiB frames: {sum(taken) >> 20} MiB sent before the hang-ups, in {took:.1f} s; "
          f"node RSS {grown / 2 ** 20:+.1f} MiB; {refused} refused by admission (the others by mechanism)")
    assert len(taken) == 8 and grown < 64 << 20, (taken, grown)
    assert refused >= 4  # the ones that completed a CURVE handshake were asked about, and refused
    assert hello_answered_within(node, 3.0)


def test_a_stranger_is_refused_at_the_handshake_and_the_node_keeps_serving_its_session(fuzzed):
    """Data naming a live session, sent by a stranger with no keys, with PLAIN credentials, with a CURVE key of
    its own, and with a wrong key for the node: none of it reaches the node's door (nothing is logged of it);
    the same data from the session's own sending end does, and is refused there."""
    from diffuse.wire.sealing import load_identity

    node, owner = fuzzed, load_identity(None)
    sessions = ask_raw(node.address, cbor2.dumps({"op": "status"}))["sessions"]
    live = _open_as(node, owner)
    sid = live["session"]
    junk = [cbor2.dumps({"v": 1, "s": sid, "c": 1, "n": 2}), b"not sealed"]
    before = ask_raw(node.address, cbor2.dumps({"op": "status"}))["refused_connections"]
    log0 = len(node.log())
    plain = zmq.Context.instance().socket(zmq.PUSH)
    plain.setsockopt(zmq.LINGER, 0)
    plain.setsockopt(zmq.PLAIN_USERNAME, sid)
    plain.setsockopt(zmq.PLAIN_PASSWORD, b"x" * 16)
    plain.connect(node.data)
    bare = zmq.Context.instance().socket(zmq.PUSH)
    bare.setsockopt(zmq.LINGER, 0)
    bare.connect(node.data)
    strangers = [plain, bare, _curve_stranger(node.data, node.key), _curve_stranger(node.data, os.urandom(32),
                                                                                      live["in_key"])]
    try:
        for s in strangers:
            s.send_multipart(junk, zmq.NOBLOCK)
        time.sleep(1.0)
        assert f"rejected a message for session {sid.hex()[:8]}" not in node.log()[log0:]
        own = _curve_stranger(node.data, node.key, live["in_key"])  # the session's key pair, the node's key
        own.send_multipart(junk)
        deadline = time.monotonic() + 5
        while f"rejected a message for session {sid.hex()[:8]}" not in node.log()[log0:]:
            assert time.monotonic() < deadline, "the session's own sending end was not let in"
            time.sleep(0.1)
        own.close()
    finally:
        for s in strangers:
            s.close()
    status = ask_raw(node.address, cbor2.dumps({"op": "status"}))
    assert status["refused_connections"] - before >= 1 and status["sessions"] == sessions + 1  # still open
    assert node.log()[log0:].count(f"rejected a message for session {sid.hex()[:8]}") == 1
    assert _close_as(node, owner, sid)["ok"] is True
