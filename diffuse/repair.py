"""Replicas and route repair: which listed node carries each range, and who takes over when one fails.

Every listed node is asked what it holds (hello). Nodes started with the same ``--blocks`` are
replicas of one range: the route takes one holder per range, the first listed that is not being
avoided, and keeps the others as spares. Nodes that hold nothing fixed load what each session asks
for: the route gives them slices planned from their memory and speed (``diffuse.placement``; even
slices with ``placement="even"``), and a failed one is repaired by planning over the rest. A node
that failed is avoided for a while (``AVOID_FIRST_S``, doubling with each failure in a row up to
``AVOID_MAX_S``), not forever: once that time is over it is tried again.
"""

from __future__ import annotations

import time

from diffuse.errors import DiffuseError
from diffuse.placement import route as placement_route
from diffuse.plan import Slice, SlicingPlan, Stage, even_route

AVOID_FIRST_S = 30.0
AVOID_MAX_S = 600.0

_failures: dict[str, tuple[float, int]] = {}  # node address -> (avoided until, failures in a row)


def note_failure(address: str, now: float | None = None) -> float:
    """Avoid ``address`` for a while; returns for how many seconds."""
    now = time.monotonic() if now is None else now
    _, count = _failures.get(address, (0.0, 0))
    wait = min(AVOID_FIRST_S * 2 ** count, AVOID_MAX_S)
    _failures[address] = (now + wait, count + 1)
    return wait


def note_success(address: str) -> None:
    _failures.pop(address, None)


def avoided(address: str, now: float | None = None) -> bool:
    until, _ = _failures.get(address, (0.0, 0))
    return (time.monotonic() if now is None else now) < until


def _key(held: list[Slice]) -> tuple:
    return tuple(sorted((s.stack, s.start, s.stop) for s in held if not s.empty))


def choose_route(plan: SlicingPlan, candidates: tuple[Stage, ...], held: list, usable: list[bool],
                 placement: str = "planned") -> SlicingPlan:
    """The plan routed through one usable holder per range.

    ``held[i]``: the slices candidate ``i`` said it holds (None: whatever it is asked for);
    ``usable[i]``: it answered and is not being avoided; ``placement``: how nodes that hold nothing
    fixed share the stacks (``diffuse.placement.route``). Raises DiffuseError when no complete route
    is left (the caller says which nodes were lost), or when the model fits no placement on them."""
    live = [i for i in range(len(candidates)) if usable[i]]
    if not live:
        raise DiffuseError("no listed node is left to route through")
    if all(held[i] is None for i in live):  # nodes that load what they are asked for: slices planned for them
        return placement_route(plan, [candidates[i] for i in live], placement)
    if any(held[i] is None for i in live):
        # such nodes with others: an even split over the usable ones
        stages = [candidates[i] for i in live]
        return plan.with_route(even_route(plan.stacks, [s.address for s in stages], [s.key for s in stages]))
    picked: dict[tuple, int] = {}
    for i in range(len(candidates)):  # a range's place in the route: where its first holder is listed
        if held[i] is not None:  # (a node that never answered said nothing of what it holds)
            picked.setdefault(_key(held[i]), -1)
    for i in live:
        if picked[_key(held[i])] < 0:
            picked[_key(held[i])] = i
    lost = [k for k, i in picked.items() if i < 0]
    if lost:
        names = ", ".join(str(Slice(*s)) for s in lost[0])
        raise DiffuseError(f"no usable node holds {names}")
    return plan.with_route(candidates[i] for i in picked.values())
