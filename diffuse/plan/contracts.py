"""The contracts between the parts of Diffuse, as plain dataclasses.

Everything the analyzers find, the client plans and a node is told lives here:
``SlicingPlan`` (what ``diffuse plan`` prints), its ``StackPlan``s and
``Stage``s, the ``CallPlan`` and ``ReturnMap`` learned at a stack's first call,
the ``StagePlan`` a node receives sealed in ``open``, the ``SlotRef`` that says
where a tensor of a call comes from, and the ``Patch`` a PipeFusion pass
carries. Each round-trips through JSON (``to_dict``/``from_dict``); what comes
from a peer is checked by ``from_dict``, which raises ``ContractError`` naming
the field.

A *slice* is a node's contiguous range of one stack's blocks, everywhere: the
``--blocks`` flag, hello, open and every message about it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from diffuse.errors import DiffuseError

PLAN_VERSION = 2
WIRE_VERSIONS = (1, 2)  # what this code speaks: 1 = hop keys sealed to the node's long-term key; 2 = agreed (forward secret)
WIRE_VERSION = WIRE_VERSIONS[-1]  # the newest, used wherever both ends speak it
SESSION_ID_BYTES = 16  # a session id on the wire

PATCHABLE = "patchable"
UNCUT_STEPS = "uncut-steps"  # blocks carry two streams (image and text side by side): steps are never cut

ATTENTION_PATHS = ("auto", "plain")  # what a session may ask of PipeFusion's attention (auto: quick where verified)


class ContractError(DiffuseError):
    """Data that should follow one of these contracts does not."""


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# --------------------------------------------------------------------------- stacks and slices


@dataclass(frozen=True)
class StackPlan:
    """One ModuleList of repeated blocks inside the denoiser."""

    path: str  # attribute path from the denoiser, e.g. "blocks" or "trunk.layers"
    length: int  # number of blocks
    block_class: str  # "module.Class" of the blocks
    config_key: str | None = None  # the integer config setting that sizes it
    params_per_block: int = 0


@dataclass(frozen=True)
class Slice:
    """A node's contiguous range [start, stop) of one stack's blocks."""

    stack: str
    start: int
    stop: int

    def __str__(self) -> str:
        return f"{self.stack}[{self.start}:{self.stop}]"

    @property
    def empty(self) -> bool:
        return self.start == self.stop

    def to_dict(self) -> dict:
        return {"stack": self.stack, "start": self.start, "stop": self.stop}


def check_slices(given: Any, lengths: dict[str, int]) -> list[Slice]:
    """The one validator of slices, whoever sends them (``--blocks``, hello, open).

    ``given`` is a list of ``{stack, start, stop}`` maps or ``Slice``s; each must lie within
    the named stack, and a stack may appear once. Raises ``ContractError`` saying which is wrong.
    """
    if not isinstance(given, list):
        raise ContractError("slices must be a list of {stack, start, stop}")
    out: list[Slice] = []
    for s in given:
        if isinstance(s, Slice):
            s = s.to_dict()
        ok = (isinstance(s, dict) and set(s) == {"stack", "start", "stop"} and isinstance(s["stack"], str)
              and _is_int(s["start"]) and _is_int(s["stop"]))
        if not ok:
            raise ContractError(f"malformed slice {_short(s)}: expected {{stack, start, stop}}")
        sl = Slice(s["stack"], s["start"], s["stop"])
        if sl.stack not in lengths:
            raise ContractError(f"slice {sl}: the model has no stack {sl.stack!r:.64} (stacks: {sorted(lengths)})")
        if not 0 <= sl.start <= sl.stop <= lengths[sl.stack]:
            raise ContractError(f"slice {sl}: {sl.stack} has {lengths[sl.stack]} blocks")
        if any(o.stack == sl.stack for o in out):
            raise ContractError(f"two slices of {sl.stack}: a node's slice of a stack is one contiguous range")
        out.append(sl)
    return out


def parse_slices(spec: str | None, stacks: list[StackPlan]) -> list[Slice] | None:
    """``--blocks``: ``"2/3"`` (the 2nd of 3 even slices of every stack), ``"all"``, or
    ``"blocks[0:4],x[2:3]"``. None when not given (the node loads what each session asks for)."""
    if spec is None:
        return None
    spec = spec.strip()
    lengths = {s.path: s.length for s in stacks}
    if spec == "all":
        return [Slice(s.path, 0, s.length) for s in stacks]
    if "/" in spec and "[" not in spec:
        try:
            i, n = (int(x) for x in spec.split("/"))
        except ValueError:
            raise DiffuseError(f"--blocks {spec}: an even slice is I/N with whole numbers, e.g. 2/3") from None
        if not 1 <= i <= n:
            raise DiffuseError(f"--blocks {spec}: must be between 1/{n} and {n}/{n}")
        return [Slice(s.path, *split_evenly(s.length, n)[i - 1]) for s in stacks]
    raw = []
    for part in spec.split(","):
        try:
            path, rng = part.strip().rstrip("]").split("[")
            a, b = (int(x) for x in rng.split(":"))
        except ValueError:
            raise DiffuseError(f"--blocks {part!r}: expected STACK[START:STOP], e.g. blocks[0:20]") from None
        raw.append({"stack": path, "start": a, "stop": b})
    try:
        return check_slices(raw, lengths)
    except ContractError as exc:
        raise DiffuseError(f"--blocks {spec}: {exc}") from None


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


# --------------------------------------------------------------------------- what a stack's first call teaches


@dataclass(frozen=True)
class TensorSpec:
    dtype: str
    shape: list[int]


@dataclass(frozen=True)
class CallPlan:
    """A stack's first call taken apart: the tree of constants with ``{"$t": i}`` where tensor ``i``
    sat (see ``diffuse.plan.calltree``), each tensor slot's human name, and its dtype and shape."""

    tree: dict
    slot_names: list[str]
    tensors: list[TensorSpec]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CallPlan":
        return cls(tree=d["tree"], slot_names=list(d["slot_names"]), tensors=[TensorSpec(**t) for t in d["tensors"]])


@dataclass(frozen=True)
class ReturnMap:
    """For each tensor a block returns, the input slot it replaces (None: returned None, or not threaded).

    ``single``: the block returns one tensor rather than a tuple. ``streams``: the slots that change
    from block to block (the hidden states), sorted. ``names``: the slots' human names, for messages.
    ``sides``: returned positions that are side outputs the model hands to the next block where the first
    block took none (T5's position biases, made by block 0 and given to every later block): threaded into
    slots of the later blocks' own calls, learned per pass (``diffuse.lm.client_ends``), never the hidden state.
    """

    single: bool
    outputs: list[int | None]
    names: list[str | None]
    sides: tuple[int, ...] = ()

    @property
    def streams(self) -> list[int]:
        return sorted(i for i in self.outputs if i is not None)

    @property
    def hidden_streams(self) -> list[int]:
        """The streams that carry hidden states (every stream but the side outputs threaded on), sorted."""
        return sorted(i for j, i in enumerate(self.outputs) if i is not None and j not in self.sides)

    def with_sides(self, sides: dict[int, int]) -> "ReturnMap":
        """This map with side outputs threaded: ``sides`` maps a returned position to the slot it goes to."""
        if not sides:
            return self
        outputs = [sides.get(j, o) for j, o in enumerate(self.outputs)]
        return ReturnMap(self.single, outputs, list(self.names), tuple(sorted(sides)))

    def output_of(self, slot: int) -> int:
        """Which returned position replaces ``slot``."""
        return self.outputs.index(slot)

    def to_dict(self) -> dict:
        d = {"single": self.single, "outputs": list(self.outputs), "names": list(self.names)}
        if self.sides:
            d["sides"] = list(self.sides)
        return d

    @classmethod
    def from_dict(cls, d: Any, slots: int | None = None) -> "ReturnMap":
        """From a peer: checked, so a node never indexes with what a stranger wrote.
        ``slots``: how many tensor slots the call has, if known."""
        if not (isinstance(d, dict) and isinstance(d.get("single"), bool) and isinstance(d.get("outputs"), list)
                and isinstance(d.get("names"), list) and len(d["names"]) == len(d["outputs"])):
            raise ContractError(f"malformed return map {_short(d)}")
        outs = d["outputs"]
        if not outs or any(o is not None and (not _is_int(o) or o < 0) for o in outs):
            raise ContractError("a return map's outputs are slot numbers or None")
        taken = [o for o in outs if o is not None]
        if not taken or len(set(taken)) != len(taken) or (slots is not None and max(taken) >= slots):
            raise ContractError("a return map must thread distinct slots of the call")
        if d["single"] and len(outs) != 1:
            raise ContractError("a single-tensor return map has one output")
        if not all(n is None or isinstance(n, str) for n in d["names"]):
            raise ContractError("a return map's names are strings or None")
        sides = d.get("sides", [])
        if not isinstance(sides, list) or any(not _is_int(j) or not 0 < j < len(outs) or outs[j] is None
                                              for j in sides) or len(set(sides)) != len(sides):
            raise ContractError("a return map's sides are distinct threaded positions after the first")
        return cls(single=d["single"], outputs=list(outs), names=list(d["names"]), sides=tuple(sorted(sides)))


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Stage:
    """One node in the ring: where it listens, its identity key, its slices."""

    address: str
    key: str = ""  # hex X25519 public key, pinned by the client
    slices: tuple[Slice, ...] = ()

    def slice_of(self, stack: str) -> Slice | None:
        return next((s for s in self.slices if s.stack == stack), None)


@dataclass(frozen=True)
class ModelIdentity:
    path: str
    denoiser: str  # pipeline component name, e.g. "transformer"
    denoiser_class: str
    content_hash: str  # blake2b over the denoiser's config and weight layout (not the weight data)


@dataclass(frozen=True)
class SlicingPlan:
    """What the analyzers found and how the model is split. Never changed once made: the ``with_*``
    methods return a new plan."""

    model: ModelIdentity
    stacks: tuple[StackPlan, ...]
    output_kind: str = "image"  # image | video | audio
    patch_policy: dict[str, str] = field(default_factory=dict)  # per stack path: PATCHABLE | UNCUT_STEPS
    compute_dtype: str = "float32"
    route: tuple[Stage, ...] = ()
    call_plans: dict[str, CallPlan] = field(default_factory=dict)  # per stack path, learned at first call
    return_maps: dict[str, ReturnMap] = field(default_factory=dict)  # per stack path, learned at first call
    plan_version: int = PLAN_VERSION
    wire_version: int = WIRE_VERSION

    def stack(self, path: str) -> StackPlan:
        for s in self.stacks:
            if s.path == path:
                return s
        raise KeyError(f"no stack {path!r} in the plan (stacks: {[s.path for s in self.stacks]})")

    @property
    def lengths(self) -> dict[str, int]:
        return {s.path: s.length for s in self.stacks}

    def with_route(self, route) -> "SlicingPlan":
        return dataclasses.replace(self, route=tuple(route))

    def with_call(self, path: str, call_plan: CallPlan, return_map: ReturnMap) -> "SlicingPlan":
        return dataclasses.replace(self, call_plans={**self.call_plans, path: call_plan},
                                   return_maps={**self.return_maps, path: return_map})

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["return_maps"] = {k: v.to_dict() for k, v in self.return_maps.items()}
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "SlicingPlan":
        if d.get("plan_version") != PLAN_VERSION:
            raise ContractError(f"plan version {d.get('plan_version')} is not {PLAN_VERSION}")
        d = dict(d)
        d["model"] = ModelIdentity(**d["model"])
        d["stacks"] = tuple(StackPlan(**s) for s in d["stacks"])
        d["route"] = tuple(Stage(address=r["address"], key=r["key"], slices=tuple(Slice(**s) for s in r["slices"]))
                           for r in d["route"])
        d["call_plans"] = {k: CallPlan.from_dict(v) for k, v in d.get("call_plans", {}).items()}
        d["return_maps"] = {k: ReturnMap.from_dict(v) for k, v in d.get("return_maps", {}).items()}
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "SlicingPlan":
        return cls.from_dict(json.loads(text))


def even_route(stacks, addresses: list[str], keys: list[str] | None = None) -> tuple[Stage, ...]:
    """Every node holds an even slice of every stack, so each stack call visits the whole ring."""
    keys = keys or [""] * len(addresses)
    n = len(addresses)
    return tuple(
        Stage(address=a, key=k, slices=tuple(Slice(st.path, *split_evenly(st.length, n)[i]) for st in stacks))
        for i, (a, k) in enumerate(zip(addresses, keys)))


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

    def slice_of(self, stack: str) -> Slice | None:
        return next((s for s in self.slices if s.stack == stack), None)

    def to_dict(self) -> dict:
        d = {"model_hash": self.model_hash, "dtype": self.dtype, "slices": [s.to_dict() for s in self.slices],
             "next": self.next, "attention": self.attention}
        if (self.wire_in, self.wire_out) != (1, 1):  # a node that speaks only version 1 is told exactly what it knows
            d.update(wire_in=self.wire_in, wire_out=self.wire_out)
        return d

    @classmethod
    def from_dict(cls, d: Any, lengths: dict[str, int]) -> "StagePlan":
        base = {"model_hash", "dtype", "slices", "next", "attention"}
        if not isinstance(d, dict) or set(d) not in (base, base | {"wire_in", "wire_out"}):
            raise ContractError(f"malformed stage plan {_short(d)}: expected model_hash, dtype, slices, next, "
                                "attention (and wire_in, wire_out)")
        for name in ("model_hash", "dtype", "next", "attention"):
            if not isinstance(d[name], str):
                raise ContractError(f"the stage plan's {name} must be a string")
        if d["attention"] not in ATTENTION_PATHS:
            raise ContractError(f"unknown attention path {d['attention']!r:.64} ({' or '.join(ATTENTION_PATHS)})")
        hops = (d.get("wire_in", 1), d.get("wire_out", 1))
        if not all(_is_int(v) for v in hops):
            raise ContractError("the stage plan's wire_in and wire_out must be integers")
        return cls(d["model_hash"], d["dtype"], tuple(check_slices(d["slices"], lengths)), d["next"], d["attention"],
                   *hops)


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
        if isinstance(w, list) and len(w) in (2, 3) and w[0] == "f" and _is_int(w[1]) and 0 <= w[1] < frames:
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
        if not isinstance(w["uncut"], bool) or not all(_is_int(w[n]) and w[n] >= 0 for n in names - {"uncut"}):
            raise ContractError("a patch's fields are whole numbers (uncut: true or false)")
        p = cls(**w)
        if not p.uncut and (p.count < 1 or p.lo + p.count > p.tokens):
            raise ContractError(f"patch rows [{p.lo}:{p.lo + p.count}) do not lie within {p.tokens} tokens")
        return p


def _short(x: Any) -> str:
    """A bounded description of something a peer sent (never a full repr of an arbitrary structure)."""
    if isinstance(x, (dict, list, tuple)):
        return f"<{type(x).__name__} of {len(x)}>"
    if isinstance(x, (str, bytes)):
        return f"<{type(x).__name__} of {len(x)}>" if len(x) > 40 else repr(x)
    return f"<{type(x).__name__}>" if not isinstance(x, (int, float, bool, type(None))) else repr(x)
