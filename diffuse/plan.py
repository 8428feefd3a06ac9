"""The slicing plan: the only thing client and node exchange about a model.

A plain, versioned dataclass tree that serializes to JSON and back unchanged.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

PLAN_VERSION = 1
WIRE_VERSION = 1
SESSION_ID_BYTES = 16  # a session id on the wire

PATCHABLE = "patchable"
WHOLE_STEPS = "whole-steps"


@dataclass
class StackPlan:
    """One ModuleList of repeated blocks inside the denoiser."""

    path: str  # attribute path from the denoiser, e.g. "blocks" or "trunk.layers"
    length: int  # number of blocks
    block_class: str  # "module.Class" of the blocks
    config_key: str | None = None  # the integer config setting that sizes it
    params_per_block: int = 0


@dataclass
class Slice:
    """A contiguous range [start, stop) of one stack."""

    stack: str
    start: int
    stop: int

    def __str__(self) -> str:
        return f"{self.stack}[{self.start}:{self.stop}]"


@dataclass
class Stage:
    """One node in the ring: where it listens, its identity key, what it holds."""

    address: str
    key: str = ""  # hex X25519 public key, pinned by the client
    slices: list[Slice] = field(default_factory=list)

    def holds(self, stack: str) -> Slice | None:
        return next((s for s in self.slices if s.stack == stack), None)


@dataclass
class ModelIdentity:
    path: str
    denoiser: str  # pipeline component name, e.g. "transformer"
    denoiser_class: str
    content_hash: str  # blake2b over the denoiser's config and weight layout (not the weight data)


@dataclass
class SlicingPlan:
    model: ModelIdentity
    stacks: list[StackPlan]
    output_kind: str = "image"  # image | video | audio
    two_stream: dict[str, bool] = field(default_factory=dict)  # per stack path
    patch_policy: dict[str, str] = field(default_factory=dict)  # per stack path
    compute_dtype: str = "float32"
    route: list[Stage] = field(default_factory=list)
    call_plans: dict[str, Any] = field(default_factory=dict)  # per stack path, learned at first call
    return_maps: dict[str, Any] = field(default_factory=dict)  # per stack path, learned at first call
    notes: list[str] = field(default_factory=list)
    plan_version: int = PLAN_VERSION
    wire_version: int = WIRE_VERSION

    def stack(self, path: str) -> StackPlan:
        for s in self.stacks:
            if s.path == path:
                return s
        raise KeyError(f"no stack {path!r} in the plan (stacks: {[s.path for s in self.stacks]})")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "SlicingPlan":
        if d.get("plan_version") != PLAN_VERSION:
            raise ValueError(f"plan version {d.get('plan_version')} is not {PLAN_VERSION}")
        d = dict(d)
        d["model"] = ModelIdentity(**d["model"])
        d["stacks"] = [StackPlan(**s) for s in d["stacks"]]
        d["route"] = [
            Stage(address=r["address"], key=r["key"], slices=[Slice(**s) for s in r["slices"]])
            for r in d["route"]
        ]
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "SlicingPlan":
        return cls.from_dict(json.loads(text))


def split_evenly(length: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous ranges covering [0, length); earlier parts take the remainder.

    >>> split_evenly(5, 2)
    [(0, 3), (3, 5)]
    """
    if parts < 1:
        raise ValueError("need at least one part")
    base, extra = divmod(length, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def make_route(stacks: list[StackPlan], addresses: list[str], keys: list[str] | None = None) -> list[Stage]:
    """Every node holds a contiguous range of every stack, so each stack call visits the whole ring."""
    keys = keys or [""] * len(addresses)
    route = [Stage(address=a, key=k) for a, k in zip(addresses, keys)]
    for st in stacks:
        for stage, (a, b) in zip(route, split_evenly(st.length, len(route))):
            stage.slices.append(Slice(st.path, a, b))
    return route
