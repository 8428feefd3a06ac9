"""The contracts a session's messages carry between the client and a node, as plain dataclasses.

The ``StagePlan`` a node receives sealed in ``open``, the ``SlotRef`` that says
where a tensor of a call comes from, and the ``Patch`` a PipeFusion pass
carries. What comes from a peer is checked by ``from_dict``/``from_wire``,
which raises ``ContractError`` naming the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from diffuse.plan.contracts import ContractError, Slice, is_int, _short, check_slices

ATTENTION_PATHS = ("auto", "plain")  # what a session may ask of PipeFusion's attention (auto: quick where verified)


# --------------------------------------------------------------------------- what a node is told


@dataclass(frozen=True)
class StagePlan:
    """What a node is told about one session, sealed inside ``open``: the model it must serve, the
    dtype to compute in, its slices, where to hand results on, the attention path allowed, and the wire
    version of the hop it receives on (``wire_in``) and of the hop it sends on (``wire_out``): the highest
    version both ends of that hop speak."""

    model_hash: str
    dtype: str
    slices: tuple[Slice, ...]
    next: str
    attention: str = "auto"
    wire_in: int = 1
    wire_out: int = 1
    model_commit: str = ""  # a Hub model's commit (``diffuse.plan.hubmodel``); "" for a folder of one's own
    quantize: str = ""  # the mode the blocks are held in (``diffuse.plan.quantize``); "" unquantized

    def slice_of(self, stack: str) -> Slice | None:
        return next((s for s in self.slices if s.stack == stack), None)

    def to_dict(self) -> dict:
        d = {"model_hash": self.model_hash, "dtype": self.dtype, "slices": [s.to_dict() for s in self.slices],
             "next": self.next, "attention": self.attention}
        if (self.wire_in, self.wire_out) != (1, 1):  # a node that speaks only version 1 is told exactly what it knows
            d.update(wire_in=self.wire_in, wire_out=self.wire_out)
        if self.model_commit:  # only for a Hub model: a node of a folder, or an older node, is told what it knows
            d["model_commit"] = self.model_commit
        if self.quantize:  # only when quantized: an older node is told exactly what it knows
            d["quantize"] = self.quantize
        return d

    @classmethod
    def from_dict(cls, d: Any, lengths: dict[str, int]) -> "StagePlan":
        base = {"model_hash", "dtype", "slices", "next", "attention"}
        if not isinstance(d, dict) or set(d) - {"model_commit", "quantize"} not in (base, base | {"wire_in", "wire_out"}):
            raise ContractError(f"malformed stage plan {_short(d)}: expected model_hash, dtype, slices, next, "
                                "attention (and wire_in, wire_out)")
        for name in ("model_hash", "dtype", "next", "attention", "model_commit", "quantize"):
            if not isinstance(d.get(name, ""), str):
                raise ContractError(f"the stage plan's {name} must be a string")
        if d["attention"] not in ATTENTION_PATHS:
            raise ContractError(f"unknown attention path {d['attention']!r:.64} ({' or '.join(ATTENTION_PATHS)})")
        hops = (d.get("wire_in", 1), d.get("wire_out", 1))
        if not all(is_int(v) for v in hops):
            raise ContractError("the stage plan's wire_in and wire_out must be integers")
        return cls(d["model_hash"], d["dtype"], tuple(check_slices(d["slices"], lengths)), d["next"], d["attention"],
                   *hops, d.get("model_commit", ""), d.get("quantize", ""))


# --------------------------------------------------------------------------- on the data path


@dataclass(frozen=True)
class SlotRef:
    """Where tensor slot ``i`` of a call comes from: a frame of this message (``frame``; with
    ``digest`` when the receiver should keep it), or a tensor the receiver already keeps (``digest``).
    On the wire: ``["f", frame]``, ``["f", frame, digest]`` or ``["h", digest]``."""

    frame: int | None = None
    digest: bytes | None = None

    @property
    def held(self) -> bool:
        return self.frame is None

    def to_wire(self) -> list:
        if self.frame is None:
            return ["h", self.digest]
        return ["f", self.frame] if self.digest is None else ["f", self.frame, self.digest]

    @classmethod
    def from_wire(cls, w: Any, frames: int) -> "SlotRef":
        if isinstance(w, list) and len(w) in (2, 3) and w[0] == "f" and is_int(w[1]) and 0 <= w[1] < frames:
            if len(w) == 2:
                return cls(frame=w[1])
            if isinstance(w[2], bytes):
                return cls(frame=w[1], digest=w[2])
        if isinstance(w, list) and len(w) == 2 and w[0] == "h" and isinstance(w[1], bytes):
            return cls(digest=w[1])
        raise ContractError(f"malformed slot reference {_short(w)}")


@dataclass(frozen=True)
class Patch:
    """What a PipeFusion pass carries: its branch and step, the token axis and count of the stream,
    and either ``uncut`` (all tokens: the first step of a branch) or the rows [lo, lo + count)."""

    branch: int
    step: int
    axis: int
    tokens: int
    uncut: bool = False
    lo: int = 0
    count: int = 0
    index: int = 0  # which patch of the step, from 0

    def cut(self, index: int, lo: int, hi: int) -> "Patch":
        return dataclasses.replace(self, uncut=False, index=index, lo=lo, count=hi - lo)

    def to_wire(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, w: Any) -> "Patch":
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(w, dict) or set(w) != names:
            raise ContractError(f"malformed patch {_short(w)}")
        if not isinstance(w["uncut"], bool) or not all(is_int(w[n]) and w[n] >= 0 for n in names - {"uncut"}):
            raise ContractError("a patch's fields are whole numbers (uncut: true or false)")
        p = cls(**w)
        if not p.uncut and (p.count < 1 or p.lo + p.count > p.tokens):
            raise ContractError(f"patch rows [{p.lo}:{p.lo + p.count}) do not lie within {p.tokens} tokens")
        return p
