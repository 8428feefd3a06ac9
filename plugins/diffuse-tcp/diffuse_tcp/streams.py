"""A Diffuse transport over plain TCP streams: the standard library's sockets, one connection per sender.

A message (a list of frames) travels on a stream length-prefixed (``diffuse_tcp.framing``).

Data: a node listens on two ports, control (the address it is dialled at) and
data; each sender toward a data address holds one connection and sends its
messages in order. Control: the client connects to the control port, sends one
message of one part (the CBOR request), reads one message back (the reply) and
hangs up; a reply goes back on the connection that asked, so nobody else's junk
can take it.

Every wait is bounded: a node's endpoint is read with a selector from the
node's control thread, what a next hop cannot take yet waits in the outbox (a
few messages at most), and only an outbox's connect blocks, for
``CONNECT_TIMEOUT_S`` at most. Every receiving connection has
caps: a part claiming more than the cap, or a message claiming more parts than
``MAX_PARTS``, cuts that connection off before the bytes are kept.

Only ``diffuse.wire.transport`` and the standard library are used: sealing,
envelopes and the meaning of the bytes are the core's.
"""

from __future__ import annotations

import collections
import selectors
import socket
import time

from diffuse.wire.transport import (DEFAULT_MAX_MESSAGE_BYTES, IDEMPOTENT, MAX_CONTROL_BYTES, MAX_PARTS, MAX_REPLY_BYTES,
                                   DiffuseError, NodeError, WireError, decode_reply, decode_request, encode_reply,
                                   encode_request)

from diffuse_tcp.framing import READ_BYTES, SCHEME, Connection, Cut, Hub, Reader, encode, join_address, split_address

CONTROL_PARTS = 16  # a request is one part; a few more are read whole, so that their sender can be told so
CONNECT_TIMEOUT_S = 10.0  # an outbox's connection to a data address
TRIES = 3  # connections an idempotent request may be sent on, one each third of its time
MAX_WAITING = 8  # messages an outbox keeps while its peer takes none; one more and the peer is given up
STUCK_S = 30.0  # an outbox whose peer takes no byte for this long: the peer is given up


def _wait_until(hub: Hub, kinds: tuple[str, ...], timeout_s: float) -> list[str]:
    """Serve ``hub`` until a message of one of ``kinds`` is whole, or ``timeout_s`` passed; which are ready."""
    deadline = time.monotonic() + timeout_s
    hub.poll(0.0)  # connections are served even while messages wait to be taken
    while True:
        ready = [k for k in kinds if hub.ready[k]]
        left = deadline - time.monotonic()
        if ready or left <= 0:
            return ready
        hub.poll(left)


class StreamEndpoint:
    """A node's listening side: the control port it is dialled at, and a data port beside it."""

    def __init__(self, listen: str, max_message_bytes: int | None = None):
        host, port = split_address(listen)
        self.hub = Hub()
        try:
            control = self.hub.listen("control", host, port, MAX_CONTROL_BYTES, CONTROL_PARTS)
            data = self.hub.listen("data", host, 0, max_message_bytes or DEFAULT_MAX_MESSAGE_BYTES, MAX_PARTS)
        except BaseException:
            self.hub.close()
            raise
        self.control_address = join_address(host, control)
        self.address = join_address(host, data)
        self._asker: Connection | None = None  # the connection owed an answer to the request last received

    def wait(self, timeout_s: float) -> list[str]:
        return _wait_until(self.hub, ("control", "data"), timeout_s)

    def recv_control(self) -> dict:
        self._asker = None
        if not self.hub.ready["control"]:
            raise WireError("no control message was waiting")
        self._asker, parts = self.hub.ready["control"].popleft()
        if len(parts) != 1:
            raise WireError(f"control request came in {len(parts)} parts; a request is one CBOR map")
        return decode_request(parts[0])

    def reply_control(self, reply: dict) -> None:
        asker, self._asker = self._asker, None
        if asker is not None:
            self.hub.send(asker, [encode_reply(reply)])

    def recv_data(self) -> list[bytes]:
        if not self.hub.ready["data"]:
            raise WireError("no data message was waiting")
        return self.hub.ready["data"].popleft()[1]

    def close(self) -> None:
        self.hub.close()


class StreamInbox:
    """The client's receiving end: a data port the ring's last node connects to."""

    def __init__(self, bind: str, max_message_bytes: int | None = None):
        host, port = split_address(bind)
        self.hub = Hub()
        self.address = join_address(host, self.hub.listen("data", host, port,
                                                          max_message_bytes or DEFAULT_MAX_MESSAGE_BYTES, MAX_PARTS))

    def recv(self, timeout_s: float) -> list[bytes] | None:
        if not _wait_until(self.hub, ("data",), timeout_s):
            return None
        return self.hub.ready["data"].popleft()[1]

    def close(self) -> None:
        self.hub.close()


class StreamOutbox:
    """One connection toward a data address that never blocks: what the peer cannot take yet waits here,
    a few messages at most, and goes out on the next ``send`` or ``flush``. A peer that takes no byte for
    ``STUCK_S``, or while ``MAX_WAITING`` messages pile up, is given up: NodeError naming it."""

    def __init__(self, address: str):
        host, port = split_address(address)
        try:
            self.sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        except OSError as exc:
            raise DiffuseError(f"cannot send to {address!r}: {exc}") from exc
        self.sock.setblocking(False)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.address = address
        self.waiting: collections.deque[memoryview] = collections.deque()  # what is not sent yet, per message
        self._progress = time.monotonic()  # when the peer last took a byte, or the queue was last empty

    def send(self, frames: list[bytes]) -> None:
        self.flush()
        if len(self.waiting) >= MAX_WAITING:
            raise NodeError(self.address, f"takes no messages: {MAX_WAITING} wait for it (stuck or gone)")
        if not self.waiting:
            self._progress = time.monotonic()
        self.waiting.append(memoryview(encode(frames)))
        self.flush()

    def flush(self) -> bool:
        while self.waiting:
            try:
                sent = self.sock.send(self.waiting[0])
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                raise NodeError(self.address, f"the connection broke ({exc})") from None
            if sent:
                self._progress = time.monotonic()
            if sent < len(self.waiting[0]):
                self.waiting[0] = self.waiting[0][sent:]
                if time.monotonic() - self._progress > STUCK_S:
                    raise NodeError(self.address, f"took nothing for {STUCK_S:.0f} s (stuck or gone)")
                return True
            self.waiting.popleft()
        return False

    def close(self) -> None:
        self.waiting.clear()  # what a given-up peer never took is dropped; what was sent is the kernel's to deliver
        self.sock.close()


class StreamTransport:
    """The ``tcpstream://`` transport (``diffuse.wire.transport.Transport``)."""

    scheme = SCHEME

    def local_listen(self, name: str) -> str:
        return f"{SCHEME}://127.0.0.1:0"

    def inbox_address(self, first_node: str) -> str:
        """The interface this machine reaches the first node by (loopback for loopback), any free port."""
        host, _ = split_address(first_node)
        if host in ("127.0.0.1", "localhost", "::1"):
            return f"{SCHEME}://127.0.0.1:0"
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return join_address(s.getsockname()[0], 0)

    def serve(self, listen: str, max_message_bytes: int | None = None) -> StreamEndpoint:
        return StreamEndpoint(listen, max_message_bytes)

    def inbox(self, bind: str, max_message_bytes: int | None = None) -> StreamInbox:
        return StreamInbox(bind, max_message_bytes)

    def outbox(self, address: str) -> StreamOutbox:
        return StreamOutbox(address)

    def request(self, address: str, message: dict, timeout_s: float) -> dict:
        """One request/reply within ``timeout_s``. An idempotent request is also sent again on a fresh
        connection each third of the time, in case an answer was lost; the first answer to any try is taken."""
        host, port = split_address(address)
        raw = encode([encode_request(message)])
        op = message.get("op")
        tries = TRIES if op in IDEMPOTENT else 1
        start = time.monotonic()
        sel = selectors.DefaultSelector()
        why = ""
        try:
            for k in range(tries):
                try_end = start + timeout_s * (k + 1) / tries
                why = _ask(sel, host, port, raw, try_end) or why
                while (left := try_end - time.monotonic()) > 0:
                    if not sel.get_map():
                        time.sleep(min(left, 0.1))  # nothing asked is still open: wait out this try's time
                        continue
                    for key, _ in sel.select(left):
                        answer = _answer(sel, key)
                        if answer is not None:
                            return decode_reply(answer, address)
        finally:
            for key in list(sel.get_map().values()):
                key.fileobj.close()
            sel.close()
        raise NodeError(address, f"no answer to {str(op)[:32]!r} within {timeout_s:.0f} s"
                        + (f" ({tries} tries)" if tries > 1 else "") + (f"; {why}" if why else ""))


def _ask(sel: selectors.BaseSelector, host: str, port: int, raw: bytes, until: float) -> str:
    """Connect and send one request, its connection then waited on in ``sel``; why not, or ''."""
    try:
        sock = socket.create_connection((host, port), timeout=max(0.01, until - time.monotonic()))
    except OSError as exc:
        return f"cannot connect: {exc}"
    try:
        sock.settimeout(max(0.01, until - time.monotonic()))
        sock.sendall(raw)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        return f"the request could not be sent: {exc}"
    sel.register(sock, selectors.EVENT_READ, Reader(MAX_REPLY_BYTES, 1))
    return ""


def _answer(sel: selectors.BaseSelector, key: selectors.SelectorKey) -> bytes | None:
    """Read what one asked connection has; its reply once whole. A connection that ends or breaks the framing
    first is closed and given up (another try may still be answered)."""
    try:
        data = key.fileobj.recv(READ_BYTES)
        messages = key.data.feed(data) if data else None
    except (BlockingIOError, InterruptedError):
        return None
    except (OSError, Cut):
        messages = None
    if messages:
        return messages[0][0]
    if messages is None:
        sel.unregister(key.fileobj)
        key.fileobj.close()
    return None
