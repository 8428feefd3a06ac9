"""A node's table of sessions: who opened each, its sending end, and which ids were ever used.

Shared between the control thread (open, close, ping) and the compute thread
(the data path), so every access holds the table's lock. An outbox is only
ever used and closed by the compute thread: ``end`` hands it back for that.

A session lives on a lease: every data message renews it, and so does a ping
that proves it comes from the session's client (``ping_proof``: a MAC of the
session id under the key of the hop into this node, which only the client and
this node hold). A client pings its nodes while it waits, and in the background
while its session is open; a ping without the proof is answered but renews
nothing, so nobody else keeps a session alive. A session that heard neither for ``lease_s()`` seconds
belongs to a client that vanished, or to a node that was frozen: it is closed
and its buffers freed. A session that failed here (its next hop stopped taking
messages) is ended with its reason, which the next ping with its id is told.

A node at its cap of sessions makes room for a good open by ending the session
that has gone longest without authenticated data (``longest_idle``; pings do
not count): a place is kept by using it, not by holding it.
"""

from __future__ import annotations

import threading
import time
import hmac
from collections import OrderedDict

from diffuse.wire.tokens import curve_client, lease_s, ping_proof, token_admits

SESSION_IDLE_S = 900.0  # a session that carried no data for this long is closed, pinged or not
MAX_CLOSED = 4096  # closed session ids remembered, so none is opened twice


class SessionTable:
    def __init__(self):
        self.lock = threading.Lock()
        self.sessions: dict[bytes, object] = {}  # session id -> diffuse.node.stage.StageSession
        self.owners: dict[bytes, bytes] = {}  # session id -> public key of the client that opened it
        self.outboxes: dict[bytes, object] = {}  # session id -> its sending end toward its next hop
        self.closed: OrderedDict[bytes, str | None] = OrderedDict()  # recently ended ids -> why, if it failed
        self.requests: dict[bytes, str] = {}  # session id -> the request id its open carried (for the logs)
        self.clients: dict[bytes, bytes] = {}  # CURVE key of each session's sending end into this node -> session id
        self.lease_s = lease_s()
        self._checked = time.monotonic()  # the last ``idle`` check

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
            session.renewed = time.monotonic()
            hop = getattr(session, "in_hop", None)
            if hop is not None:
                self.clients[curve_client(hop.key)[0]] = sid

    def event(self, name: str, sid: bytes, **more) -> dict:
        """A log line's fields (``extra=``; ``diffuse.plan.logs``) for event ``name`` of session ``sid``: its
        short id and the request id its open carried, if any (so looked up before the session ends)."""
        with self.lock:
            rid = self.requests.get(sid)
        return {"event": name, "session": sid.hex()[:8], **({"request_id": rid} if rid else {}), **more}

    def owner(self, sid: bytes) -> bytes | None:
        with self.lock:
            return self.owners.get(sid)

    def outbox(self, sid: bytes):
        with self.lock:
            return self.outboxes.get(sid)

    def waiting(self) -> list[tuple[bytes, object]]:
        """(session id, outbox) of every outbox holding messages its next hop has not taken yet."""
        with self.lock:
            return [(sid, o) for sid, o in self.outboxes.items() if getattr(o, "waiting", None)]

    def ping(self, sid, proof=None) -> dict:
        """A ping's answer about session ``sid``: whether the node has it, the last sequence number a message
        of it carried here (``seen``), and why it ended if it failed here. With the session's ``ping_proof`` it
        also renews the session's lease (``renewed``: True)."""
        if not isinstance(sid, bytes):
            return {"session_known": None}
        with self.lock:
            s = self.sessions.get(sid)
            if s is None:
                why = self.closed.get(sid)
                return {"session_known": False, **({"failed": why} if why else {})}
            hop = getattr(s, "in_hop", None)
            renew = isinstance(proof, bytes) and hop is not None and hmac.compare_digest(proof, ping_proof(hop.key, sid))
            if renew:
                s.renewed = time.monotonic()
            return {"session_known": True, "seen": getattr(s, "last_seq", 0), "renewed": renew}

    def admits(self, user, password) -> bool:
        """Whether a connection to the data port presenting ``(user, password)`` belongs to an open session: the
        session's id and its ``data_token`` under the key of the hop into this node."""
        with self.lock:
            s = self.sessions.get(bytes(user))
        hop = getattr(s, "in_hop", None)
        return hop is not None and token_admits(hop.key, s.sid, user, password)

    def admits_key(self, client_public) -> bool:
        """Whether a CURVE connection to the data port under ``client_public`` is an open session's sending end
        (the key ``curve_client`` makes from the key of the hop into this node)."""
        with self.lock:
            return bytes(client_public) in self.clients

    def longest_idle(self) -> tuple[bytes, float] | None:
        """(id, seconds) of the session that has gone longest without authenticated data; None if none is open."""
        with self.lock:
            if not self.sessions:
                return None
            sid, s = min(self.sessions.items(), key=lambda item: item[1].last_used)
            return sid, time.monotonic() - s.last_used

    def end(self, sid: bytes, failed: str | None = None):
        """Forget the session (its id stays spent; ``failed``: why, told to the next ping);
        returns its outbox, for the compute thread to close."""
        with self.lock:
            self.sessions.pop(sid, None)
            self.owners.pop(sid, None)
            self.requests.pop(sid, None)
            for key in [k for k, v in self.clients.items() if v == sid]:
                del self.clients[key]
            self.closed[sid] = failed[:300] if failed else None
            while len(self.closed) > MAX_CLOSED:
                self.closed.popitem(last=False)
            return self.outboxes.pop(sid, None)

    def state_bytes(self) -> int:
        """Bytes of per-session state (language models' key/value caches) held for all sessions now."""
        with self.lock:
            sessions = list(self.sessions.values())
        return sum(s.kv.nbytes() for s in sessions if hasattr(s, "kv"))

    def buffer_bytes(self, but=None) -> int:
        """Bytes of slot caches and stale buffers held for all sessions (``but``: except this one)."""
        with self.lock:
            sessions = [s for s in self.sessions.values() if s is not but]
        return sum(getattr(s, "buffer_bytes", 0) for s in sessions)

    def idle(self, now: float | None = None) -> list[bytes]:
        """Sessions to close: no data for ``SESSION_IDLE_S``, or neither data nor pings for the lease.
        The lease runs only while the node serves: a time the serving loop was stopped (frozen, or
        busy loading blocks) is not held against the sessions, whose clients could not be heard."""
        now = time.monotonic() if now is None else now
        with self.lock:
            stalled, self._checked = now - self._checked, now
            if stalled > 2.0:
                for s in self.sessions.values():
                    s.renewed = getattr(s, "renewed", s.last_used) + stalled
            return [sid for sid, s in self.sessions.items()
                    if now - s.last_used > SESSION_IDLE_S
                    or now - max(s.last_used, getattr(s, "renewed", s.last_used)) > self.lease_s]
