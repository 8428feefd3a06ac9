"""The second example transport: found through its entry point, true to diffuse.wire.transport on real sockets,
and carrying a ring byte-identical to plain diffusers."""

from __future__ import annotations

import doctest
import socket
import struct
import threading
import time

import families
import pytest

from conftest import run_reference, run_split


def test_plugin_is_registered_through_the_entry_point_and_serves_its_scheme_only():
    from importlib.metadata import entry_points

    from diffuse.wire.transport import transport_for

    assert "tcpstream" in {ep.name for ep in entry_points(group="diffuse")}
    assert type(transport_for("tcpstream://127.0.0.1:1")).__module__ == "diffuse_tcp.streams"
    assert type(transport_for("tcp://127.0.0.1:1")).__module__ == "transport.zmq_ring"


def test_its_docstring_examples_hold():
    import diffuse_tcp.framing
    import diffuse_tcp.streams

    results = [doctest.testmod(m) for m in (diffuse_tcp.framing, diffuse_tcp.streams)]
    assert sum(r.attempted for r in results) >= 5 and sum(r.failed for r in results) == 0


class Served:
    """A real endpoint served on a thread the way a node serves it: control answered, data collected."""

    def __init__(self, max_message_bytes: int | None = None):
        from diffuse.wire.transport import transport_for
        from diffuse.wire.transport import WireError

        self.transport = transport_for("tcpstream://")
        self.endpoint = self.transport.serve(self.transport.local_listen("test"), max_message_bytes)
        self.data: list[list[bytes]] = []
        self.stop = threading.Event()

        def serve():
            while not self.stop.is_set():
                for ready in self.endpoint.wait(0.1):
                    if ready == "data":
                        self.data.append(self.endpoint.recv_data())
                        continue
                    try:
                        request = self.endpoint.recv_control()
                    except WireError as exc:
                        self.endpoint.reply_control({"ok": False, "error": str(exc)})
                    else:
                        self.endpoint.reply_control({"ok": True, "op": request.get("op")})

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()

    def data_count(self, n: int, outbox=None, within_s: float = 10.0) -> int:
        deadline = time.monotonic() + within_s
        while len(self.data) < n and time.monotonic() < deadline:
            if outbox is not None:
                outbox.flush()
            time.sleep(0.01)
        return len(self.data)

    def close(self):
        self.stop.set()
        self.thread.join()
        self.endpoint.close()


@pytest.fixture
def served():
    s = Served(max_message_bytes=8 << 20)
    yield s
    s.close()


def test_objects_it_hands_out_have_every_member_the_protocols_name(served):
    from diffuse.wire.transport import Endpoint, Inbox, Outbox, Transport

    t = served.transport
    inbox = t.inbox(t.inbox_address(served.endpoint.control_address))
    outbox = t.outbox(inbox.address)
    try:
        assert isinstance(t, Transport) and isinstance(served.endpoint, Endpoint)
        assert isinstance(inbox, Inbox) and isinstance(outbox, Outbox)
        assert served.endpoint.address != served.endpoint.control_address
    finally:
        outbox.close()
        inbox.close()


def test_messages_arrive_whole_and_in_order(served):
    t = served.transport
    outbox = t.outbox(served.endpoint.address)
    big = bytes(range(256)) * (6 << 12)  # 6 MiB: more than a socket takes at once, so it waits in the outbox
    sent = [[b"header", big], [b"second", b""], [b"third"]]
    try:
        for frames in sent:
            outbox.send(frames)
        assert served.data_count(3, outbox) == 3
        assert served.data == sent and not outbox.waiting and outbox.flush() is False
    finally:
        outbox.close()


def test_a_reply_goes_to_the_asker_and_a_bad_request_gets_its_refusal(served):
    from diffuse.wire.transport import encode_request

    t = served.transport
    address = served.endpoint.control_address
    assert t.request(address, {"op": "status"}, 5.0) == {"ok": True, "op": "status"}
    host, port = address.rsplit("/", 1)[1].split(":")
    for parts, refusal in (([encode_request({"op": "ping"})] * 2, "came in 2 parts"),
                           ([b"not cbor"], "control request is")):
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(struct.pack(">I", len(parts)) + b"".join(struct.pack(">Q", len(p)) + p for p in parts))
            sock.settimeout(5)
            raw = b""
            while len(raw) < 12 or len(raw) < 12 + struct.unpack(">Q", raw[4:12])[0]:
                raw += sock.recv(1 << 16)
        from diffuse.wire.transport import decode_reply

        reply = decode_reply(raw[12:], address)
        assert reply["ok"] is False and refusal in reply["error"]
    assert t.request(address, {"op": "ping"}, 5.0) == {"ok": True, "op": "ping"}


def test_a_frame_over_the_cap_cuts_off_its_sender_alone(served):
    t = served.transport
    host, port = served.endpoint.address.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(struct.pack(">IQ", 1, (8 << 20) + 1))  # claims one byte over the cap, sends none of it
        sock.settimeout(5)
        assert sock.recv(1) == b""  # hung up on at once
    outbox = t.outbox(served.endpoint.address)
    try:
        outbox.send([b"still served"])
        assert served.data_count(1, outbox) == 1 and served.data == [[b"still served"]]
    finally:
        outbox.close()


def test_a_node_that_is_not_there_is_a_node_error_within_the_time_given():
    from diffuse.wire.transport import transport_for
    from diffuse.wire.transport import NodeError

    with socket.socket() as s:  # a port nobody listens at
        s.bind(("127.0.0.1", 0))
        address = f"tcpstream://127.0.0.1:{s.getsockname()[1]}"
    t0 = time.monotonic()
    with pytest.raises(NodeError, match=r"no answer to 'hello' within 1 s \(3 tries\)"):
        transport_for(address).request(address, {"op": "hello"}, 1.0)
    assert time.monotonic() - t0 < 3.0


def test_ring_over_tcp_streams_is_byte_identical_to_plain_diffusers(models, tmp_path, diffuse_home):
    model = models("wan")
    kwargs = families.call_args("wan")
    reference = run_reference(model, kwargs, str(tmp_path / "reference.npy"))
    split, report = run_split(model, kwargs, tmp_path, nodes=2, extra=["--local-transport", "tcpstream"],
                              home=diffuse_home)
    assert split.tobytes() == reference.tobytes()
    assert report["transport"] == "tcpstream"
