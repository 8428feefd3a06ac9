"""One client's session on a node: its stage plan, what it remembers, and each pass from door to hand-on.

``StageSession`` holds a session's stage plan, hop keys, remembered call plans
and return maps, slot caches, and the per-session state of each kind of pass
(PipeFusion's stale buffers, the first-block cache's residuals, a language
model's key/value caches and sampler). A call is checked whole at the door
(``diffuse.wire.passes.Pass.from_wire``), then checked against what the session
remembers, and run by the kind its part names (``diffuse.wire.kinds``): the plain
loop, PipeFusion's stale stack, the first-block cache, or a language model's
layers with their tail. The blocks come from the node's ``BlockStore``
(``diffuse.node.blockstore``): a session keeps the blocks of its own compute dtype
from its open to its close, so another session asking for another dtype never
changes them under it.

What a session may keep is bounded: its slot caches (the client mirrors the
rule), its stale buffers, and all sessions' together on this node. A malformed
call is answered with one line; nothing a header holds is used before its
structure is checked.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace

import torch

import diffuse.firstblock.node  # noqa: F401  (registers the first-block cache's pass kind)
import diffuse.lm.node_layers  # noqa: F401  (registers a language model's pass kind)
import diffuse.pipefusion.node  # noqa: F401  (registers PipeFusion's pass kind)
from diffuse.node.blockstore import BlockStore
from diffuse.plan.calltree import encode_value
from diffuse.wire.slots import SLOT_CACHE_BYTES, SlotCache
from diffuse.errors import DiffuseError
from diffuse.firstblock.node import NodeResiduals
from diffuse.lm.node_cache import NodeCaches
from diffuse.lm.node_layers import embed_spec
from diffuse.wire.passes import WHOLE, Answer, Pass as Message, checked_tree
from diffuse.pipefusion.node import StaleStack
from diffuse.plan.contracts import ReturnMap, Slice
from diffuse.plan.messages import SlotRef, StagePlan
from diffuse.wire.kinds import kind_for

__all__ = ["NODE_BUFFER_BYTES", "STALE_BYTES", "BlockStore", "Prepared", "StageSession"]


def _env_bytes(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


STALE_BYTES = _env_bytes("DIFFUSE_STALE_BYTES", 16 << 30)  # one session's PipeFusion stale buffers, at most
NODE_BUFFER_BYTES = _env_bytes("DIFFUSE_NODE_BUFFER_BYTES", 32 << 30)  # all sessions' slot caches and stale buffers


@dataclass
class Prepared:
    """One call, checked and taken apart (``StageSession.prepare``): what running it through this node's layers
    needs, and what its outgoing message is made from. ``values`` holds the tensor slots, the stream slots
    replaced by each layer's output as it runs; ``part`` is the message's part as the next hop is to see it."""

    message: Message
    stack: str
    sl: Slice
    refs: list[SlotRef]
    values: list
    forward: dict
    rmap: ReturnMap
    tree: dict
    layer_trees: dict
    cache: object | None  # the session's key/value cache of this stack (a language model's pass), or None
    blocks: list[tuple[int, torch.nn.Module]]
    part: object = None  # the message's part (diffuse.wire.passes), once prepared
    tail_answer: dict | None = None  # its tail's answer, when run with a batch's others (diffuse.lm.node_layers)
    kept: list = field(default_factory=list)  # inner layers' outputs the pass brings back (LayerPass.keep)

    def __post_init__(self):
        if self.part is None:
            self.part = getattr(self.message, "part", WHOLE)




class StageSession:
    """One client's session on this node."""

    def __init__(self, sid: bytes, store: BlockStore, stage: StagePlan, in_hop, out_hop):
        self.sid = sid
        self.stage = stage
        self.stale: dict[str, StaleStack] = {}  # per stack, made by the first call that carries a patch
        self.hop_log: list[list[int]] = []  # [seq, bytes] of every message that arrived on this hop
        self.busy_s = 0.0  # CPU seconds spent preparing and running calls, for the benchmark's utilisation
        self.busy_log: list[list] = []  # [seq, seconds] of every call this node worked on, for the same
        self.parts_log: list[list] = []  # [seq, seconds...] where each call's time went (diffuse.node.server.PARTS)
        self.batched_passes = 0  # passes of this session that ran in a batch with other sessions' (diffuse.lm.node_batching)
        self.joint_tails = 0  # ... whose tail ran with theirs too (diffuse.lm.node_layers.joint_tails)
        self.store = store
        self.in_hop, self.out_hop = in_hop, out_hop
        self.trees: dict[str, dict] = {}
        self._checked: dict[str, tuple] = {}  # per stack, the remembered call plan last checked, and for how many slots
        self.rmaps: dict[str, ReturnMap] = {}
        self.slots = SlotCache(SLOT_CACHE_BYTES)  # (stack, slot) -> tensor; the client's mirror keeps the same
        self.kv = NodeCaches(store.subject.config_object)
        self.residuals = NodeResiduals()  # the first-block cache's (diffuse.firstblock)
        self.sampler = None  # a language model's draws on the last node (diffuse.lm.sampling), on first use
        self.last_used = time.monotonic()
        self.bytes_in = self.bytes_out = self.messages = 0
        self.last_seq = 0  # the highest sequence number a message of this session carried here
        self.buffer_bytes = 0  # slot caches and stale buffers held now
        self._stale_bytes = 0
        self.room: int | None = None  # what this session may hold now, all sessions' buffers on this node counted
        # this session's own blocks, in its own dtype, for its whole life
        self.dtype = getattr(torch, stage.dtype, None) if stage.dtype else None
        if not isinstance(self.dtype, torch.dtype):
            self.dtype = None
        self.blocks = {sl.stack: store.blocks_of(sl, self.dtype) for sl in stage.slices if not sl.empty}
        first = next((p for bl in self.blocks.values() for _, b in bl for p in b.parameters()  # (a packed
                      if p.is_floating_point()), None)  # 4-bit weight of bitsandbytes' is uint8: not the dtype)
        self.tail_dtype = first.dtype if first is not None else self.dtype

    def handle(self, header: dict, tensors: list[torch.Tensor]) -> tuple[dict, list[torch.Tensor]]:
        """Process one message; return the message for the next hop."""
        p = self.prepare(header, tensors)
        if not isinstance(p, Prepared):
            return p
        with torch.no_grad():
            out = self.run(p)
        return self.finish(p, out)

    def prepare(self, header: dict, tensors: list[torch.Tensor]) -> "Prepared | tuple[dict, list[torch.Tensor]]":
        """A message checked and taken apart, ready to run through this node's layers (``run``), or the message
        to pass on as it is (results and errors on their way to the client; a call for a slice this node holds
        none of)."""
        self.last_used = time.monotonic()
        seq = header.get("seq")
        if type(seq) is int and seq > self.last_seq:
            self.last_seq = seq
        if header.get("op") != "call":
            return header, tensors  # results and errors pass through to the client
        msg = Message.from_wire(header, len(tensors))
        stack, refs = msg.stack, list(msg.slots)
        if msg.slot_bytes is not None:  # the first call: what the client's mirror assumes this session may keep
            if msg.slot_bytes > SLOT_CACHE_BYTES:
                raise DiffuseError(f"the client asks to keep {msg.slot_bytes} bytes of tensors for its session; this "
                                   f"node keeps {SLOT_CACHE_BYTES >> 20} MiB at most (DIFFUSE_SLOT_CACHE_BYTES)")
            self.slots.max_bytes = msg.slot_bytes
        sl = self.stage.slice_of(stack)
        if sl is None:
            raise DiffuseError(f"this session gave the node no slice of stack {stack[:64]!r}")
        if msg.tree is not None:
            self.trees[stack] = msg.tree
        if msg.rmap is not None:
            self.rmaps[stack] = msg.rmap
        if stack not in self.trees or stack not in self.rmaps:
            raise DiffuseError(f"first call into {stack!r} arrived without its call plan")
        rmap = self.rmaps[stack]
        if any(i >= len(refs) for i in rmap.streams):
            raise DiffuseError("the return map threads slots this call does not have")
        tree = self.trees[stack]
        if self._checked.get(stack) != (tree, len(refs)):  # remembered from an earlier call: against this one's slots
            checked_tree(tree, "call plan", len(refs))
            self._checked[stack] = (tree, len(refs))
        kind = kind_for(msg.part)
        kind.check(self, msg, rmap)
        values, forward = self._resolve(stack, refs, tensors)
        if sl.empty:
            return header, tensors
        p = Prepared(msg, stack, sl, refs, values, forward, rmap, self.trees[stack], {}, None, self.blocks[stack])
        carried = getattr(msg.part, "kept", 0)  # earlier nodes' kept outputs: the message's last frames
        p.kept = list(tensors[len(tensors) - carried:]) if carried else []
        kind.prepare(self, p)
        return p

    def run(self, p: Prepared):
        """The call through this node's layers, by the kind of its part: the last layer's output; ``p.values``
        then holds the stream slots' new values."""
        return kind_for(p.part).run(self, p)

    def finish(self, p: Prepared, out) -> tuple[dict, list[torch.Tensor]]:
        """The message a run makes: the answer for the client (on the stack's last node), or the call handed on
        to the next node."""
        if p.sl.stop == self.store.stacks[p.stack].length:
            out, skipped = kind_for(p.part).answer(self, p, out)
            tree, out_tensors = encode_value(out)
            return Answer(p.stack, p.message.seq, tree, skipped).to_wire(), out_tensors
        # hand on: stream slots carry this node's output; new cached tensors travel on once
        streams = set(p.rmap.streams)
        slots, sent = [], []
        for i, ref in enumerate(p.refs):
            if i in streams:
                slots.append(SlotRef(frame=len(sent)))
                sent.append(p.values[i])
            elif not ref.held:
                slots.append(SlotRef(frame=len(sent), digest=ref.digest))
                sent.append(p.forward[i])
            else:
                slots.append(ref)
        if p.kept:  # inner layers' outputs, earlier nodes' and this one's, ride on behind
            sent += p.kept
            p.part = replace(p.part, kept=len(p.kept))
        return p.message.handed_on(slots, p.part).to_wire(), sent

    _embed_spec = staticmethod(embed_spec)  # (slot, dtype) of a pass's token ids, checked (diffuse.lm.node_layers)

    def report(self) -> dict:
        """What the session did, for the client's summary (sent at close, before the buffers go)."""
        return {"bytes_in": self.bytes_in, "bytes_out": self.bytes_out, "messages": self.messages,
                "cache_bytes": self.kv.nbytes(), "batched_passes": self.batched_passes,
                "joint_tails": self.joint_tails, "hop_bytes": self.hop_log, "busy_s": self.busy_s, "busy_log": self.busy_log,
                "parts_log": self.parts_log,
                "stale": {k: v.report() for k, v in self.stale.items()},
                "first_block_cache": self.residuals.report()}

    def count_buffers(self, stale_changed: bool = False) -> None:
        """Recount what this session keeps; past its own bounds or the node's, the call fails (the client
        hears why, and its session is no use any more: its mirror no longer matches)."""
        if stale_changed:  # PipeFusion's stale buffers and the first-block cache's residuals: one bound
            self._stale_bytes = sum(v.report()["buffer_bytes"] for v in self.stale.values()) + self.residuals.nbytes
        stale = self._stale_bytes
        self.buffer_bytes = self.slots.nbytes + stale
        if stale > STALE_BYTES:
            what = "cached residuals" if not self.stale else "stale buffers"
            raise DiffuseError(f"this session's {what} hold {stale >> 20} MiB, more than the "
                               f"{STALE_BYTES >> 20} MiB a session may keep on this node (DIFFUSE_STALE_BYTES)")
        if self.room is not None and self.buffer_bytes > self.room:
            held, self.slots = self.buffer_bytes, SlotCache(self.slots.max_bytes)  # what it kept goes
            self.buffer_bytes = self._stale_bytes
            raise DiffuseError(f"this node keeps {NODE_BUFFER_BYTES >> 20} MiB of tensors for all its sessions at "
                               f"most and has no room for this one's {held / 2**20:.1f} MiB: try again "
                               "when other sessions end (DIFFUSE_NODE_BUFFER_BYTES)")

    def _resolve(self, stack: str, refs: list[SlotRef], tensors: list) -> tuple[list, dict]:
        cache = self.slots
        values, forward = [], {}
        for i, ref in enumerate(refs):
            if ref.held:
                t = cache.get((stack, i), ref.digest)
                if t is None:
                    raise DiffuseError(f"slot {i} of {stack!r} refers to a tensor this node no longer holds")
            else:
                t = tensors[ref.frame]
                forward[i] = t
                if ref.digest is not None:
                    cache.put((stack, i), ref.digest, t, t.numel() * t.element_size())
            values.append(t)
        self.count_buffers()
        return values, forward
