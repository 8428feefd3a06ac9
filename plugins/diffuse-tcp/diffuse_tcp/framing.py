"""How a message travels on a ``tcpstream://`` connection, for ``diffuse_tcp.streams``: addresses, the
framing, and the hub that serves a listening side's connections without blocking.

A message (a list of frames) travels on a stream as::

    message := count (u32) part * count
    part    := length (u64) bytes * length          (big-endian)

Only ``diffuse.wire.transport`` and the standard library are used.
"""

from __future__ import annotations

import collections
import selectors
import socket
import struct

from diffuse.wire.transport import MAX_REPLY_BYTES, DiffuseError

SCHEME = "tcpstream"
COUNT = struct.Struct(">I")
LENGTH = struct.Struct(">Q")
MAX_CONNECTIONS = 1024  # per endpoint or inbox (its ports together); one more is closed at once
READ_BYTES = 1 << 20  # read from a connection at once


def split_address(address: str) -> tuple[str, int]:
    """(host, port) of ``tcpstream://HOST:PORT``; DiffuseError otherwise.

    >>> split_address("tcpstream://127.0.0.1:7000"), split_address("tcpstream://[::1]:0")
    (('127.0.0.1', 7000), ('::1', 0))
    """
    scheme, sep, rest = address.partition("://")
    host, colon, port = rest.rpartition(":")
    if scheme != SCHEME or not sep or not colon or not host or not port.isdigit():
        raise DiffuseError(f"{address!r} is not a {SCHEME}:// address (write it as {SCHEME}://HOST:PORT)")
    return host.strip("[]"), int(port)


def join_address(host: str, port: int) -> str:
    return f"{SCHEME}://[{host}]:{port}" if ":" in host else f"{SCHEME}://{host}:{port}"


def encode(frames: list[bytes]) -> bytes:
    """One message as the bytes of the stream.

    >>> encode([b"ab", b""])
    b'\\x00\\x00\\x00\\x02\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x02ab\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x00'
    """
    pieces = [COUNT.pack(len(frames))]
    for f in frames:
        pieces += [LENGTH.pack(len(f)), f]
    return b"".join(pieces)


class Cut(Exception):
    """The peer broke the framing or a cap: its connection is closed."""


class Reader:
    """Whole messages out of one connection's bytes as they arrive. A part longer than ``cap`` or a count of
    parts outside [1, ``max_parts``] raises Cut as soon as its header is read, before its bytes are kept.

    >>> r = Reader(cap=4, max_parts=2)
    >>> raw = encode([b"ab", b"cd"])
    >>> r.feed(raw[:7]), r.feed(raw[7:])
    ([], [[b'ab', b'cd']])
    >>> r.feed(encode([b"abcde"]))
    Traceback (most recent call last):
    ...
    diffuse_tcp.framing.Cut: a part of 5 bytes is over the 4-byte cap
    """

    def __init__(self, cap: int, max_parts: int):
        self.cap, self.max_parts = cap, max_parts
        self.buf = bytearray()
        self.count: int | None = None  # parts of the message being read
        self.length: int | None = None  # bytes of the part being read
        self.parts: list[bytes] = []

    def feed(self, data: bytes) -> list[list[bytes]]:
        self.buf += data
        done = []
        while True:
            if self.count is None:
                if len(self.buf) < COUNT.size:
                    return done
                (self.count,) = COUNT.unpack_from(self.buf)
                del self.buf[:COUNT.size]
                if not 1 <= self.count <= self.max_parts:
                    raise Cut(f"a message of {self.count} parts (1 to {self.max_parts} allowed)")
            if self.length is None:
                if len(self.buf) < LENGTH.size:
                    return done
                (self.length,) = LENGTH.unpack_from(self.buf)
                del self.buf[:LENGTH.size]
                if self.length > self.cap:
                    raise Cut(f"a part of {self.length} bytes is over the {self.cap}-byte cap")
            if len(self.buf) < self.length:
                return done
            with memoryview(self.buf) as view:
                self.parts.append(bytes(view[:self.length]))
            del self.buf[:self.length]
            self.length = None
            if len(self.parts) == self.count:
                done.append(self.parts)
                self.parts, self.count = [], None


class Connection:
    """One accepted connection: what it sent so far, and the answers it still has to be sent."""

    def __init__(self, sock: socket.socket, kind: str, reader: Reader):
        self.sock, self.kind, self.reader = sock, kind, reader
        self.out = bytearray()
        self.open = True


class Hub:
    """Listening ports and the connections they accepted, served without blocking from one thread: each
    ``poll`` accepts, reads and writes what it can, and whole messages wait in ``ready[kind]`` as
    (connection, frames)."""

    def __init__(self):
        self.sel = selectors.DefaultSelector()
        self.ready: dict[str, collections.deque] = {}
        self.listeners: list[socket.socket] = []
        self.conns: set[Connection] = set()

    def listen(self, kind: str, host: str, port: int, cap: int, max_parts: int) -> int:
        """Listen for ``kind`` on (host, port); the port bound."""
        try:
            sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                        backlog=128)
        except OSError as exc:
            raise DiffuseError(f"cannot listen at {join_address(host, port)}: {exc}") from exc
        sock.setblocking(False)
        self.sel.register(sock, selectors.EVENT_READ, (kind, cap, max_parts))
        self.listeners.append(sock)
        self.ready[kind] = collections.deque()
        return sock.getsockname()[1]

    def poll(self, timeout_s: float) -> None:
        for key, events in self.sel.select(max(0.0, timeout_s)):
            if isinstance(key.data, Connection):  # each step skips a connection an earlier one dropped
                if events & selectors.EVENT_WRITE and key.data.open:
                    self._write(key.data)
                if events & selectors.EVENT_READ and key.data.open:
                    self._read(key.data)
            else:
                self._accept(key.fileobj, *key.data)

    def _accept(self, listener: socket.socket, kind: str, cap: int, max_parts: int) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, or the peer left already: the others are still served
                return
            if len(self.conns) >= MAX_CONNECTIONS:
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Connection(sock, kind, Reader(cap, max_parts))
            self.conns.add(conn)
            self.sel.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: Connection) -> None:
        try:
            data = conn.sock.recv(READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            return self.drop(conn)
        try:
            messages = conn.reader.feed(data)
        except Cut:
            return self.drop(conn)
        self.ready[conn.kind].extend((conn, m) for m in messages)

    def send(self, conn: Connection, frames: list[bytes]) -> None:
        """Queue a message to an accepted connection (an answer) and write what the socket takes now. A peer
        that leaves more than a reply's worth of answers unread is dropped: it loses its own answers only."""
        if not conn.open:
            return
        conn.out += encode(frames)
        if len(conn.out) > MAX_REPLY_BYTES + 64:
            return self.drop(conn)
        self._write(conn)

    def _write(self, conn: Connection) -> None:
        try:
            sent = conn.sock.send(conn.out) if conn.out else 0
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            return self.drop(conn)
        del conn.out[:sent]
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
        if self.sel.get_key(conn.sock).events != events:
            self.sel.modify(conn.sock, events, conn)

    def drop(self, conn: Connection) -> None:
        if conn.open:
            conn.open = False
            self.conns.discard(conn)
            self.sel.unregister(conn.sock)
            conn.sock.close()

    def close(self) -> None:
        for conn in list(self.conns):
            self.drop(conn)
        for sock in self.listeners:
            self.sel.unregister(sock)
            sock.close()
        self.listeners.clear()
        self.sel.close()
