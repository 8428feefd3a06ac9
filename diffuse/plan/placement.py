"""Placement: which node holds which contiguous slice, from what the nodes say and what the model needs.

By job, in four modules of ``diffuse.plan``: what a node says at hello (``reports``: ``node_report``, its
``SpeedBook``, and ``NodeReport``, how the client reads it), what the model needs per block (``needs``:
``block_costs`` from the safetensors headers, no weights read; for a language model also its key/value
cache at ``context`` tokens), the solver (``solver``: ``place`` cuts the blocks of every stack, taken in
the plan's order, into contiguous runs, one per node in the listed order, so that every run fits its
node's memory less a margin and the slowest node's share of a pass is as small as it can be; among
placements as good as that, the one with the least total compute, then the most even; ``even_placement``
keeps the even slices, checked against the same memory), and here what they share: a node as the
planner sees it (``Capacity``), the result and its printed table (``Placement``), the margin, and the
refusal of a model that fits no placement (``DoesNotFit``, naming the shortfall in GiB) before any node
loads a block. A node not measured counts at the median speed of those measured (all alike when none
is). The client plans its routes from these in ``diffuse.client.routing``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diffuse.errors import DiffuseError
from diffuse.plan.contracts import Slice
from diffuse.plan.needs import GIB, BlockCost

MARGIN_FRACTION = 0.10  # of a node's available memory, kept free for activations and the unforeseen
MARGIN_MIN_BYTES = 64 << 20  # ... and at least this much


class DoesNotFit(DiffuseError):
    """The model fits no placement on the given nodes."""


# --------------------------------------------------------------------------- the client's side


# --------------------------------------------------------------------------- what the model needs


# --------------------------------------------------------------------------- the planner (a pure function)

# is slow or behind a slow link (a hop on a LAN, a fraction of a millisecond, never leaves one out)


@dataclass(frozen=True)
class Capacity:
    """One node as the planner sees it."""

    name: str
    free: int | None  # bytes it may still take (None: not said, planned as unlimited)
    speed: float | None = None  # seconds per GiB of weights per token (None: not measured)
    holds: frozenset = frozenset()  # (stack, index) it already holds in the compute dtype (costs no memory)
    pool: str = ""  # nodes of one pool share its memory
    hop_s: float = 0.0  # one hop's time to or from it (half its round trip), where no link table is given
    pass_s: float | None = None  # seconds a pass spends on it besides its blocks, when it holds any (measured)


@dataclass
class Placement:
    nodes: list[Capacity]
    blocks: list[BlockCost]
    rows: list[tuple[Slice, ...]]  # per node: its slice of every stack (empty where it holds none of it)
    room: list[int | None]  # per node: bytes it may take after the margin
    need: list[int]  # per node: bytes its run costs it (weights it does not hold yet, plus state)
    size: list[int]  # per node: bytes of its run (weights and state, held or not)
    speeds: list[float]  # per node: the speed planned with (seconds per GiB per token)
    measured: list[bool]
    shares: list[float]  # per node: seconds its run takes per token
    hop_s: float  # a hop, in the same seconds, on average over the route (0 where no node is measured)
    notes: list[str]
    tokens: int = 1
    hops: list[float] = field(default_factory=list)  # each hop of the route: the client to the first, ..., home
    depth: int = 1  # passes in flight at once it was planned for (1: one after another)

    @property
    def used(self) -> list[int]:
        return [i for i, row in enumerate(self.rows) if any(not s.empty for s in row)]

    @property
    def slowest_s(self) -> float:
        return max(self.shares)

    @property
    def pass_s(self) -> float:
        """One pass through every used node in turn, with its hops (one patch, one stream)."""
        if self.hops:
            return sum(self.shares) + sum(self.hops)
        return sum(self.shares) + self.hop_s * (len(self.used) + 1)

    def step_s(self, depth: int | None = None) -> float:
        """``depth`` passes in flight at once (default: what it was planned for), per pass: each node works its
        share of every pass, the first pass takes every share in turn and each later one the slowest; plus the
        hops of one pass."""
        d = max(1, depth or self.depth)
        hops = sum(self.hops) if self.hops else self.hop_s * (len(self.used) + 1)
        return (sum(self.shares) + (d - 1) * self.slowest_s) / d + hops

    def lines(self) -> list[str]:
        """The placement as a table: per node its blocks, their GiB (weights and cache), the GiB it has room for
        besides what it holds, its speed, and its share of the time."""
        total = sum(self.shares) or 1.0
        rows = [f"{'node':<28} {'blocks':<34} {'GiB':>6} {'room':>7} {'speed':>14} {'share':>6}"]
        for i, (c, sl) in enumerate(zip(self.nodes, self.rows)):
            names = ", ".join(str(s) for s in sl if not s.empty) or "none"
            room = "-" if self.room[i] is None else f"{self.room[i] / GIB:.2f}"
            speed = (f"{self.speeds[i]:.3g} s/GiB/t" if any(self.measured) else "alike") + \
                ("" if self.measured[i] else "*")
            rows.append(f"{c.name[:28]:<28} {names[:34]:<34} {self.size[i] / GIB:>6.2f} {room:>7} {speed:>14} "
                        f"{self.shares[i] / total:>6.0%}")
        unmeasured = ("* not measured yet: counted at the median speed of those measured" if any(self.measured)
                      else "* no node measured yet: all counted alike")
        return rows + [unmeasured] * (not all(self.measured)) + self.notes


def _margin(free: int) -> int:
    return max(int(free * MARGIN_FRACTION), MARGIN_MIN_BYTES)


def rooms(nodes: list[Capacity]) -> list[int | None]:
    """What each node may take after the margin; nodes sharing a pool share its memory evenly."""
    pools: dict[str, int] = {}
    for c in nodes:
        if c.pool:
            pools[c.pool] = pools.get(c.pool, 0) + 1
    out = []
    for c in nodes:
        if c.free is None:
            out.append(None)
            continue
        share = c.free // pools.get(c.pool, 1) if c.pool else c.free
        out.append(max(0, share - _margin(share)))
    return out


def shortfall(blocks: list[BlockCost], nodes: list[Capacity], room: list[int | None]) -> DoesNotFit:
    need = sum(b.weight_bytes + b.held_bytes for b in blocks)
    have = sum(r for r in room if r is not None)
    biggest = max(b.weight_bytes + b.held_bytes for b in blocks)
    each = ", ".join(f"{c.name} {r / GIB:.2f}" for c, r in zip(nodes, room) if r is not None)
    state, ends = sum(b.state_bytes for b in blocks), sum(b.end_bytes for b in blocks)
    what = (f"{len(blocks)} blocks, {need / GIB:.2f} GiB" + (f" with {state / GIB:.2f} GiB of cache" if state else "")
            + (f" and a {ends / GIB:.2f} GiB output head" if ends else ""))
    if need > have:
        why = f"{(need - have) / GIB:.2f} GiB short"
    else:
        why = (f"no node has room for the next whole block ({biggest / GIB:.2f} GiB) where it is needed: at least "
               f"{biggest / GIB:.2f} GiB short on one node")
    return DoesNotFit(f"the model does not fit these nodes: it needs {what}; the {len(nodes)} node(s) can take "
                      f"{have / GIB:.2f} GiB between them after a {MARGIN_FRACTION:.0%} margin ({each}): {why}. "
                      "Add a node or memory, or compute in a smaller dtype")


# --------------------------------------------------------------------------- from reports to a route


def nodes_needed(blocks: list[BlockCost], room: list[int | None]) -> int | None:
    """The fewest of these nodes (their ``rooms``, after the margin) that hold ``blocks`` in contiguous runs, the
    roomiest taken first and each filled before the next; None when all of them cannot."""
    if any(r is None for r in room):
        return 1 if room else None  # a node that said nothing of its memory is planned as unlimited
    order = sorted((r for r in room), reverse=True)
    used, left = 0, 0
    for b in blocks:
        size = b.weight_bytes + b.held_bytes
        while size > left:
            if used == len(order):
                return None
            left, used = order[used], used + 1
        left -= size
    return max(used, 1)
