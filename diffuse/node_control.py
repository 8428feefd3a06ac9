"""A node's control server: hello, ping, status (plain); open and close (sealed).

``hello`` gives the node's key, data address, model hash, the slices it holds
(``--blocks``) and a one-time challenge. ``ping`` says whether the node is
alive and still has a session; it is answered while blocks compute, so a
client notices a dead or frozen node in seconds. ``open`` and ``close`` are
sealed to the node's key, carry their own ``op`` inside the seal, and are
answered sealed to the sender with ``re`` naming the operation. An open must
carry an unspent, unexpired challenge and a session id the node has never
seen; the session then belongs to the key that opened it, and only that key
may close it.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict

import torch

from diffuse import frames, safecbor, sealing
from diffuse.errors import DiffuseError
from diffuse.plan import SESSION_ID_BYTES, WIRE_VERSION, ContractError, StagePlan

log = logging.getLogger("diffuse.node")

CHALLENGE_TTL_S = 300.0  # an open must come this soon after the hello that gave its challenge
MAX_CHALLENGES = 1024  # outstanding hello challenges kept (oldest dropped first)


def refusal(text: str) -> dict:
    return {"ok": False, "error": text}


class NodeControl:
    def __init__(self, node):
        self.node = node  # diffuse.node.Node: its store, identity, sessions, data address
        self.challenges: OrderedDict[bytes, float] = OrderedDict()  # one-time hello challenge -> expiry

    def handle(self, msg: dict) -> dict:
        op = msg.get("op")
        if not isinstance(op, str):
            return refusal("a control request needs an op (a string)")
        if op == "hello":
            return self.hello(msg)
        if op == "ping":
            sid = msg.get("session")
            known = self.node.sessions.get(sid) is not None if isinstance(sid, bytes) else None
            return {"ok": True, "session_known": known}
        if op == "status":
            return self.status()
        if op in ("open", "close"):
            return self.sealed(op, msg)
        return refusal(f"unknown control operation {op[:32]!r}")

    def status(self) -> dict:
        """Anyone may ask, so it is constant time (counters kept as sessions come and go, nothing walked)
        and says only totals: no session's id, owner, errors or contents."""
        node = self.node
        return {"ok": True, "sessions": len(node.sessions), "outboxes": len(node.sessions.outboxes),
                "state_bytes": node.state_bytes.total, "slices": self._slices(),
                "max_sessions": node.max_sessions, "max_sessions_per_client": node.max_sessions_per_client}

    def _session_room(self, sender: bytes) -> str | None:
        """Why a new session of ``sender`` would be one too many (None: there is room). Caps per client key
        and in total keep one client's flood of opens from taking the sockets every other client needs."""
        node = self.node
        with node.sessions.lock:
            total = len(node.sessions.sessions)
            mine = sum(1 for owner in node.sessions.owners.values() if owner == sender)
        if mine >= node.max_sessions_per_client:
            return (f"this node already holds {mine} sessions for your client key, its limit per client: "
                    "close one first")
        if total >= node.max_sessions:
            return f"this node holds {total} sessions, its limit: try again later or use another node"
        return None

    def _slices(self):
        fixed = self.node.store.fixed
        return [s.to_dict() for s in fixed] if fixed is not None else None

    def hello(self, msg: dict) -> dict:
        offered = msg.get("wire")
        if not isinstance(offered, list) or WIRE_VERSION not in offered[:16]:
            shown = [v for v in offered[:8] if isinstance(v, int)] if isinstance(offered, list) else "nothing"
            return refusal(f"this node speaks wire version {WIRE_VERSION}; the client offers {shown}")
        return {"ok": True, "wire": WIRE_VERSION, "key": self.node.identity.public, "data": self.node.data_address,
                "model": self.node.store.model_hash, "slices": self._slices(), "challenge": self._new_challenge()}

    def sealed(self, op: str, msg: dict) -> dict:
        payload, sender = sealing.open_control(msg, self.node.identity, safecbor.CONTROL)
        # from here on the sender is known: every answer is sealed to it, so it can tell ours from a forgery
        try:
            if payload.get("op") != op:  # else a sealed open could be replayed as a close, or the reverse
                reply = refusal(f"the sealed payload is not for {op!r}")
            elif self.node.allowed is not None and sender not in self.node.allowed:
                reply = refusal("this node does not serve your client key")
            elif op == "open" and (full := self._session_room(sender)):
                reply = refusal(full)
            else:
                reply = self.open(payload, sender) if op == "open" else self.close(payload, sender)
        except DiffuseError as exc:
            log.warning("%s refused: %s", op, exc)
            reply = refusal(str(exc))
        except Exception as exc:
            log.exception("%s failed", op)
            reply = refusal(f"{type(exc).__name__}: {exc}")
        reply["re"] = op
        return sealing.seal_control(reply, sender, self.node.identity)

    def _new_challenge(self) -> bytes:
        now = time.monotonic()
        while self.challenges and next(iter(self.challenges.values())) < now:
            self.challenges.popitem(last=False)
        challenge = os.urandom(16)
        self.challenges[challenge] = now + CHALLENGE_TTL_S
        while len(self.challenges) > MAX_CHALLENGES:
            self.challenges.popitem(last=False)
        return challenge

    def _take_challenge(self, challenge) -> bool:
        if not isinstance(challenge, bytes):
            return False
        expiry = self.challenges.pop(challenge, None)
        return expiry is not None and expiry >= time.monotonic()

    def open(self, p: dict, sender: bytes) -> dict:
        node = self.node
        # the challenge goes first, whatever happens next: a captured open replayed later finds it spent
        if not self._take_challenge(p.get("challenge")):
            return refusal("stale or replayed open: its hello challenge is unknown, spent or expired "
                           "(ask hello for a fresh one right before opening)")
        sid = p.get("session")
        if not isinstance(sid, bytes) or len(sid) != SESSION_ID_BYTES:
            return refusal(f"the session id must be {SESSION_ID_BYTES} bytes")
        if node.sessions.used(sid):
            return refusal("this session id is already in use on this node, or was: open with a fresh one")
        for name in ("in_key", "out_key"):
            if not isinstance(p.get(name), bytes) or len(p[name]) != 32:
                return refusal(f"{name} must be a 32-byte key")
        try:
            stage = StagePlan.from_dict(p.get("stage"), {s.path: s.length for s in node.stacks})
        except ContractError as exc:
            return refusal(str(exc))
        if stage.model_hash != node.store.model_hash:
            return refusal("this node serves a different model (content hash differs): "
                           "start it with the same model folder as the client")
        dtype = getattr(torch, stage.dtype, None) if stage.dtype else None
        if stage.dtype and not isinstance(dtype, torch.dtype):
            return refusal(f"unknown compute dtype {stage.dtype[:32]!r}")
        if node.store.fixed is not None:
            missing = [str(s) for s in stage.slices if not s.empty and not node.store.covers(s)]
            if missing:
                held = ", ".join(str(s) for s in node.store.fixed)
                return refusal(f"asked for blocks {', '.join(missing)}, but this node holds only {held}")
        node.store.load(list(stage.slices), dtype)
        outbox = node.transport.outbox(stage.next)  # this session's own: closed with it
        from diffuse.stage import StageSession

        node.sessions.add(sid, StageSession(sid, node.store, stage, frames.Hop(sid, p["in_key"]),
                                            frames.Hop(sid, p["out_key"])), sender, outbox)
        log.info("session %s opened: %s -> %s", sid.hex()[:8], ", ".join(map(str, stage.slices)), stage.next)
        # blocks that carry two streams (image and text side by side) cannot be cut into patches
        return {"ok": True, "uncut": sorted(s.stack for s in stage.slices if node.two_stream.get(s.stack))}

    def close(self, p: dict, sender: bytes) -> dict:
        sid = p.get("session")
        sess = self.node.sessions.get(sid)
        if sess is None:
            return refusal("unknown session")
        if self.node.sessions.owner(sid) != sender:
            return refusal("this session was opened by another client key: only its opener may close it")
        self.node.end(sid)
        log.info("session %s closed", sess.sid.hex()[:8])
        # what it did, and (to its owner only) every real parameter alive in this process
        return dict(sess.report(), ok=True, params=self.node.store.held_parameters())
