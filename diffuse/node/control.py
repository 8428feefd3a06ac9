"""A node's control server: hello, ping, status (plain); open and close (sealed).

``hello`` gives the node's key, data address, model hash, the slices it holds
(``--blocks``), the wire versions it speaks and the one it chose (the highest
the client also offers), a one-time challenge, and its report for placement
(``diffuse.plan.reports.node_report``: memory available to it, blocks it holds,
threads, CPUs, device, dtype, measured speed); at wire version 2 also a
fresh X25519 key for the open's key agreement (``sealing.agree``). While a
node started with ``--blocks`` fetches its slice, hello and status carry
``fetch`` (bytes done and in all, rate, seconds left, what and which file:
``Progress.state``) and opens are refused, saying how far it got. ``ping``
says whether the node is alive and still has a session; it is answered while
blocks compute, so a client notices a dead or frozen node in seconds. ``link``
(sealed, from any key) is answered with the count of padding bytes it carried,
sealed: a link measurement (``diffuse.wire.links``). An open that names the next
node's control address and key (``next_control``, ``next_key``) has the node
measure that link too, and say it in its reply; one that names ``next_server``
has the session's sending end hold its next data port to that CURVE key
(``diffuse.wire.admission``). ``open``
and ``close`` are sealed to the node's key, carry their own ``op`` inside the
seal, and are answered sealed to the sender with ``re`` naming the operation
and the request's session id and challenge echoed, so a reply cannot be moved
to another request. An open must carry an unspent, unexpired challenge and a
session id the node has never seen; the session then belongs to the key that
opened it, and only that key may close it.

Challenges keep no state per hello, so no flood of hellos can push out another
client's challenge. A challenge is its period number, 12 random bytes and a MAC
of both under that period's secret (``Challenges``); the node keeps the secrets
of the current and the previous period only (``CHALLENGE_PERIOD_S`` each), so a
challenge is good for one to two periods, and it checks an open's challenge by
its MAC, not by looking it up. What is kept is the set of challenges spent by
accepted opens, per period (dropped with the period's secret; capped at
``MAX_SPENT`` opens per period, beyond which opens wait for the next period
rather than replays being let through). The node's fresh key of a wire-2 open
is made from the period's secret and the challenge, so it too costs nothing to
keep between hello and open; nothing holds it after the open, and once its
period's secret is dropped (at most two periods after the hello) no one can
make it again: a recorded session then cannot be opened with the node's
long-term key.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import struct
import time

import torch

from diffuse.wire import frames
from diffuse.wire import safecbor
from diffuse.wire import sealing
from diffuse.errors import DiffuseError
from diffuse.plan.reports import node_report
from diffuse.plan.contracts import SESSION_ID_BYTES, WIRE_VERSIONS, ContractError
from diffuse.plan.messages import StagePlan
from diffuse.plan.contracts import is_int
from diffuse.plan.logs import clean_request_id
from diffuse.plan.fetchprogress import fetch_text

log = logging.getLogger("diffuse.node")

CHALLENGE_PERIOD_S = 150.0  # a challenge is good until the end of the period after the one it was made in
CHALLENGE_BYTES = 8 + 12 + 16  # period number, random, MAC
MAX_SPENT = 1 << 16  # opens accepted per period (their challenges are kept, spent, until the period's secret goes)
STALE = ("stale or replayed open: its hello challenge is unknown, spent or expired "
         "(ask hello for a fresh one right before opening)")


def refusal(text: str) -> dict:
    return {"ok": False, "error": text}


def _versions(x) -> list[int]:
    """The wire versions a peer says it speaks (what is not a small list of integers speaks nothing)."""
    return sorted({v for v in x[:16] if is_int(v)}) if isinstance(x, list) else []


class Challenges:
    """Hello challenges checked by their MAC, not kept (see the module's docstring)."""

    def __init__(self, period_s: float = CHALLENGE_PERIOD_S, max_spent: int = MAX_SPENT):
        self.period_s, self.max_spent = period_s, max_spent
        self.periods: dict[int, tuple[bytes, set[bytes]]] = {}  # period -> (its secret, challenges spent in it)

    def _now(self) -> int:
        now = int(time.monotonic() // self.period_s)
        for old in [p for p in self.periods if p < now - 1]:
            del self.periods[old]  # its secret, its spent set, and every fresh key made from it, gone
        if now not in self.periods:
            self.periods[now] = (os.urandom(32), set())
        return now

    @staticmethod
    def _mac(secret: bytes, body: bytes) -> bytes:
        return hashlib.blake2b(b"challenge" + body, key=secret, digest_size=16).digest()

    def issue(self) -> bytes:
        period = self._now()
        body = struct.pack(">Q", period) + os.urandom(12)
        return body + self._mac(self.periods[period][0], body)

    def _held(self, challenge) -> tuple[bytes, set[bytes]] | None:
        """The secret and spent set of a challenge this node made and has not expired; None otherwise."""
        self._now()
        if not isinstance(challenge, bytes) or len(challenge) != CHALLENGE_BYTES:
            return None
        held = self.periods.get(struct.unpack(">Q", challenge[:8])[0])
        if held is None or not hmac.compare_digest(challenge[20:], self._mac(held[0], challenge[:20])):
            return None
        return held

    def ephemeral(self, challenge: bytes) -> sealing.Identity | None:
        """The node's fresh key for the open that carries ``challenge`` (the same at hello and at open)."""
        held = self._held(challenge)
        if held is None:
            return None
        return sealing.ephemeral(hashlib.blake2b(b"ephemeral" + challenge, key=held[0], digest_size=32).digest())

    def take(self, challenge) -> str | None:
        """Spend ``challenge``; why it cannot be, or None."""
        held = self._held(challenge)
        if held is None or challenge in held[1]:
            return STALE
        if len(held[1]) >= self.max_spent:
            return (f"this node has accepted {self.max_spent} opens in the last {self.period_s:.0f} s: "
                    "try again in a few minutes")
        held[1].add(challenge)
        return None


class NodeControl:
    def __init__(self, node, speaks: tuple[int, ...] = WIRE_VERSIONS):
        self.node = node  # diffuse.node.server.Node: its store, identity, sessions, data address
        self.speaks = speaks  # the wire versions this node speaks (``--wire``)
        self.challenges = Challenges()
        self.asked: dict = {}  # the log fields of the sealed request being answered (its op, session, request id)

    def handle(self, msg: dict) -> dict:
        self.asked = {}  # a sealed request fills it in once opened
        op = msg.get("op")
        if not isinstance(op, str):
            return self.no("request", "a control request needs an op (a string)")
        if op == "hello":
            return self.hello(msg)
        if op == "ping":  # renews the session's lease; says how far its passes got, or why it failed here
            return {"ok": True, **self.node.sessions.ping(msg.get("session"), msg.get("proof"))}
        if op == "status":
            return self.status()
        if op in ("open", "close", "link"):
            return self.sealed(op, msg)
        return self.no("request", f"unknown control operation {op[:32]!r}")

    def no(self, reason: str, text: str) -> dict:
        """A refusal, counted by its reason (``diffuse.node.metrics.REFUSALS``) and logged with it."""
        self.node.tally.refused(reason)
        log.log(logging.WARNING if reason == "error" else logging.INFO, "refused (%s): %s", reason, text[:300],
                extra={"event": "refused", "reason": reason, **self.asked})
        return refusal(text)

    def status(self) -> dict:
        """Anyone may ask, so it is constant time (counters kept as sessions come and go, nothing walked but
        once a second for ``about``: key, device, memory, links) and says only totals: no session's id, owner,
        errors or contents."""
        node = self.node
        return {"ok": True, "sessions": len(node.sessions), "outboxes": len(node.sessions.outboxes),
                "refused_connections": node.refused_connections,
                "state_bytes": node.state_bytes.total, "slices": self._slices(),
                "max_sessions": node.max_sessions, "max_sessions_per_client": node.max_sessions_per_client,
                "batching": node.batching, "batches": node.batches, "batched_rows": node.batched_rows,
                "batch_fallbacks": node.batch_fallbacks, "quantize": node.store.compute.quant or "none",
                "totals": node.tally.report(node), **({"metrics": node.metrics_url} if node.metrics_url else {}),
                "about": node.tally.looks(node, time.monotonic()), **self._fetch()}

    def _fetch(self) -> dict:
        """While ``--blocks`` fetches the slice: {"fetch": where it stands} (``Progress.state``); else nothing."""
        progress = getattr(self.node, "fetching", None)
        return {"fetch": progress.state()} if progress is not None else {}

    def _session_room(self, sender: bytes) -> str | None:
        """Why a new session of ``sender`` would be one too many (None: there is room, or there will be). The
        cap per client key keeps one key's flood of opens from taking every place; the cap in all is kept by
        ``_make_room`` once the open is found good, so a full node never locks a newcomer out."""
        node = self.node
        with node.sessions.lock:
            mine = sum(1 for owner in node.sessions.owners.values() if owner == sender)
        if mine >= node.max_sessions_per_client:
            return (f"this node already holds {mine} sessions for your client key, its limit per client: "
                    "close one first")
        return None

    def _make_room(self) -> None:
        """At the cap in all, end the session that has gone longest without authenticated data (pings keep a
        lease, not a place: they prove a client is alive, not that it uses the node), so that the newcomer
        gets its place. Keys cost nothing, so a party holding every place under many keys would otherwise
        lock out everyone else; now it keeps a place only by using it. The session ended is told why at its
        client's next ping."""
        node = self.node
        while len(node.sessions) >= node.max_sessions:
            found = node.sessions.longest_idle()
            if found is None:
                return
            sid, idle_s = found
            why = (f"evicted: this node was full ({node.max_sessions} sessions) and this session had carried no "
                   f"data for the longest ({idle_s:.0f} s)")
            fields = node.sessions.event("session_evicted", sid, reason="full")
            node.end(sid, failed=why)
            node.tally.evicted("full")
            log.info("session %s %s", sid.hex()[:8], why, extra=fields)

    def _slices(self):
        fixed = self.node.store.fixed
        return [s.to_dict() for s in fixed] if fixed is not None else None

    def hello(self, msg: dict) -> dict:
        offered, speaks = _versions(msg.get("wire")), list(self.speaks)
        common = set(offered) & set(speaks)
        if not common:  # the client names both sides to its user; an older client shows this error
            return dict(self.no("wire", f"this node speaks wire versions {speaks}; the client offers {offered[:8]}"),
                        speaks=speaks)
        wire, challenge = max(common), self.challenges.issue()
        reply = {"ok": True, "wire": wire, "speaks": speaks, "key": self.node.identity.public,
                 "data": self.node.data_address, "model": self.node.store.model_hash, "slices": self._slices(),
                 "challenge": challenge, "report": node_report(self.node), **self._fetch()}
        if wire >= 2:
            reply["eph"] = self.challenges.ephemeral(challenge).public
        if getattr(self.node.store, "compiled", False):
            reply["compiled"] = True  # --compile: the client says its results are not exact
        if self.node.store.compute.quant:
            reply["quantize"] = self.node.store.compute.quant  # --quantize: placement counts its blocks so
        return reply

    def sealed(self, op: str, msg: dict) -> dict:
        payload, sender = sealing.open_control(msg, self.node.identity, safecbor.CONTROL)
        # from here on the sender is known: every answer is sealed to it, so it can tell ours from a forgery
        sid, rid = payload.get("session"), clean_request_id(payload.get("request_id"))
        self.asked = {"op": op, **({"session": sid.hex()[:8]} if isinstance(sid, bytes) else {}),
                      **({"request_id": rid} if rid else {})}
        try:
            if payload.get("op") != op:  # else a sealed open could be replayed as a close, or the reverse
                reply = self.no("request", f"the sealed payload is not for {op!r}")
            elif op == "link":  # a link measurement (diffuse.wire.links), from a client or a node before this one
                pad = payload.get("pad")
                reply = {"ok": True, "n": len(pad) if isinstance(pad, bytes) else 0}
            elif self.node.allowed is not None and sender not in self.node.allowed:
                reply = self.no("client_key", "this node does not serve your client key")
            elif op == "open" and (full := self._session_room(sender)):
                reply = self.no("client_limit", full)
            elif op == "open" and (fetch := self._fetch()):
                reply = self.no("fetching", f"still fetching its slice: {fetch_text(fetch['fetch'])}: open once "
                                "its hello no longer says fetch")
            else:
                reply = self.open(payload, sender) if op == "open" else self.close(payload, sender)
        except DiffuseError as exc:
            reply = self.no("error", str(exc))
        except Exception as exc:
            log.exception("%s failed", op)
            reply = self.no("error", f"{type(exc).__name__}: {exc}")
        reply["re"] = op
        for name in ("session", "challenge"):  # the reply answers this request, and no other
            if isinstance(payload.get(name), bytes):
                reply[name] = payload[name]
        return sealing.seal_control(reply, sender, self.node.identity)

    def open(self, p: dict, sender: bytes) -> dict:
        node = self.node
        wire, speaks = p.get("wire", 1), list(self.speaks)  # an open without "wire" comes from a version-1 client
        if not is_int(wire) or wire not in speaks:
            return self.no("wire", f"the open uses wire version {str(wire)[:16]}; this node speaks {speaks}")
        common = set(_versions(p.get("offered"))) & set(speaks)
        if common and max(common) != wire:
            return self.no("wire", f"the open uses wire version {wire}, but this node and the client both speak "
                           f"{max(common)}: refusing a downgrade (was the hello altered on the way?)")
        # the challenge goes first, whatever happens next: a captured open replayed later finds it spent
        challenge = p.get("challenge")
        stale = self.challenges.take(challenge)
        if stale:
            return self.no("replay", stale)
        sid = p.get("session")
        if not isinstance(sid, bytes) or len(sid) != SESSION_ID_BYTES:
            return self.no("request", f"the session id must be {SESSION_ID_BYTES} bytes")
        if node.sessions.used(sid):
            return self.no("replay", "this session id is already in use on this node, or was: open with a fresh one")
        keys = p if wire == 1 else self._agreed_keys(p, sender, sid, challenge)
        for name in ("in_key", "out_key"):
            if not isinstance(keys.get(name), bytes) or len(keys[name]) != 32:
                return self.no("request", f"{name} must be a 32-byte key")
        try:
            stage = StagePlan.from_dict(p.get("stage"), {s.path: s.length for s in node.stacks})
        except ContractError as exc:
            return self.no("request", str(exc))
        if stage.wire_in not in speaks or stage.wire_out not in speaks:
            return self.no("wire", f"asked for wire versions {stage.wire_in} in, {stage.wire_out} out; "
                           f"this node speaks {speaks}")
        if stage.model_commit and node.store.model_commit and stage.model_commit != node.store.model_commit:
            return self.no("model", f"this node holds {node.store.model_repo} at commit {node.store.model_commit[:12]}, the "
                           f"client runs commit {stage.model_commit[:12]}: start both with "
                           f"{node.store.model_repo}@{stage.model_commit}")
        held = node.store.compute.quant
        if stage.quantize != held:
            return self.no("model", f"this node holds its blocks {'quantized ' + held if held else 'unquantized'}, the client "
                           f"asks {'for ' + stage.quantize[:16] if stage.quantize else 'for them unquantized'}: start the "
                           f"node with --quantize {stage.quantize[:16] or 'none'}, or the client with --quantize "
                           f"{held or 'none'}")
        if stage.model_hash != node.store.model_hash:
            return self.no("model", "this node serves a different model (content hash differs): "
                           "start it with the same model folder as the client, and the same --encoders and --decoder")
        dtype = getattr(torch, stage.dtype, None) if stage.dtype else None
        if stage.dtype and not isinstance(dtype, torch.dtype):
            return self.no("request", f"unknown compute dtype {stage.dtype[:32]!r}")
        if node.store.fixed is not None:
            missing = [str(s) for s in stage.slices if not s.empty and not node.store.covers(s)
                       and s.stack not in node.store.subject.decoders]  # a VAE: loaded when a client names it
            if missing:
                held = ", ".join(str(s) for s in node.store.fixed)
                return self.no("model", f"asked for blocks {', '.join(missing)}, but this node holds only {held}")
        from diffuse.plan.hubmodel import check_slice_room

        check_slice_room(node.store.subject, node.stacks, stage.slices)  # a Hub model's: room for all it lacks, first
        node.store.load(list(stage.slices), dtype)
        self._make_room()  # the open is good: a full node ends its longest-idle session for it
        # this session's own sending end, closed with it; it proves the session to the next hop's transport, whose
        # CURVE server key the client named (``next_server``, inside the seal)
        from diffuse.wire.admission import sending

        outbox = node.transport.outbox(stage.next, **sending(node.transport, sid, keys["out_key"],
                                                             p.get("next_server"), stage.next))
        from diffuse.node.stage import StageSession

        node.sessions.add(sid, StageSession(sid, node.store, stage, frames.Hop(sid, keys["in_key"], wire=stage.wire_in),
                                            frames.Hop(sid, keys["out_key"], wire=stage.wire_out)), sender, outbox)
        rid = clean_request_id(p.get("request_id"))  # an open may name its request (an older client's does not)
        if rid:
            with node.sessions.lock:
                node.sessions.requests[sid] = rid
        node.tally.opened += 1
        link = node.next_hops.measure(node.transport, p.get("next_control"), p.get("next_key"), node.identity)
        log.info("session %s opened (wire %d; hops in %d, out %d): %s -> %s%s", sid.hex()[:8], wire, stage.wire_in,
                 stage.wire_out, ", ".join(map(str, stage.slices)), stage.next, f" (request {rid})" if rid else "",
                 extra=node.sessions.event("session_opened", sid, wire=wire, slices=[str(s) for s in stage.slices]))
        # blocks that carry two streams (image and text side by side) cannot be cut into patches
        return {"ok": True, "uncut": sorted(s.stack for s in stage.slices if node.two_stream.get(s.stack)),
                "link": link.to_dict() if link is not None else None}

    def _agreed_keys(self, p: dict, sender: bytes, sid: bytes, challenge: bytes) -> dict:
        """A wire-2 open's hop keys, opened under the key agreed with the client (``sealing.agree``)."""
        eph, sealed = p.get("eph"), p.get("keys")
        if not (isinstance(eph, bytes) and len(eph) == sealing.PUBLIC_BYTES and isinstance(sealed, bytes)):
            raise DiffuseError("a wire-2 open needs the client's fresh key (eph, 32 bytes) and its sealed keys")
        own = self.challenges.ephemeral(challenge)  # made again from the challenge; dropped on return
        if own is None:  # its period ended between the spending and now
            raise DiffuseError(STALE)
        key = sealing.agree("node", self.node.identity, own, sender, eph,
                            sealing.open_transcript(sender, eph, self.node.identity.public, own.public, sid, challenge))
        return sealing.open_with(key, sealed, sid + challenge)

    def close(self, p: dict, sender: bytes) -> dict:
        sid = p.get("session")
        sess = self.node.sessions.get(sid)
        if sess is None:
            return self.no("request", "unknown session")
        if self.node.sessions.owner(sid) != sender:
            return self.no("client_key", "this session was opened by another client key: only its opener may close it")
        fields = self.node.sessions.event("session_closed", sid)
        self.node.end(sid)
        log.info("session %s closed%s", sess.sid.hex()[:8],
                 f" (request {fields['request_id']})" if "request_id" in fields else "", extra=fields)
        # what it did, and (to its owner only) every real parameter alive in this process
        return dict(sess.report(), ok=True, params=self.node.store.held_parameters())
