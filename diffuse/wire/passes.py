"""The per-pass contract between client and node: a ``Pass`` asks, an ``Answer`` replies.

A ``Pass`` is what one message on the ring asks of the nodes: the stack it
calls, its sequence number, where each tensor slot comes from (``SlotRef``),
the call plan and return map when they are new to the nodes, and exactly one
*part* that says which kind of pass it is:

- ``Whole``: a plain call, every block of the stack run in order;
- ``Patch`` (``diffuse.plan.messages``): a PipeFusion patch, run against stale buffers;
- ``Reuse``: a whole step tagged for the first-block cache (``diffuse.firstblock``);
- ``LayerPass``: a language model's pass, its cache kind and freshness, each
  layer's own call plan where it differs, and optionally the token ids' slot
  for the first node to embed (``Embed``) and the last node's tail (``Tail``:
  final norm, rows, head, candidates, and the sampling state ``DrawState``).

Every type here is a frozen dataclass with ``to_wire``/``from_wire``; what a
peer sends is checked by ``from_wire``, which raises ``ContractError`` naming
the field, before any of it is used. ``Pass.from_wire`` is the one validator at
a node's door. The wire shape is the one every node version speaks (a CBOR map;
see ``docs/architecture.md``):

>>> p = Pass(stack="blocks", seq=3, slots=(SlotRef(frame=0),), part=Reuse(0.1, branch=1, fresh=False))
>>> w = p.to_wire()
>>> w["reuse"], w["slots"]
({'t': 0.1, 'branch': 1, 'fresh': False}, [['f', 0]])
>>> Pass.from_wire(w, frames=1) == p
True
>>> Pass.from_wire(dict(w, seq="3"), frames=1)
Traceback (most recent call last):
...
diffuse.plan.contracts.ContractError: a call must carry an integer seq
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Union

from diffuse.plan.contracts import ContractError, ReturnMap, is_int, _short
from diffuse.plan.messages import Patch, SlotRef
from diffuse.wire.trees import MAX_TREE_NODES, checked_tree

MAX_CROPS = 64  # cache crops one pass carries (one per draft verified since the last pass)
MAX_CROP = 1 << 20  # positions one crop removes
MAX_KEEP = 1024  # inner layers whose outputs one pass brings back

__all__ = ["Answer", "ContractError", "DrawState", "Embed", "LayerPass", "Pass", "Part", "Patch", "Reuse", "Tail",
           "WHOLE", "Whole", "checked_tree"]

# --------------------------------------------------------------------------- parts


@dataclass(frozen=True)
class Whole:
    """A plain call: every block of the stack, in order."""

    def to_wire(self) -> dict:
        return {}


WHOLE = Whole()


@dataclass(frozen=True)
class Reuse:
    """A whole step tagged for the first-block cache: its threshold, its guidance branch, whether the nodes
    must compute in full (``fresh``); ``skip``: the decision of the node holding block 0, for the hops after it."""

    threshold: float
    branch: int
    fresh: bool
    skip: bool | None = None

    def to_wire(self) -> dict:
        w: dict = {"reuse": {"t": self.threshold, "branch": self.branch, "fresh": self.fresh}}
        if self.skip is not None:
            w["skip"] = self.skip
        return w

    @classmethod
    def from_wire(cls, x: Any, skip: Any = None) -> "Reuse":
        if not isinstance(x, dict) or set(x) != {"t", "branch", "fresh"}:
            raise ContractError("malformed reuse: a map of t, branch and fresh")
        t, b, fresh = x["t"], x["branch"], x["fresh"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0 \
                or not is_int(b) or not 0 <= b < 1 << 16 or not isinstance(fresh, bool):
            raise ContractError("malformed reuse: t a number >= 0, branch a small integer, fresh true or false")
        if skip is not None and not isinstance(skip, bool):
            raise ContractError("malformed skip: true or false")
        return cls(float(t), b, fresh, skip)


@dataclass(frozen=True)
class DrawState:
    """What the last node lacks to apply ``generate``'s processors and draw (``diffuse.lm.sampling``): the
    processors (when changed), the token history (``keep`` columns it holds, rows ``add``ed), the generator
    state (when changed). Deeper checks (processor names, history shape) are ``diffuse.lm.sampling``'s."""

    sample: bool
    history: dict
    processors: list | None = None
    rng: bytes | None = None

    def to_wire(self) -> dict:
        w: dict = {"sample": self.sample}
        if self.processors is not None:
            w["processors"] = self.processors
        w["history"] = self.history
        if self.rng is not None:
            w["rng"] = self.rng
        return w

    @classmethod
    def from_wire(cls, x: Any) -> "DrawState":
        if not isinstance(x, dict) or not isinstance(x.get("sample"), bool) \
                or not set(x) <= {"sample", "processors", "history", "rng"}:
            raise ContractError("malformed draw")
        if not isinstance(x.get("history"), dict):
            raise ContractError("malformed token history")
        if "processors" in x and not isinstance(x["processors"], list):
            raise ContractError("malformed draw: processors must be a list")
        if "rng" in x and not isinstance(x["rng"], bytes):
            raise ContractError("malformed generator state")
        return cls(x["sample"], x["history"], x.get("processors"), x.get("rng"))


@dataclass(frozen=True)
class Tail:
    """The last node also runs the final norm (``norm``: its path, or None) and the output head on rows
    [start, stop) and answers the ``top`` candidates per row (0: whole rows); ``draw``: and draws there."""

    norm: str | None
    rows: tuple[int, int]
    top: int
    draw: DrawState | None = None

    def to_wire(self) -> dict:
        w: dict = {"norm": self.norm, "rows": list(self.rows), "top": self.top}
        if self.draw is not None:
            w["draw"] = self.draw.to_wire()
        return w

    @classmethod
    def from_wire(cls, x: Any) -> "Tail":
        if not isinstance(x, dict) or not {"rows", "top"} <= set(x) <= {"norm", "rows", "top", "draw"} \
                or not isinstance(x["rows"], list) or len(x["rows"]) != 2 or not all(is_int(r) for r in x["rows"]) \
                or not is_int(x["top"]) or not (x.get("norm") is None or isinstance(x["norm"], str)):
            raise ContractError("malformed tail")
        draw = DrawState.from_wire(x["draw"]) if x.get("draw") is not None else None
        return cls(x.get("norm"), tuple(x["rows"]), x["top"], draw)


@dataclass(frozen=True)
class Embed:
    """The first layer's input slot ``slot`` holds token ids; the node holding the first layer embeds them
    into ``dtype`` (a torch float dtype's name)."""

    slot: int
    dtype: str

    def to_wire(self) -> dict:
        return {"slot": self.slot, "dtype": self.dtype}

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    @classmethod
    def from_wire(cls, x: Any, slots: int) -> "Embed":
        import torch

        if not isinstance(x, dict) or not is_int(x.get("slot")) or not isinstance(x.get("dtype"), str):
            raise ContractError("malformed embed: a map of slot (an integer) and dtype (a name)")
        if not 0 <= x["slot"] < slots:
            raise ContractError("embed names a slot that does not carry the stack's hidden state")
        dtype = getattr(torch, x["dtype"][:32], None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ContractError(f"embed asks for dtype {x['dtype'][:32]!r}, which is not a float dtype")
        return cls(x["slot"], x["dtype"][:32])


@dataclass(frozen=True)
class LayerPass:
    """A language model's pass: the class of the key/value cache the layers are called with (``kind``) and
    whether the nodes start theirs anew (``fresh``); each layer's call plan where it differs from the first
    layer's (by global layer index); ``embed`` and ``tail`` as above. Before the layers run, each node edits
    its cache as the client's own was edited since the last pass (drafts verified: ``diffuse.lm.client_cache``):
    ``record`` keeps past positions a sliding window would drop, then each of ``crops`` removes that many.
    ``keep``: the layers (global indices, ascending) whose outputs the pass brings back too, for a model that
    reads an inner layer's hidden state (``diffuse.client.encoders``); the first ``kept`` of them travel as the
    message's last tensor frames, each node adding its own as it hands the pass on."""

    kind: str | None = None  # None: the layers are called without a cache
    fresh: bool = False
    layer_trees: dict | None = None
    tail: Tail | None = None
    embed: Embed | None = None
    record: bool = False
    crops: tuple[int, ...] = ()
    keep: tuple[int, ...] = ()
    kept: int = 0

    def to_wire(self) -> dict:
        w: dict = {}
        if self.keep:
            w["keep"] = {"layers": list(self.keep), "kept": self.kept}
        if self.kind is not None:
            w["state"] = {"kind": self.kind, "fresh": self.fresh}
            if self.record:
                w["state"]["record"] = True
            if self.crops:
                w["state"]["crops"] = list(self.crops)
        if self.tail is not None:
            w["tail"] = self.tail.to_wire()
        if self.embed is not None:
            w["embed"] = self.embed.to_wire()
        if self.layer_trees:
            w["layer_trees"] = self.layer_trees
        return w

    @classmethod
    def from_wire(cls, x: dict, slots: int, frames: int = 0) -> "LayerPass":
        state = x.get("state")
        if state is not None and not (isinstance(state, dict) and isinstance(state.get("kind"), str)
                                      and isinstance(state.get("fresh", False), bool)
                                      and isinstance(state.get("record", False), bool)):
            raise ContractError("malformed cache state")
        crops = state.get("crops", []) if state is not None else []
        if not isinstance(crops, list) or len(crops) > MAX_CROPS \
                or not all(is_int(c) and -MAX_CROP <= c <= 0 for c in crops):
            raise ContractError(f"malformed cache crops: at most {MAX_CROPS}, each removing 0 to {MAX_CROP} positions")
        layer_trees = x.get("layer_trees") or {}
        if not isinstance(layer_trees, dict) or len(layer_trees) > MAX_TREE_NODES \
                or not all(isinstance(k, str) for k in layer_trees):
            raise ContractError("malformed per-layer call plans")
        for t in layer_trees.values():
            checked_tree(t, "call plan", slots)
        keep, kept = _keep_from_wire(x.get("keep"), frames)
        return cls(kind=state["kind"] if state is not None else None,
                   fresh=bool(state.get("fresh", False)) if state is not None else False,
                   layer_trees=layer_trees or None,
                   tail=Tail.from_wire(x["tail"]) if x.get("tail") is not None else None,
                   embed=Embed.from_wire(x["embed"], slots) if x.get("embed") is not None else None,
                   record=bool(state.get("record", False)) if state is not None else False, crops=tuple(crops),
                   keep=keep, kept=kept)

    @property
    def trees(self) -> dict:
        return self.layer_trees or {}


def _keep_from_wire(x: Any, frames: int) -> tuple[tuple[int, ...], int]:
    """(keep, kept) of a pass, checked: ascending layer indices, and how many of their outputs the message's last
    frames already carry."""
    if x is None:
        return (), 0
    if not isinstance(x, dict) or set(x) != {"layers", "kept"} or not isinstance(x["layers"], list):
        raise ContractError("malformed keep: a map of layers (a list) and kept (a count)")
    layers, kept = x["layers"], x["kept"]
    if not 0 < len(layers) <= MAX_KEEP or not all(is_int(i) and 0 <= i < 1 << 20 for i in layers) \
            or any(a >= b for a, b in zip(layers, layers[1:])):
        raise ContractError(f"malformed keep: 1 to {MAX_KEEP} layer indices, ascending")
    if not is_int(kept) or not 0 <= kept <= min(len(layers), frames):
        raise ContractError("malformed keep: kept counts outputs the message's frames do not carry")
    return tuple(layers), kept


Part = Union[Whole, Patch, Reuse, LayerPass]
_LAYER_FIELDS = ("state", "layer_trees", "tail", "embed", "keep")


def _part_from_wire(header: dict, slots: int, frames: int = 0) -> Part:
    """The one part a call carries, told by its fields; more than one is refused."""
    kinds = [name for name, there in (
        ("patch", header.get("patch") is not None),
        ("reuse", header.get("reuse") is not None),
        ("layers", any(header.get(f) for f in _LAYER_FIELDS) or header.get("state") is not None)) if there]
    if len(kinds) > 1:
        if "reuse" in kinds:
            raise ContractError("the first-block cache applies to whole steps of a diffusion stack, not to "
                                "patches or a language model's passes")
        raise ContractError("a call carries one part: a patch or a language model's pass, not both")
    if not kinds:
        if header.get("skip") is not None:
            raise ContractError("malformed skip: only a call tagged for the first-block cache carries one")
        return WHOLE
    if kinds[0] == "patch":
        return Patch.from_wire(header["patch"])
    if kinds[0] == "reuse":
        return Reuse.from_wire(header["reuse"], header.get("skip"))
    return LayerPass.from_wire(header, slots, frames)


# --------------------------------------------------------------------------- the pass and its answer


@dataclass(frozen=True)
class Pass:
    """One call into a stack, as a message on the ring. ``tree``, ``rmap`` and ``slot_bytes`` travel only
    when the nodes need them: the call plan when it changed, the return map with a stack's first call, the
    bytes a session's slot caches may keep with the session's first call."""

    stack: str
    seq: int
    slots: tuple[SlotRef, ...]
    part: Part = WHOLE
    tree: dict | None = None
    rmap: ReturnMap | None = None
    slot_bytes: int | None = None

    op = "call"

    def to_wire(self) -> dict:
        w: dict = {"op": self.op, "stack": self.stack, "seq": self.seq}
        if not isinstance(self.part, Patch):
            w.update(self.part.to_wire())
        if self.slot_bytes is not None:
            w["slot_bytes"] = self.slot_bytes
        if self.tree is not None:
            w["tree"] = self.tree
        if self.rmap is not None:
            w["rmap"] = self.rmap.to_dict()
        if isinstance(self.part, Patch):
            w["patch"] = self.part.to_wire()
        w["slots"] = [r.to_wire() for r in self.slots]
        return w

    @classmethod
    def from_wire(cls, header: dict, frames: int) -> "Pass":
        """A call from a peer, checked whole (``frames``: the tensor frames its message carried)."""
        if header.get("op") != cls.op:
            raise ContractError(f"not a call: op {_short(header.get('op'))}")
        if not is_int(header.get("seq")):
            raise ContractError("a call must carry an integer seq")
        if not isinstance(header.get("stack"), str):
            raise ContractError(f"a call must name its stack, not {_short(header.get('stack'))}")
        asked = header.get("slot_bytes")
        if asked is not None and (not is_int(asked) or asked < 0):
            raise ContractError(f"the client asks to keep {str(asked)[:24]} bytes of tensors for its session")
        if not isinstance(header.get("slots"), list) or len(header["slots"]) > MAX_TREE_NODES:
            raise ContractError("a call must list its slots")
        slots = tuple(SlotRef.from_wire(w, frames) for w in header["slots"])
        tree = checked_tree(header["tree"], "call plan", len(slots)) if "tree" in header else None
        rmap = ReturnMap.from_dict(header["rmap"]) if "rmap" in header else None
        return cls(header["stack"], header["seq"], slots, _part_from_wire(header, len(slots), frames), tree, rmap,
                   asked)

    def handed_on(self, slots: list[SlotRef], part: Part) -> "Pass":
        """This pass as the next hop gets it: new slot references, its part as this node left it."""
        return replace(self, slots=tuple(slots), part=part)


@dataclass(frozen=True)
class Answer:
    """The last node's reply to a pass: what the stack's last block returned (``out``, a value tree over the
    message's tensor frames, ``diffuse.plan.calltree.encode_value``); ``skipped``: the first-block cache's decision
    for a tagged call."""

    stack: str
    seq: int
    out: Any
    skipped: bool | None = None

    op = "result"

    def to_wire(self) -> dict:
        w = {"op": self.op, "stack": self.stack, "seq": self.seq, "out": self.out}
        if self.skipped is not None:
            w["skipped"] = self.skipped
        return w

    @classmethod
    def from_wire(cls, header: dict) -> "Answer":
        if header.get("op") != cls.op or not is_int(header.get("seq")):
            raise ContractError(f"not an answer: op {_short(header.get('op'))} #{_short(header.get('seq'))}")
        if not isinstance(header.get("stack"), str):
            raise ContractError("an answer must name its stack")
        if "out" not in header:
            raise ContractError("an answer must carry out")
        skipped = header.get("skipped")
        if skipped is not None and not isinstance(skipped, bool):
            raise ContractError("an answer's skipped is true or false")
        return cls(header["stack"], header["seq"], header["out"], skipped)
