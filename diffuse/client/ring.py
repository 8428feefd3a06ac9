"""One session through a ring of nodes, from the client's side.

The client sends into the first node and receives from the last; nodes hand
activations to each other. ``Handshake`` opens and closes the session on every
node; ``Channel`` carries the passes. Every wait is bounded, and a node that
dies or freezes while the client waits is named within seconds.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field

from diffuse.plan.calltree import flatten, flatten_layers
from diffuse.client.channel import Channel, ChannelStats
from diffuse.client.handshake import Handshake
from diffuse.errors import DiffuseError, NodeError, Repaired
from diffuse.wire.passes import Embed, LayerPass, Part, Tail
from diffuse.plan.contracts import ReturnMap, SlicingPlan
from diffuse.plan.messages import Patch
from diffuse.client.repair import RepairPolicy
from diffuse.client.replay import Replay
from diffuse.wire import admission
from diffuse.wire.sealing import load_identity
from diffuse.wire.tokens import token_admits

log = logging.getLogger("diffuse.client.ring")


@dataclass
class NodeStats:
    address: str
    messages: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    busy_s: float = 0.0  # seconds the node spent running blocks for this session


@dataclass
class RingStats:
    """What one session cost: passes through the ring, bytes on the client's wire, and per node."""

    passes: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    nodes: list[NodeStats] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"{self.passes} passes, {self.bytes_sent / 1024:.1f} KiB sent, "
                 f"{self.bytes_received / 1024:.1f} KiB received"]
        lines += [f"  {n.address}: {n.messages} messages, {n.bytes_in / 1024:.1f} KiB in, "
                  f"{n.bytes_out / 1024:.1f} KiB out, busy {n.busy_s:.2f} s" for n in self.nodes]
        return "\n".join(lines)


class Ring:
    """One session through a ring of nodes; when a node fails, the session moves to a repaired route.

    Passes go out through ``send`` and come back through ``receive`` (or ``call``/``call_layers``,
    which do both). Every pass sent and not yet answered is kept, and so is a language model's
    history since its cache was last started anew: when a node dies, freezes or answers with an error,
    the ring closes the session, opens a new one on a route without that node (another holder of its
    range), replays the history to rebuild the caches, resends what was in flight, and says so in one
    line. Its ``RepairPolicy`` (``diffuse.client.repair``) says how: by default the failed node is avoided for
    its backoff, then used again. Without a usable holder, or once one pass has been repaired as many times as there
    are listed nodes, the error goes to the caller."""

    def __init__(self, plan: SlicingPlan, timeout_s: float = 300.0, attention: str = "auto",
                 client_key: str | None = None, say=None, repair: RepairPolicy | None = None, identity=None,
                 request_id: str | None = None):
        """``client_key``: a file holding this client's long-term identity (created 0600 if missing),
        for nodes that serve only some clients (``--allow-client``); None: a fresh identity per session.
        ``say``: where the one-line account of each repair goes (default: standard error). ``repair``:
        how a failed node is replaced (default: ``RepairPolicy()``). ``identity``: the client identity to open
        sessions with (``diffuse.wire.sealing.Identity``; local nodes serve only the run's own), in place of
        ``client_key``'s. ``request_id``: the request this ring serves, told to each node at the open and said in
        the client's log lines of it (``diffuse.plan.logs``)."""
        self.plan = plan
        self.request_id = request_id
        self.candidates = plan.route  # every listed node; the route uses one holder per range
        self.timeout_s = timeout_s
        self.attention, self.client_key = attention, client_key
        self.repair = repair if repair is not None else RepairPolicy()
        self.handshake = Handshake(plan, client_key, attention, self.repair.heard, request_id)
        if identity is not None:
            self.handshake.identity = identity
        self.identity = self.handshake.identity
        self.channel: Channel | None = None
        self.channel_stats = ChannelStats()  # over every session of this ring, kept after close
        self.node_reports: list[dict] = []
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.repairs: list[str] = []  # one line per repair
        self._held: list = []  # per candidate: the slices its hello named (None: loads what it is asked)
        self._answered: list[bool] = []  # per candidate: it answered the survey's hello
        self._streak = 0  # repairs since a pass was last answered
        self._n = 0  # this ring's own pass numbers (a repaired route starts a new channel)
        self._pending: dict[int, tuple] = {}  # pass number -> (channel seq, what was sent), until answered
        self._lost: set[int] = set()  # passes a repair dropped (patches): asking for one raises Repaired
        self._history = Replay()  # a language model's passes since its cache was last started anew

    @property
    def uncut(self) -> set[str]:
        """Stacks the nodes say must run uncut steps (their blocks carry two streams)."""
        return self.handshake.uncut

    @property
    def scheme(self) -> str:
        return self.handshake.transports[0].scheme

    def open(self) -> None:
        self._survey()
        self._open(self._route(fallback=True))

    def _route(self, fallback: bool = False) -> SlicingPlan:
        """A route through nodes that answered the survey and are not being avoided now; with ``fallback``,
        through any that answered if the others alone make none (a node that failed a moment ago is left
        out only while the others can do without it)."""
        usable = [ok and not self.repair.avoided(c.address) for ok, c in zip(self._answered, self.candidates)]
        try:
            return self.repair.choose(self.plan, self.candidates, self._held, usable)
        except DiffuseError:
            if not fallback or usable == self._answered:
                raise
        return self.repair.choose(self.plan, self.candidates, self._held, self._answered)

    def _survey(self) -> None:
        """Ask every listed node what it holds; one that does not answer is left out if the others can
        still make a route, and otherwise named."""
        if len(self.candidates) == 1:
            self._held, self._answered = [None], [True]
            return
        everyone = Handshake(self.plan.with_route(self.candidates), self.client_key, self.attention, self.repair.heard)
        everyone.fetch_wait_s, everyone.say = self.timeout_s, self.say  # a node still fetching: waited for
        self._held, self._answered, errors = [], [], []
        for k in range(len(self.candidates)):
            try:
                self._held.append(everyone.hello(k).get("slices"))
                self._answered.append(True)
            except NodeError as exc:
                self._held.append(None)
                self._answered.append(False)
                errors.append(exc)
        if errors:
            try:
                self._route(fallback=True)
            except DiffuseError as why:  # the one that did not answer is named, and what is missing without it
                raise NodeError(errors[0].address, f"{errors[0].message}, so {why} (a node "
                                "that does not answer hello is dead, frozen or unreachable)") from None
            for exc in errors:
                self.say(f"{exc}: routing around it")

    def _open(self, plan: SlicingPlan) -> None:
        self.handshake = Handshake(plan, self.client_key, self.attention, self.repair.heard, self.request_id)
        self.handshake.identity = self.identity
        self.handshake.fetch_wait_s, self.handshake.say = self.timeout_s, self.say  # a node still fetching: waited for
        if self.repair.decoder is not None:  # the VAE, loaded by the node named, whatever its --blocks
            self.handshake.as_routed = frozenset(self.repair.decoder.stacks)
        t = self.handshake.transports[0]
        hs, home = self.handshake, load_identity(None)  # home: the inbox's CURVE server key, this session's own
        # the inbox admits the ring's last node only, by the key of the hop home (made when the session opens)
        inbox = t.inbox(t.inbox_address(plan.route[0].address), **admission.receiving(
            t, home, lambda key: admission.admits_hop(hs.hop_keys[-1] if hs.hop_keys else None, key),
            lambda user, password: token_admits(hs.hop_keys[-1] if hs.hop_keys else None, hs.sid, user, password)))
        try:
            self.plan, send_hop, recv_hop, first = self.handshake.open(inbox.address, home.public)
            outbox = t.outbox(first, **admission.sending(t, hs.sid, send_hop.key, hs.keys[0], first))
        except BaseException:
            inbox.close()
            raise
        self.channel = Channel(outbox, inbox, send_hop, recv_hop, self.timeout_s, self.handshake.probe)
        self.channel.stats = self.channel_stats
        for stage in self.plan.route:  # serving again: a later failure starts its wait afresh
            self.repair.served(stage.address)

    def call(self, stack: str, args: tuple, kwargs: dict, rmap: ReturnMap):
        """One pass of ``stack`` through the ring; returns what its last block returns."""
        tree, tensors = flatten(args, kwargs)
        return self.receive(self.send(stack, tree, tensors, rmap))

    def old_nodes(self, version: int) -> list[str]:
        """The nodes of the route that chose a wire version older than ``version`` at hello (each "ADDRESS (N)")."""
        chosen = self.handshake.wire
        return [f"{s.address} ({chosen[s.address]})" for s in self.plan.route if chosen.get(s.address, version) < version]

    def call_layers(self, stack: str, calls: list[tuple[tuple, dict]], rmap: ReturnMap, cache, fresh: bool,
                    tail: Tail | None = None, embed: Embed | None = None, edits: tuple = (False, ())):
        """One pass of a language model's ``stack``: every layer's own call (``calls``, in order) in one
        message; ``cache`` is the client's cache object, ``fresh`` whether the nodes start theirs anew;
        ``tail``: the last node also runs the final norm and output head (``diffuse.lm.heads``); ``embed``: the
        first layer's input slot holds token ids, which the first node embeds (``diffuse.lm.embedding``);
        ``edits``: (record, crops), as the nodes edit their caches first, as the client's was
        (``diffuse.lm.client_cache``)."""
        tree, layer_trees, tensors = flatten_layers(calls)
        extra = LayerPass(type(cache).__name__, bool(fresh), layer_trees or None, tail, embed, bool(edits[0]),
                          tuple(edits[1]))
        if fresh:
            self._history.clear()
        return self.receive(self.send(stack, tree, tensors, rmap, extra=extra))

    def send(self, stack: str, tree: dict, tensors: list, rmap: ReturnMap, patch: Patch | None = None,
             digests: list | None = None, extra: Part | None = None) -> int:
        sent = (stack, tree, tensors, rmap, patch, digests, extra)
        self._n += 1
        self._pending[self._n] = (self.channel.send(*sent), sent)
        return self._n

    def receive(self, n: int):
        if n in self._lost:
            self._lost.discard(n)
            raise Repaired(f"pass {n} was dropped when the route was repaired")
        while True:
            seq, sent = self._pending[n]
            try:
                out = self.channel.receive(seq)
            except NodeError as exc:
                self._repair(exc)  # raises when it cannot; else everything in flight was sent again
                continue
            del self._pending[n]
            self._streak = 0
            if isinstance(sent[6], LayerPass) and sent[6].kind is not None:  # it built a cache: kept for replay
                self._history.append(sent)
            return out

    # -- repair ---------------------------------------------------------------------------------------
    def _position(self, exc: NodeError) -> int | None:
        for k, stage in enumerate(self.plan.route):
            if stage.address == exc.address:
                return k
        return None

    def _repair(self, exc: NodeError) -> None:
        """Move the session off the node ``exc`` names, or raise ``exc`` when no other route is left."""
        k = self._position(exc)
        if k is None or not self.repair.replay or self._streak >= len(self.candidates):
            raise exc  # not a node of the route, no repairs wanted, or this pass failed on every node in turn
        self._streak += 1
        failed = self.plan.route[k].address
        wait = self.repair.failed(failed)
        try:
            route = self._route()
        except DiffuseError:
            raise exc from None  # no other holder: the failure is the answer
        old, self.channel, old_sid = self.channel, None, self.handshake.sid.hex()[:8]
        try:
            self.handshake.close(0.3)  # the survivors free the old session now; the failed one cannot answer
        finally:
            old.close()
        while True:
            try:
                self._open(route)
                break
            except NodeError as again:  # the spare is down too: the next one, while there is one
                if again.address not in {c.address for c in self.candidates}:
                    raise
                self.repair.failed(again.address)
                try:
                    route = self._route()
                except DiffuseError:
                    raise exc from None
        cut = any(s[4] is not None and not s[4].uncut for _, s in self._pending.values())
        line = self._describe(exc, wait)
        self.repairs.append(line)
        log.info("session %s repaired around %s", old_sid, failed, extra={
            "event": "repaired", "session": old_sid, "new_session": self.handshake.sid.hex()[:8], "node": failed,
            "failed": str(exc)[:300], **({"request_id": self.request_id} if self.request_id else {})})
        self.say(line)
        self.repair.repaired()
        if cut:  # patches of a step cannot be replayed on nodes without that step's stale buffers
            self._lost |= set(self._pending)
            self._pending.clear()
            raise Repaired(line)
        try:
            for sent in self._history:  # rebuild the new nodes' caches exactly as they were built
                self.channel.receive(self.channel.send(*sent))
            self._pending = {n: (self.channel.send(*sent), sent) for n, (_, sent) in sorted(self._pending.items())}
        except NodeError as again:  # another node failed while this one was replaced
            self._repair(again)

    def _describe(self, exc: NodeError, wait: float) -> str:
        now = ", ".join(f"{s.address} ({', '.join(map(str, s.slices))})" for s in self.plan.route)
        replayed = f"; replayed {len(self._history)} earlier passes" if self._history else ""
        return (f"repaired the route after {exc} (avoided for {wait:.0f} s): now {now}; "
                f"resent {len(self._pending)} pass{'es' if len(self._pending) != 1 else ''} in flight{replayed}")

    def close(self, hurry: bool = False, tell_nodes: bool = True) -> None:
        """Close the session on every node (``hurry``: on the way out of a failure or an interrupt, barely
        waiting; ``tell_nodes`` False: only this end, for nodes that are being stopped anyway)."""
        if self.channel is None and not self.handshake.opened:
            return
        if tell_nodes:
            self.node_reports = self.handshake.close(0.3 if hurry else 5.0)
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    @property
    def stats(self) -> RingStats:
        c = self.channel_stats
        nodes = [NodeStats(s.address, **{k: r.get(k, 0) for k in ("messages", "bytes_in", "bytes_out", "busy_s")})
                 for s, r in zip(self.plan.route, self.node_reports or [{}] * len(self.plan.route))]
        return RingStats(c.passes, c.bytes_sent, c.bytes_received, nodes)
