"""A node stays bounded whatever a stranger sends: decode limits, a control socket that cannot lose an
answer to junk, a cheap status, message-size caps, session caps.

One real node process (every block of the tiny Wan, an open-file limit of 256), real ZeroMQ sockets on
loopback; each attack is sent the way anyone who can reach the node's ports could send it.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

import cbor2
import numpy as np
import pytest
import zmq

from conftest import THREADS, subprocess_env
from test_hardening import _client, _said, _stop

OPEN_FILES = 256  # the node's descriptor limit: room for (256 - 128) // 3 = 42 sessions
CUT_MB = 16  # the node's --max-message-mb


def start_node(model: str, extra=(), open_files: int | None = None, log_path: str | None = None):
    """A node holding every block, started with ``extra`` flags (and an open-file limit): (process, ready line)."""
    cmd = [sys.executable, "-m", "diffuse.node", "--model", model, "--threads", str(THREADS), "--blocks", "all",
           "--ephemeral-key", *extra]

    def limit():
        if open_files:
            resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

    with open(log_path or os.devnull, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=subprocess_env(),
                                preexec_fn=limit)
    line = proc.stdout.readline()
    if not line:
        proc.wait(30)
        raise AssertionError(f"node did not start: {open(log_path).read()[-2000:] if log_path else ''}")
    return proc, json.loads(line)


class Target:
    """A running node: its process, addresses and key, and what it says in its log."""

    def __init__(self, model: str, log_path: str, extra=(), open_files: int | None = None):
        from diffuse.wire.transport import transport_for

        self.model, self.log_path = model, log_path
        self.proc, ready = start_node(model, extra, open_files, log_path)
        self.address, self.key_hex = ready["address"], ready["key"]
        self.key = bytes.fromhex(self.key_hex)
        self.transport = transport_for(self.address)
        self.data = self.ask({"op": "hello", "wire": [1]})["data"]
        self.pinned = f"{self.address}#{self.key_hex}"

    def ask(self, message: dict, timeout: float = 10.0) -> dict:
        return self.transport.request(self.address, message, timeout)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def rss(self) -> int:
        return _status_field(self.proc.pid, "VmRSS")

    def cpu_s(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _status_field(pid: int, name: str) -> int:
    """A /proc/PID/status size field, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {name} for process {pid}")


@pytest.fixture(scope="module")
def target(models, tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("bounds") / "node.log")
    node = Target(models("wan"), log_path, ["--max-message-mb", str(CUT_MB)], OPEN_FILES)
    try:
        yield node
    finally:
        _stop(node.proc)


def ask_raw(address: str, body: bytes, timeout_s: float = 5.0) -> dict | None:
    """One request on a REQ socket of its own, asked once (no retry): the answer, or None if none came."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send(body)
        return cbor2.loads(sock.recv()) if sock.poll(int(timeout_s * 1000)) else None
    finally:
        sock.close(0)


def hello_answered_within(node: Target, seconds: float) -> bool:
    t0 = time.monotonic()
    answer = ask_raw(node.address, cbor2.dumps({"op": "hello", "wire": [1]}), seconds)
    return answer is not None and answer.get("ok") is True and time.monotonic() - t0 < seconds


# --------------------------------------------------------------------------- control decoded within limits


def _colliding_keys(count: int) -> bytes:
    """A CBOR map of ``count`` distinct integer keys that all hash alike in Python (multiples of 2**61 - 1, as
    bignums): building it as a dict costs count**2 comparisons. Under 1 MiB for 75,000 keys."""
    out = [b"\xba", struct.pack(">I", count)]
    for k in range(1, count + 1):
        n = (k * ((1 << 61) - 1)).to_bytes(10, "big")
        out.append(b"\xc2\x4a" + n + b"\x00")
    return b"".join(out)


def _shared_reference_bomb(depth: int) -> bytes:
    """{"op": "hello", "wire": x} where x is a list of two references to a list of two references ... ``depth``
    levels: a few hundred bytes on the wire, 2**depth leaves when walked."""
    x: list = [1]
    for _ in range(depth):
        x = [x, x]
    return cbor2.dumps({"op": "hello", "wire": x}, value_sharing=True)


def test_colliding_keys_and_reference_bombs_are_refused_before_they_are_built(target):
    bomb = _colliding_keys(75_000)
    assert len(bomb) < 1 << 20
    answers: dict = {}
    sender = threading.Thread(target=lambda: answers.setdefault("keys", ask_raw(target.address, bomb, 30)))
    sender.start()
    time.sleep(0.5)
    assert hello_answered_within(target, 3.0), "a client arriving just after the bomb was kept waiting"
    sender.join(30)
    keys = ask_raw(target.address, _colliding_keys(20_000), 5)  # under the size limit
    refs = ask_raw(target.address, _shared_reference_bomb(40), 5)
    deep = ask_raw(target.address, b"\xa1\x62op" + b"\x81" * 5000 + b"\x00", 5)
    for answer, why in [(answers.get("keys"), "control request of 975005 bytes is over the 262144-byte limit"),
                        (keys, "has a map of more than 64 keys"),
                        (refs, "uses CBOR tag 28, which is not accepted"), (deep, "nests deeper than 16")]:
        assert answer is not None and answer["ok"] is False and why in answer["error"], (answer, why)
    assert hello_answered_within(target, 3.0)
    assert "Traceback" not in target.log()


def test_safecbor_refuses_what_cbor2_would_build_at_a_cost():
    """The raw-bytes check itself: each refusal names its reason; plain data passes unchanged."""
    from diffuse.wire import safecbor
    from diffuse.errors import WireError

    plain = {"op": "call", "seq": 3, "x": [1.5, None, True, b"\0" * 64, {"k": -2 ** 70}], "s": "é"}
    assert safecbor.loads(cbor2.dumps(plain), safecbor.CONTROL) == plain
    for raw, why in [
        (_colliding_keys(10), "map key that is not text"),
        (cbor2.dumps({str(i): i for i in range(65)}), "more than 64 keys"),
        (cbor2.dumps({"a": list(range(5000))}), "more than 4096 CBOR items"),
        (_shared_reference_bomb(3), "tag 28"),
        (cbor2.dumps({"a": "x" * 20, "b": "x" * 20}, string_referencing=True), "tag 256"),
        (cbor2.dumps({"a": "x" * 20, "b": "x" * 20}, string_referencing=True)[3:], "tag 25,"),
        (b"\xa1\x61a\xd9\x01\x00\x80", "tag 256"),
        (b"\xa1\x61a\xc2\x58\x20" + b"\1" * 32, "oversized big integer"),
        (b"\xbf\x61a\x00\xff", "not CBOR"),  # indefinite length
        (b"\xa1\x61a\x9b" + b"\xff" * 8, "claims 18446744073709551615 entries"),
        (cbor2.dumps({"a": "xyz"})[:-1], "not CBOR"),
        (cbor2.dumps({"a": 1}) + b"\0", "1 bytes after its end"),
        (cbor2.dumps([1, 2]), "is a list, not a map"),
        (b"\xa1\x61a\xf0", "simple value"),
        (b"\xa1\x61a" + b"\x81" * 20 + b"\0", "nests deeper than 16"),
        (cbor2.dumps({"a": b"\0" * (300 << 10)}), "over the 262144-byte limit"),
    ]:
        with pytest.raises(WireError, match=why):
            safecbor.loads(raw, safecbor.CONTROL, "control request")


# --------------------------------------------------------------------------- nobody's junk takes an answer


def test_junk_on_the_control_socket_never_takes_another_clients_answer(target):
    ctx = zmq.Context.instance()
    hello = cbor2.dumps({"op": "hello", "wire": [1]})
    lost = stolen = 0
    for junk in ([hello], [b"", hello], [b"x", b"", hello], [os.urandom(40)], [b"", b"\xff"]) * 2:
        sock = ctx.socket(zmq.DEALER)  # speaks without the REQ delimiter when told to; hangs up after
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(target.address)
        sock.send_multipart(junk)
        time.sleep(0.05)
        answer = ask_raw(target.address, hello, 3.0)  # someone else's request, while the junk's sender is there
        lost += not (answer and answer.get("ok") is True and isinstance(answer.get("challenge"), bytes))
        stolen += junk[0] != b"" and sock.poll(200) != 0  # the junk's sender must not get that answer
        sock.close()
    assert (lost, stolen) == (0, 0), f"{lost} of 10 legitimate hellos went unanswered, {stolen} went to the junk"
    assert "without the request delimiter: dropped" in target.log()


def test_client_asks_idempotent_requests_again_on_a_fresh_socket():
    """A node whose first answer is lost (here a ROUTER that ignores the first request it gets): hello, ping
    and status are asked again on a new socket within the same time; open is asked once."""
    from diffuse.errors import NodeError
    from transport.zmq_ring import TRIES, ZmqTransport

    server = zmq.Context.instance().socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    seen: list[bytes] = []
    stop, mute = threading.Event(), threading.Event()

    def serve():
        while not stop.is_set():
            if server.poll(50):
                ident, _, body = server.recv_multipart()
                seen.append(ident)
                if len(seen) % 2 == 0 and not mute.is_set():  # every second request is answered
                    server.send_multipart([ident, b"", cbor2.dumps({"ok": True, "op": cbor2.loads(body)["op"]})])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    t = ZmqTransport("tcp")
    address = f"tcp://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        assert t.request(address, {"op": "status"}, 1.5) == {"ok": True, "op": "status"}
        assert time.monotonic() - t0 < 1.5 and len(seen) == 2 and seen[0] != seen[1]  # two sockets
        with pytest.raises(NodeError, match=r"no answer to 'open' within 1 s$"):
            t.request(address, {"op": "open"}, 1.0)
        assert len(seen) == 3  # asked once
        mute.set()  # a node that answers nothing: every try is made, within the same time
        t0 = time.monotonic()
        with pytest.raises(NodeError, match=rf"no answer to 'ping' within 1 s \({TRIES} tries\)"):
            t.request(address, {"op": "ping"}, 1.0)
        assert len(seen) == 3 + TRIES and time.monotonic() - t0 < 1.5
    finally:
        stop.set()
        thread.join(5)
        server.close(0)


# --------------------------------------------------------------------------- status: cheap, and totals only


def test_status_is_cheap_and_says_only_totals(target):
    ctx = zmq.Context.instance()
    status = cbor2.dumps({"op": "status"})
    answer = target.ask({"op": "status"})
    assert set(answer) == {"ok", "sessions", "outboxes", "state_bytes", "slices", "max_sessions",
                           "max_sessions_per_client", "batching", "batches", "batched_rows",
                           "batch_fallbacks", "refused_connections", "quantize", "totals", "about"}, answer
    assert answer["quantize"] == "none"  # this node was started without --quantize
    # what a service's view of the ring shows: totals of the node, never of a session
    assert set(answer["about"]) == {"key", "device", "dtype", "memory", "links"}, answer["about"]
    assert set(answer["about"]["memory"]) == {"weights", "state", "buffers", "free"}, answer["about"]
    assert answer["max_sessions"] == (OPEN_FILES - 128) // 3  # what the open-file limit leaves room for
    # 64 askers that send status and never read, then leave: a hello right after is answered at once
    askers = []
    for _ in range(64):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 500)
        s.connect(target.address)
        for _ in range(20):
            s.send_multipart([b"", status])
        askers.append(s)
    for s in askers:
        s.close()
    assert hello_answered_within(target, 2.0)
    cpu0 = target.cpu_s()
    for _ in range(200):
        assert ask_raw(target.address, status)["ok"] is True
    per_status = (target.cpu_s() - cpu0) / 200
    print(f"node CPU per status: {per_status * 1e3:.2f} ms")
    assert per_status < 0.005, f"status costs the node {per_status * 1e3:.1f} ms of CPU"


# --------------------------------------------------------------------------- message-size caps


def _claim(address: str, size: int) -> tuple[bool, float]:
    """Speak ZMTP 3.0 as a PUSH peer to ``address`` and announce one frame of ``size`` bytes, sending only a
    few of them: (whether the receiver hung up on us within 3 s, seconds it took). A receiver that admits
    only its sessions' sending ends hangs up at the greeting already."""
    host, port = address.split("://", 1)[1].rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=3)
    t0 = time.monotonic()
    try:
        conn.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31)
        body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 4) + b"PUSH"
        conn.sendall(b"\x04" + bytes([len(body)]) + body)
        t0 = time.monotonic()
        conn.sendall(b"\x02" + struct.pack(">Q", size) + b"\0" * 1024)
        try:
            while True:
                if not conn.recv(65536):  # the greeting and READY come back first; then the hang-up
                    return True, time.monotonic() - t0
        except ConnectionResetError:
            return True, time.monotonic() - t0
        except socket.timeout:
            return False, time.monotonic() - t0
    except (BrokenPipeError, ConnectionResetError):  # hung up on before the claim was even sent whole
        return True, time.monotonic() - t0
    finally:
        conn.close()


def test_huge_claims_are_cut_off_before_they_are_buffered(target):
    from transport.zmq_ring import ZmqTransport

    vm0 = _status_field(target.proc.pid, "VmSize")
    rss0 = target.rss()
    for size in ((CUT_MB << 20) + 1, 6 << 30, 1 << 40):
        cut, took = _claim(target.data, size)
        assert cut and took < 2.0, f"a claim of {size} bytes was not cut off ({took:.1f} s)"
    assert _status_field(target.proc.pid, "VmSize") - vm0 < 256 << 20  # nothing reserved for the claims
    assert target.rss() - rss0 < 64 << 20
    # the client's inbox likewise: its own cap, and the transport's default when none is given
    t = ZmqTransport("tcp")
    small, default = t.inbox("tcp://127.0.0.1:0", 1 << 20), t.inbox("tcp://127.0.0.1:0")
    try:
        from diffuse.wire.transport import DEFAULT_MAX_MESSAGE_BYTES

        assert default.sock.getsockopt(zmq.MAXMSGSIZE) == DEFAULT_MAX_MESSAGE_BYTES
        cut, _ = _claim(small.address, (1 << 20) + 1)
        assert cut
        assert _claim(default.address, DEFAULT_MAX_MESSAGE_BYTES + 1)[0]
    finally:
        small.close()
        default.close()
    assert hello_answered_within(target, 3.0)


# --------------------------------------------------------------------------- session caps


def _open_as(node: Target, identity, next_address: str = "tcp://127.0.0.1:1") -> dict:
    """A well-formed sealed open of an empty slice from ``identity``, its next hop ``next_address``: the
    node's sealed answer, opened (with the session id and its hop key into the node added)."""
    from diffuse.plan.messages import StagePlan
    from diffuse.wire.sealing import open_control, seal_control

    hello = node.ask({"op": "hello", "wire": [1]})
    stage = StagePlan(hello["model"], "float32", (), next_address)
    payload = {"op": "open", "session": os.urandom(16), "challenge": hello["challenge"], "in_key": os.urandom(32),
               "out_key": os.urandom(32), "stage": stage.to_dict()}
    reply = node.ask(dict(seal_control(payload, node.key, identity), op="open"))
    inner, _ = open_control(reply, identity)
    return dict(inner, session=payload["session"], in_key=payload["in_key"])


def _close_as(node: Target, identity, sid: bytes) -> dict:
    from diffuse.wire.sealing import open_control, seal_control

    reply = node.ask(dict(seal_control({"op": "close", "session": sid}, node.key, identity), op="close"))
    return open_control(reply, identity)[0]


def _ping_as_owner(node: Target, sid: bytes, in_key: bytes) -> dict:
    """The ping a session's own client sends: it proves the hop key, so it renews the session's lease."""
    from diffuse.wire.tokens import ping_proof

    return node.ask({"op": "ping", "session": sid, "proof": ping_proof(in_key, sid)})


def test_a_squatter_holding_every_place_cannot_lock_out_a_client(target, tmp_path, diffuse_home):
    """A squatter opens sessions under three fresh keys until the node is full, and keeps every one alive with
    its own proven pings. The cap per key refuses its fourth to sixth keys' worth; the cap in all is kept by
    ending the session longest without data, so a client that comes then opens, runs to the end, and the
    squatter's session that made room hears why at its next ping."""
    from diffuse.node.server import MAX_SESSIONS_PER_CLIENT
    from diffuse.wire.sealing import load_identity

    cap = target.ask({"op": "status"})["max_sessions"]
    squatter = [load_identity(None) for _ in range(3)]
    opened: list[tuple] = []
    refused: list[str] = []
    t0 = time.monotonic()
    for who in squatter:  # each key asks for more than its share, all pointing at a closed port
        for _ in range(MAX_SESSIONS_PER_CLIENT + 4):
            answer = _open_as(target, who)
            if answer["ok"]:
                opened.append((who, answer["session"], answer["in_key"]))
            else:
                refused.append(answer["error"])
    print(f"{len(opened)} opens accepted, {len(refused)} refused in {time.monotonic() - t0:.1f} s")
    assert len(refused) == 3 * 4 and all("its limit per client" in e for e in refused), refused
    assert len(opened) == 3 * MAX_SESSIONS_PER_CLIENT > cap == target.ask({"op": "status"})["sessions"]
    said = [_ping_as_owner(target, sid, key) for _, sid, key in opened]  # the squatter keeps what it holds
    evicted = [s for s in said if s["session_known"] is False]
    assert len(evicted) == len(opened) - cap, said  # the first opened, one for each open past the cap
    assert all("evicted: this node was full" in s["failed"] for s in evicted), evicted
    assert all(s["renewed"] is True for s in said if s["session_known"])
    # full, and every place renewed by its holder: a client comes, opens, and runs to the end
    run = _client(target.model, [target.pinned], tmp_path, diffuse_home, save=str(tmp_path / "run.npy"))
    assert run.returncode == 0, run.stderr[-2000:]
    assert np.isfinite(np.load(tmp_path / "run.npy")).all()
    assert target.ask({"op": "status"})["sessions"] == cap - 1  # its session made room, then closed
    held = [(who, sid) for who, sid, key in opened if _ping_as_owner(target, sid, key)["session_known"]]
    assert len(held) == cap - 1
    for who, sid in held:
        assert _close_as(target, who, sid)["ok"] is True
    assert target.ask({"op": "status"})["sessions"] == 0
    assert hello_answered_within(target, 3.0)
    assert "Too many open files" not in target.log() and "Traceback" not in target.log()
