"""The ZeroMQ ring: ROUTER control per node, PUSH/PULL data between stages.

Sockets only: what the bytes mean, and who may read them, is core's business
(``diffuse.wire.frames``, ``diffuse.wire.sealing``). A node is dialled at one address,
its control socket; the hello reply tells the data address (a second port, or
``<path>.data`` for a path scheme). Every wait is bounded: a silent peer
becomes a NodeError, never a hang. Every receiving socket has a message-size
cap, so a peer claiming a huge message is cut off before it is buffered.

The control socket is a ROUTER read with explicit framing (the peer's routing
id, the empty delimiter a REQ socket sends, one body frame): anything else is
dropped, and a reply goes to the peer that asked or nowhere, so no one's junk
can take someone else's answer. The client asks with a fresh REQ socket per
try and tries idempotent requests again (hello, ping, status).

Every data connection is authenticated and encrypted by ZeroMQ's CURVE
handshake, and admitted before any frame of a message is taken: a receiving
socket given a ``server_key`` is a CURVE server under it (a node's long-term
key, or the client's inbox's key for the session), a sending end is a CURVE
client under the key pair the core gives it (``diffuse.wire.admission``), and
this context's ZAP handler (``_Admission``, a thread) asks the receiver's
``admit`` about each client key. A peer speaking another mechanism, or one
that cannot prove the server key it was given, is hung up on at the
handshake. ZeroMQ buffers a message whole before the receiver can read any
of it, so admitting the connection is the one place a stranger's bytes can
be refused before they are held.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import threading
import time

import zmq

from diffuse.wire.transport import (DEFAULT_MAX_MESSAGE_BYTES, IDEMPOTENT, MAX_CONTROL_BYTES, MAX_REPLY_BYTES,
                                   DiffuseError, NodeError, WireError, decode_reply, decode_request, encode_reply,
                                   encode_request, hookimpl)

TRIES = 3  # sockets an idempotent request may be sent on, one each third of its time
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where ZeroMQ asks a context's handler about each new connection


class _Admission:
    """The ZAP handler of one ZeroMQ context: a thread that answers ZeroMQ's question about each CURVE
    connection to a receiving socket by that socket's ``admit(client_public)`` (its ZAP domain names it).
    Sockets registered without one admit every client that completed the handshake; a domain not
    registered here, another mechanism, or an ``admit`` that raises, admits no one."""

    _handlers: dict = {}
    _lock = threading.Lock()
    _numbers = itertools.count(1)

    def __init__(self, ctx: zmq.Context):
        self.admits: dict[bytes, object] = {}
        bound = threading.Event()
        threading.Thread(target=self._serve, args=(ctx, bound), name="zap", daemon=True).start()
        bound.wait(10.0)  # the thread's socket is bound before any receiving socket relies on it

    @classmethod
    def register(cls, ctx: zmq.Context, admit) -> bytes:
        """A ZAP domain for a new receiving socket of ``ctx``, whose connections ``admit`` decides (None: all)."""
        with cls._lock:
            handler = cls._handlers.get(id(ctx))
            if handler is None:
                handler = cls._handlers[id(ctx)] = cls(ctx)
            domain = b"diffuse-%d" % next(cls._numbers)
            handler.admits[domain] = admit
        return domain

    @classmethod
    def forget(cls, ctx: zmq.Context, domain: bytes) -> None:
        with cls._lock:
            handler = cls._handlers.get(id(ctx))
            if handler is not None:
                handler.admits.pop(domain, None)

    def _serve(self, ctx: zmq.Context, bound: threading.Event) -> None:
        sock = ctx.socket(zmq.REP)  # made, bound and used in this thread only
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(ZAP_ENDPOINT)
        bound.set()
        while True:
            try:
                request = sock.recv_multipart()
                version, rid = (request + [b"", b""])[:2]
                sock.send_multipart([version, rid, *self._verdict(request), b"", b""])
            except zmq.ZMQError:  # the context is ending
                return

    def _verdict(self, request: list[bytes]) -> tuple[bytes, bytes]:
        if len(request) != 7 or request[5] != b"CURVE":
            return b"400", b"not a CURVE request"
        domain, client = request[2], request[6]
        with self._lock:
            if domain not in self.admits:
                return b"400", b"unknown domain"
            admit = self.admits[domain]
        try:
            ok = admit is None or bool(admit(client))
        except Exception:
            ok = False
        return (b"200", b"OK") if ok else (b"400", b"not admitted")


def _admitting(ctx: zmq.Context, sock: zmq.Socket, admit, server_key) -> bytes | None:
    """Make ``sock`` (not yet bound) a CURVE server under ``server_key`` (public, secret) whose connections
    ``admit`` decides; its ZAP domain. Without a key, a socket of no mechanism that takes any peer (``admit``
    then has nothing to decide by: refused)."""
    if server_key is None:
        if admit is not None:
            raise ValueError("a receiving socket that admits connections needs a CURVE server_key")
        return None
    public, secret = server_key
    domain = _Admission.register(ctx, admit)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain)
    return domain


def _forget(ctx: zmq.Context, domain: bytes | None) -> None:
    if domain is not None:
        _Admission.forget(ctx, domain)


class ZmqEndpoint:
    def __init__(self, ctx: zmq.Context, listen: str, scheme: str, max_message_bytes: int | None = None,
                 admit=None, server_key=None):
        self.ctx = ctx
        self.control = ctx.socket(zmq.ROUTER)
        self.data = ctx.socket(zmq.PULL)
        for s in (self.control, self.data):
            s.setsockopt(zmq.LINGER, 0)
        self.control.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_BYTES)
        self.data.setsockopt(zmq.MAXMSGSIZE, max_message_bytes or DEFAULT_MAX_MESSAGE_BYTES)
        self.domain = _admitting(ctx, self.data, admit, server_key)
        self.server_public = server_key[0] if server_key else None  # the data port's CURVE key, if it has one
        self._asker: bytes | None = None  # routing id of the peer owed an answer to the request last received
        if scheme == "tcp":
            host = listen.split("://", 1)[1].rsplit(":", 1)[0]
            self.control.bind(listen)
            self.control_address = self.control.getsockopt(zmq.LAST_ENDPOINT).decode()
            self.data.bind(f"tcp://{host}:0")
        else:
            self.control.bind(listen)
            self.control_address = listen
            self.data.bind(listen + ".data")
        self.address = self.data.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.poller = zmq.Poller()
        self.poller.register(self.control, zmq.POLLIN)
        self.poller.register(self.data, zmq.POLLIN)

    def wait(self, timeout_s: float) -> list[str]:
        ready = dict(self.poller.poll(int(timeout_s * 1000)))
        return [n for n, s in (("control", self.control), ("data", self.data)) if s in ready]

    def recv_control(self) -> dict:
        """One request. A WireError raised here may come after the request was taken off the socket:
        the caller still calls ``reply_control``, which answers it if its sender can be answered."""
        self._asker = None
        try:
            parts = self.control.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            raise WireError("no control message was waiting") from None
        if len(parts) < 3 or parts[1] != b"":
            # not a REQ peer's request (no delimiter): there is no one to answer, and nothing is owed
            raise WireError(f"control message of {len(parts)} frames without the request delimiter: dropped")
        self._asker = parts[0]
        if len(parts) != 3:
            raise WireError(f"control request came in {len(parts) - 2} parts; a request is one CBOR map")
        return decode_request(parts[2])

    def reply_control(self, reply: dict) -> None:
        asker, self._asker = self._asker, None
        if asker is None:
            return  # nothing was received whole: there is nobody to answer
        raw = encode_reply(reply)
        with contextlib.suppress(zmq.Again):  # a peer that stopped reading loses its own answer, nobody else's
            self.control.send_multipart([asker, b"", raw], zmq.NOBLOCK)

    def recv_data(self) -> list[bytes]:
        return self.data.recv_multipart(copy=False)  # frames opened where ZeroMQ received them (diffuse.wire.frames)

    def close(self) -> None:
        self.control.close(0)
        self.data.close(0)
        _forget(self.ctx, self.domain)
        _unlink_paths(self.control_address, self.address)


def _unlink_paths(*addresses: str) -> None:
    """A path-scheme (ipc://) socket's file outlives its socket: remove it when the socket closes."""
    for scheme, _, path in (a.partition("://") for a in addresses):
        if scheme != "tcp":
            with contextlib.suppress(OSError):
                os.unlink(path)


class ZmqInbox:
    def __init__(self, ctx: zmq.Context, bind: str, max_message_bytes: int | None = None, admit=None,
                 server_key=None):
        self.ctx = ctx
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes or DEFAULT_MAX_MESSAGE_BYTES)
        self.domain = _admitting(ctx, self.sock, admit, server_key)
        self.server_public = server_key[0] if server_key else None  # its CURVE key, if it has one
        self.sock.bind(bind)
        self.address = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    def recv(self, timeout_s: float) -> list[bytes] | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return self.sock.recv_multipart(copy=False)

    def close(self) -> None:
        self.sock.close(0)
        _forget(self.ctx, self.domain)
        _unlink_paths(self.address)


SEND_HWM = 8  # messages ZeroMQ queues toward one peer
MAX_WAITING = 8  # messages more an outbox keeps while its peer takes none; one more and the peer is given up
STUCK_S = 30.0  # a message still waiting this long: the peer is given up
BEHIND_S = 1  # with MAX_WAITING waiting, a send waits this long for the peer to take one before giving it up


class ZmqOutbox:
    """A sending end that does not block: what the peer cannot take yet waits here, a few messages at most,
    and goes out on the next ``send`` or ``flush``. A peer that takes nothing while ``MAX_WAITING`` more
    pile up (and ``BEHIND_S`` more), or for ``STUCK_S``, is given up: NodeError naming it. One slow peer delays only the
    messages meant for it."""

    def __init__(self, ctx: zmq.Context, address: str, curve: tuple[bytes, bytes, bytes] | None = None):
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        if curve is not None:  # (the receiver's server key, this end's public and secret key)
            for option, key in zip((zmq.CURVE_SERVERKEY, zmq.CURVE_PUBLICKEY, zmq.CURVE_SECRETKEY), curve):
                self.sock.setsockopt(option, key)
        self.sock.connect(address)
        self.address = address
        self.waiting: collections.deque = collections.deque()  # (since, frames)

    def send(self, frames: list[bytes]) -> None:
        if self.flush() and len(self.waiting) >= MAX_WAITING and self.sock.poll(BEHIND_S * 1000, zmq.POLLOUT):
            self.flush()  # a burst (many patches sent at once) outran ZeroMQ's own thread: it had a moment
        if len(self.waiting) >= MAX_WAITING:
            raise NodeError(self.address, f"takes no messages: {SEND_HWM + MAX_WAITING} wait for it (stuck or gone)")
        self.waiting.append((time.monotonic(), frames))
        self.flush()

    def flush(self) -> bool:
        """Hand on what waits, as far as the peer takes it; True while some still waits. NodeError if
        the oldest has waited ``STUCK_S``."""
        while self.waiting:
            since, frames = self.waiting[0]
            try:
                self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                if time.monotonic() - since > STUCK_S:
                    raise NodeError(self.address, f"took no message for {STUCK_S:.0f} s (stuck or gone)") from None
                return True
            self.waiting.popleft()
        return False

    def close(self) -> None:
        given_up = bool(self.waiting)
        self.waiting.clear()
        self.sock.close(0 if given_up else None)  # what a stuck peer never took is dropped, not lingered on


class ZmqTransport:
    """The reference transport for ``tcp://``. A plugin may serve another scheme ZeroMQ speaks
    (``ipc://``) by returning ``diffuse.wire.transport.zeromq_transport(scheme)``, which is this class."""

    curve = True  # serve and inbox take ``admit`` and ``server_key``, outbox takes ``curve`` (diffuse.wire.transport)

    def __init__(self, scheme: str = "tcp"):
        self.scheme = scheme
        self.ctx = zmq.Context.instance()

    @property
    def max_sockets(self) -> int:
        return self.ctx.get(zmq.MAX_SOCKETS)

    # sockets
    def local_listen(self, name: str) -> str:
        """Where a node started on this machine listens (``name`` tells nodes apart)."""
        if self.scheme == "tcp":
            return "tcp://127.0.0.1:0"
        import tempfile

        return f"{self.scheme}://{tempfile.gettempdir()}/diffuse-{name}"

    def inbox_address(self, first_node: str) -> str:
        """Where the client's inbox binds so that the ring's last node can reach it: the interface this
        machine uses to reach the first node (loopback for loopback); a fresh path for a path scheme."""
        if self.scheme != "tcp":
            import os
            import tempfile

            return f"{self.scheme}://{tempfile.gettempdir()}/diffuse-client-{os.getpid()}-{os.urandom(4).hex()}"
        host = first_node.split("://", 1)[1].rsplit(":", 1)[0]
        if host in ("127.0.0.1", "localhost", "[::1]"):
            return "tcp://127.0.0.1:0"
        import socket

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return f"tcp://{s.getsockname()[0]}:0"

    def serve(self, listen: str, max_message_bytes: int | None = None, admit=None, server_key=None) -> ZmqEndpoint:
        return ZmqEndpoint(self.ctx, listen, self.scheme, max_message_bytes, admit, server_key)

    def inbox(self, bind: str, max_message_bytes: int | None = None, admit=None, server_key=None) -> ZmqInbox:
        return ZmqInbox(self.ctx, bind, max_message_bytes, admit, server_key)

    def outbox(self, address: str, curve: tuple[bytes, bytes, bytes] | None = None) -> ZmqOutbox:
        try:
            return ZmqOutbox(self.ctx, address, curve)
        except zmq.ZMQError as exc:
            raise DiffuseError(f"cannot send to {address!r}: {exc}") from exc

    def request(self, address: str, message: dict, timeout_s: float) -> dict:
        """One request/reply within ``timeout_s``. An idempotent request (hello, ping, status) is also sent
        again on a fresh socket each third of the time, in case an answer was lost; the first answer to
        any of the tries is taken (an earlier try still counts: a slow node is not abandoned)."""
        raw = encode_request(message)
        op = message.get("op")
        tries = TRIES if op in IDEMPOTENT else 1
        socks: list[zmq.Socket] = []
        poller = zmq.Poller()
        answer = None
        try:
            for _ in range(tries):
                sock = self.ctx.socket(zmq.REQ)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
                socks.append(sock)
                sock.connect(address)
                sock.send(raw)
                poller.register(sock, zmq.POLLIN)
                ready = dict(poller.poll(max(1, int(timeout_s / tries * 1000))))
                if ready:
                    answer = next(iter(ready)).recv()
                    break
        finally:
            for sock in socks:
                sock.close(0)
        if answer is None:
            raise NodeError(address, f"no answer to {str(op)[:32]!r} within {timeout_s:.0f} s"
                            + (f" ({tries} tries)" if tries > 1 else ""))
        return decode_reply(answer, address)

    def exchange(self, address: str, messages: list[dict], timeout_s: float) -> list[tuple[dict, float]]:
        """Several control requests in turn on one connection, each reply with the seconds from its send
        (the first also pays for the connection; the later ones are what a kept connection costs, as a data
        hop's does). NodeError if any reply does not come within ``timeout_s`` of its send."""
        out = []
        sock = self.ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
        try:
            sock.connect(address)
            for message in messages:
                raw = encode_request(message)
                t0 = time.perf_counter()
                sock.send(raw)
                if not sock.poll(max(1, int(timeout_s * 1000))):
                    raise NodeError(address, f"no answer to {str(message.get('op'))[:32]!r} within {timeout_s:.0f} s")
                answer = sock.recv()
                out.append((decode_reply(answer, address), time.perf_counter() - t0))
        finally:
            sock.close(0)
        return out


def zeromq_transport(scheme: str) -> ZmqTransport:
    """This transport for any scheme ZeroMQ speaks (``tcp``, ``ipc``): what ``diffuse.wire.transport.zeromq_transport``
    hands a plugin that claims such a scheme."""
    return ZmqTransport(scheme)


@hookimpl
def diffuse_transport(scheme):
    if scheme == "tcp":
        return ZmqTransport("tcp")
    return None
