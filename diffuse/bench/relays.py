"""Relays on loopback that make a link slow: each holds what it carries for a one-way delay and sends it on no
faster than a rate (``Relay``); a client's inbox announced through one (``inbox_through``). Used by ``bench links``
and ``bench lm --link-ms``."""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time

CHUNK = 64 << 10


class Relay:
    """A TCP relay on loopback that holds what it carries ``delay_s`` each way and sends it on at no more than
    ``rate`` bytes per second (None: as fast as it comes). ``set`` changes both for new and open connections."""

    def __init__(self):
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.delay_s, self.rate = 0.0, None
        self.closed = False

    def set(self, delay_s: float, rate: float | None) -> None:
        self.delay_s, self.rate = delay_s, rate

    def start(self, upstream: str) -> "Relay":
        """Relay connections made from now on to ``upstream`` (accepting from the first call on)."""
        host, port = upstream.split("://", 1)[1].rsplit(":", 1)
        first = not hasattr(self, "upstream")
        self.upstream = (host, int(port))
        if first:
            threading.Thread(target=self._accept, daemon=True).start()
        return self

    def _accept(self) -> None:
        while not self.closed:
            try:
                down, _ = self.listener.accept()
                up = socket.create_connection(self.upstream)
            except OSError:
                if self.closed:
                    return
                continue
            for s in (down, up):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for a, b in ((down, up), (up, down)):
                q: queue.Queue = queue.Queue()
                threading.Thread(target=self._read, args=(a, q), daemon=True).start()
                threading.Thread(target=self._write, args=(b, q), daemon=True).start()

    def _read(self, src: socket.socket, q: queue.Queue) -> None:
        try:
            while chunk := src.recv(CHUNK):
                q.put((time.perf_counter(), chunk))
        except OSError:
            pass
        q.put((time.perf_counter(), b""))

    def _write(self, dst: socket.socket, q: queue.Queue) -> None:
        free_at = 0.0  # when the link has sent what it was given before
        try:
            while True:
                arrived, chunk = q.get()
                if not chunk:
                    break
                start = max(arrived, free_at)
                free_at = start + (len(chunk) / self.rate if self.rate else 0.0)
                wait = free_at + self.delay_s - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                dst.sendall(chunk)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.closed = True
        self.listener.close()


@contextlib.contextmanager
def inbox_through(relay: Relay):
    """The client's inbox, while inside: announced to the last node as ``relay``'s address, which relays to
    the inbox's own (the transport's ``inbox`` is wrapped for the time being)."""
    from diffuse.wire.transport import transport_for

    cls = type(transport_for("tcp://"))
    original = cls.inbox

    class Announced:
        def __init__(self, inbox):
            self._inbox, self.address = inbox, relay.address

        def __getattr__(self, name):
            return getattr(self._inbox, name)

    def inbox(self, bind, max_message_bytes=None, **admission):
        real = original(self, bind, max_message_bytes, **admission)
        relay.start(real.address)
        return Announced(real)

    cls.inbox = inbox
    try:
        yield
    finally:
        cls.inbox = original
