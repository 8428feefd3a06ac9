"""The ZeroMQ ring: REQ/REP control per node, PUSH/PULL data between stages.

Sockets only: what the bytes mean, and who may read them, is core's business
(``diffuse.frames``, ``diffuse.sealing``). A node is dialled at one address,
its control socket; the hello reply tells the data address (a second port, or
``<path>.data`` for a path scheme). Every wait is bounded: a silent peer
becomes a NodeError, never a hang.
"""

from __future__ import annotations

import collections
import contextlib
import os
import time

import cbor2
import zmq

from diffuse.errors import DiffuseError, NodeError, WireError
from diffuse.hookspecs import hookimpl


MAX_CONTROL_BYTES = 1 << 20  # a control request is a small map; a peer sending more is cut off


class ZmqEndpoint:
    def __init__(self, ctx: zmq.Context, listen: str, scheme: str):
        self.control = ctx.socket(zmq.REP)
        self.data = ctx.socket(zmq.PULL)
        for s in (self.control, self.data):
            s.setsockopt(zmq.LINGER, 0)
        self.control.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_BYTES)
        self._owe_reply = False  # REP: every request received must be answered before the next
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
        """One request. A WireError raised here comes after the request was taken off the
        socket: the caller must still answer it (with ``reply_control``)."""
        parts = self.control.recv_multipart()  # all of it: a REP socket must take a request whole
        self._owe_reply = True
        if len(parts) != 1:
            raise WireError(f"control request came in {len(parts)} parts; a request is one CBOR map")
        try:
            msg = cbor2.loads(parts[0])
        except Exception as exc:
            raise WireError(f"control request is not CBOR: {type(exc).__name__}") from exc
        if not isinstance(msg, dict):
            raise WireError("control request is not a map")
        return msg

    def reply_control(self, reply: dict) -> None:
        if not self._owe_reply:
            return  # nothing was received (the receive itself failed): there is nobody to answer
        try:
            raw = cbor2.dumps(reply)
        except Exception as exc:
            raw = cbor2.dumps({"ok": False, "error": f"the node could not encode its reply: {type(exc).__name__}"})
        self._owe_reply = False
        self.control.send(raw)

    def recv_data(self) -> list[bytes]:
        return self.data.recv_multipart(copy=True)

    def close(self) -> None:
        self.control.close(0)
        self.data.close(0)
        _unlink_paths(self.control_address, self.address)


def _unlink_paths(*addresses: str) -> None:
    """A path-scheme (ipc://) socket's file outlives its socket: remove it when the socket closes."""
    for scheme, _, path in (a.partition("://") for a in addresses):
        if scheme != "tcp":
            with contextlib.suppress(OSError):
                os.unlink(path)


class ZmqInbox:
    def __init__(self, ctx: zmq.Context, bind: str):
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(bind)
        self.address = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    def recv(self, timeout_s: float) -> list[bytes] | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return self.sock.recv_multipart(copy=True)

    def close(self) -> None:
        self.sock.close(0)
        _unlink_paths(self.address)


SEND_HWM = 8  # messages ZeroMQ queues toward one peer
MAX_WAITING = 8  # messages more an outbox keeps while its peer takes none; one more and the peer is given up
STUCK_S = 30.0  # a message still waiting this long: the peer is given up


class ZmqOutbox:
    """A sending end that never blocks: what the peer cannot take yet waits here, a few messages at most,
    and goes out on the next ``send`` or ``flush``. A peer that takes nothing while ``MAX_WAITING`` more
    pile up, or for ``STUCK_S``, is given up: NodeError naming it. One slow peer delays only the
    messages meant for it."""

    def __init__(self, ctx: zmq.Context, address: str):
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        self.sock.connect(address)
        self.address = address
        self.waiting: collections.deque = collections.deque()  # (since, frames)

    def send(self, frames: list[bytes]) -> None:
        self.flush()
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
    (``ipc://``) by returning ``ZmqTransport(scheme)``: this class is the built-in's public face."""

    def __init__(self, scheme: str = "tcp"):
        self.scheme = scheme
        self.ctx = zmq.Context.instance()

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

    def serve(self, listen: str) -> ZmqEndpoint:
        return ZmqEndpoint(self.ctx, listen, self.scheme)

    def inbox(self, bind: str) -> ZmqInbox:
        return ZmqInbox(self.ctx, bind)

    def outbox(self, address: str) -> ZmqOutbox:
        try:
            return ZmqOutbox(self.ctx, address)
        except zmq.ZMQError as exc:
            raise DiffuseError(f"cannot send to {address!r}: {exc}") from exc

    def request(self, address: str, message: dict, timeout_s: float) -> dict:
        sock = self.ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(address)
            sock.send(cbor2.dumps(message))
            if not sock.poll(int(timeout_s * 1000)):
                raise NodeError(address, f"no answer to {message.get('op')!r} within {timeout_s:.0f} s")
            raw = sock.recv()
        finally:
            sock.close(0)
        try:
            reply = cbor2.loads(raw)
        except Exception:
            reply = None
        if not isinstance(reply, dict):
            raise NodeError(address, "answered with something that is not a map")
        return reply


@hookimpl
def diffuse_transport(scheme):
    if scheme == "tcp":
        return ZmqTransport("tcp")
    return None
