"""A TCP relay that records every byte it carries, to look at what crosses the wire."""

from __future__ import annotations

import socket
import threading


class RecordingRelay:
    def __init__(self):
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.upstream: tuple[str, int] | None = None
        self.captured = bytearray()
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def start(self, upstream: str) -> None:
        host, port = upstream.split("://", 1)[1].rsplit(":", 1)
        self.upstream = (host, int(port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(self.upstream)
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                with self._lock:
                    self.captured += chunk
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()
