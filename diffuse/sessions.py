"""A node's table of sessions: who opened each, its sending end, and which ids were ever used.

Shared between the control thread (open, close, ping) and the compute thread
(the data path), so every access holds the table's lock. An outbox is only
ever used and closed by the compute thread: ``end`` hands it back for that.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

SESSION_IDLE_S = 900.0  # a session nobody has used for this long is closed and its buffers freed
MAX_CLOSED = 4096  # closed session ids remembered, so none is opened twice


class SessionTable:
    def __init__(self):
        self.lock = threading.Lock()
        self.sessions: dict[bytes, object] = {}  # session id -> diffuse.stage.StageSession
        self.owners: dict[bytes, bytes] = {}  # session id -> public key of the client that opened it
        self.outboxes: dict[bytes, object] = {}  # session id -> its sending end toward its next hop
        self.closed: OrderedDict[bytes, None] = OrderedDict()  # recently ended session ids

    def __len__(self) -> int:
        return len(self.sessions)

    def get(self, sid) -> object | None:
        with self.lock:
            return self.sessions.get(sid) if isinstance(sid, bytes) else None

    def used(self, sid: bytes) -> bool:
        with self.lock:
            return sid in self.sessions or sid in self.closed

    def add(self, sid: bytes, session, owner: bytes, outbox) -> None:
        with self.lock:
            self.sessions[sid] = session
            self.owners[sid] = owner
            self.outboxes[sid] = outbox

    def owner(self, sid: bytes) -> bytes | None:
        with self.lock:
            return self.owners.get(sid)

    def outbox(self, sid: bytes):
        with self.lock:
            return self.outboxes.get(sid)

    def end(self, sid: bytes):
        """Forget the session (its id stays spent); returns its outbox, for the compute thread to close."""
        with self.lock:
            self.sessions.pop(sid, None)
            self.owners.pop(sid, None)
            self.closed[sid] = None
            while len(self.closed) > MAX_CLOSED:
                self.closed.popitem(last=False)
            return self.outboxes.pop(sid, None)

    def state_bytes(self) -> int:
        """Bytes of per-session state (language models' key/value caches) held for all sessions now."""
        with self.lock:
            sessions = list(self.sessions.values())
        return sum(s.kv.nbytes() for s in sessions if hasattr(s, "kv"))

    def idle(self, now: float | None = None) -> list[bytes]:
        now = time.monotonic() if now is None else now
        with self.lock:
            return [sid for sid, s in self.sessions.items() if now - s.last_used > SESSION_IDLE_S]
