"""The contracts between the parts of Diffuse, as plain dataclasses: the plan.

What the analyzers find and the client plans lives here: ``SlicingPlan`` (what
``diffuse plan`` prints), its ``StackPlan``s and ``Stage``s, and the
``CallPlan`` and ``ReturnMap`` learned at a stack's first call; with
``ContractError``, which every contract raises. What a session's messages carry
(``StagePlan``, ``SlotRef``, ``Patch``) is in ``diffuse.plan.messages``. Each
round-trips through JSON (``to_dict``/``from_dict``); what comes from a peer is
checked by ``from_dict``, which raises ``ContractError`` naming the field.

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
# what this code speaks: 1 = hop keys sealed to the node's long-term key; 2 = agreed (forward secret); 3 = as 2, and
# a language model's pass may ask the nodes to cut their caches (drafts verified: diffuse.lm.client_drafts); 4 = as 3,
# and a pass may ask for inner layers' outputs back (an encoder read at an inner layer: diffuse.client.encoders)
WIRE_VERSIONS = (1, 2, 3, 4)
CUTS_CACHES = 3  # the first version whose nodes make the cuts a pass asks for
KEEPS_LAYERS = 4  # the first version whose nodes bring inner layers' outputs back
WIRE_VERSION = WIRE_VERSIONS[-1]  # the newest, used wherever both ends speak it
SESSION_ID_BYTES = 16  # a session id on the wire

PATCHABLE = "patchable"
UNCUT_STEPS = "uncut-steps"  # blocks carry two streams (image and text side by side): steps are never cut


class ContractError(DiffuseError):
    """Data that should follow one of these contracts does not."""


def is_int(x) -> bool:
    """An int that is not a bool (JSON and CBOR from peers: ``True`` is no count)."""
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
              and is_int(s["start"]) and is_int(s["stop"]))
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
        if not outs or any(o is not None and (not is_int(o) or o < 0) for o in outs):
            raise ContractError("a return map's outputs are slot numbers or None")
        taken = [o for o in outs if o is not None]
        if not taken or len(set(taken)) != len(taken) or (slots is not None and max(taken) >= slots):
            raise ContractError("a return map must thread distinct slots of the call")
        if d["single"] and len(outs) != 1:
            raise ContractError("a single-tensor return map has one output")
        if not all(n is None or isinstance(n, str) for n in d["names"]):
            raise ContractError("a return map's names are strings or None")
        sides = d.get("sides", [])
        if not isinstance(sides, list) or any(not is_int(j) or not 0 < j < len(outs) or outs[j] is None
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
    commit: str = ""  # a model fetched from the Hub: the commit every node must hold (diffuse.plan.hubmodel)


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
    quantize: str = ""  # the mode the nodes hold the blocks in (diffuse.plan.quantize); "" unquantized

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


# --------------------------------------------------------------------------- telling what a peer sent


def _short(x: Any) -> str:
    """A bounded description of something a peer sent (never a full repr of an arbitrary structure)."""
    if isinstance(x, (dict, list, tuple)):
        return f"<{type(x).__name__} of {len(x)}>"
    if isinstance(x, (str, bytes)):
        return f"<{type(x).__name__} of {len(x)}>" if len(x) > 40 else repr(x)
    return f"<{type(x).__name__}>" if not isinstance(x, (int, float, bool, type(None))) else repr(x)
