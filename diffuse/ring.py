"""One session through a ring of nodes, from the client's side.

The client sends into the first node and receives from the last; nodes hand
activations to each other. ``Handshake`` opens and closes the session on every
node; ``Channel`` carries the passes. Every wait is bounded, and a node that
dies or freezes while the client waits is named within seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diffuse.callplan import flatten, flatten_layers
from diffuse.channel import Channel, ChannelStats
from diffuse.handshake import Handshake
from diffuse.plan import Patch, ReturnMap, SlicingPlan


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
    def __init__(self, plan: SlicingPlan, timeout_s: float = 300.0, attention: str = "auto",
                 client_key: str | None = None):
        """``client_key``: a file holding this client's long-term identity (created 0600 if missing),
        for nodes that serve only some clients (``--allow-client``); None: a fresh identity per session."""
        self.plan = plan
        self.timeout_s = timeout_s
        self.handshake = Handshake(plan, client_key, attention)
        self.identity = self.handshake.identity
        self.channel: Channel | None = None
        self.channel_stats = ChannelStats()  # the open channel's, kept after close
        self.node_reports: list[dict] = []

    @property
    def uncut(self) -> set[str]:
        """Stacks the nodes say must run uncut steps (their blocks carry two streams)."""
        return self.handshake.uncut

    @property
    def scheme(self) -> str:
        return self.handshake.transports[0].scheme

    def open(self) -> None:
        t = self.handshake.transports[0]
        inbox = t.inbox(t.inbox_address(self.plan.route[0].address))
        try:
            self.plan, send_hop, recv_hop, first = self.handshake.open(inbox.address)
            outbox = t.outbox(first)
        except BaseException:
            inbox.close()
            raise
        self.channel = Channel(outbox, inbox, send_hop, recv_hop, self.timeout_s, self.handshake.probe)
        self.channel_stats = self.channel.stats

    def call(self, stack: str, args: tuple, kwargs: dict, rmap: ReturnMap):
        """One pass of ``stack`` through the ring; returns what its last block returns."""
        tree, tensors = flatten(args, kwargs)
        return self.receive(self.send(stack, tree, tensors, rmap))

    def call_layers(self, stack: str, calls: list[tuple[tuple, dict]], rmap: ReturnMap, cache, fresh: bool,
                    tail: dict | None = None):
        """One pass of a language model's ``stack``: every layer's own call (``calls``, in order) in one
        message; ``cache`` is the client's cache object, ``fresh`` whether the nodes start theirs anew;
        ``tail``: the last node also runs the final norm and output head (``diffuse.tail``)."""
        tree, layer_trees, tensors = flatten_layers(calls)
        extra = {"state": {"kind": type(cache).__name__, "fresh": bool(fresh)}}
        if tail is not None:
            extra["tail"] = tail
        if layer_trees:
            extra["layer_trees"] = layer_trees
        return self.receive(self.channel.send(stack, tree, tensors, rmap, extra=extra))

    def send(self, stack: str, tree: dict, tensors: list, rmap: ReturnMap, patch: Patch | None = None,
             digests: list | None = None) -> int:
        return self.channel.send(stack, tree, tensors, rmap, patch, digests)

    def receive(self, seq: int):
        return self.channel.receive(seq)

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
