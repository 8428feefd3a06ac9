"""Replicas and route repair: which listed node carries each range, and who takes over when one fails.

Every listed node is asked what it holds (hello). Nodes started with the same ``--blocks`` are
replicas of one range. The route runs through the ranges in the order of the blocks they hold (where
each range starts, whatever order the nodes were listed in), one holder per range: the first listed
that is usable; the others are spares. Nodes that hold nothing fixed load what each session asks for:
the route gives them slices planned from their memory and speed (``diffuse.plan.placement``; even slices
with the policy's ``placement="even"``), and a failed one is repaired by planning over the rest.

What a ring does when a node fails is a ``RepairPolicy`` handed to it (``diffuse.split(..., repair=)``):
which holder a range takes (``choose``), how long a failed node is avoided (``avoid_s``: 30 s after
its first failure, doubling with each failure in a row up to 600 s, then it is tried again), whether
the session moves to a repaired route at all and replays what it must (``replay``), and who is told
of a repair (``listen``). One pass is repaired at most once per listed node; a run is repaired as
often as its nodes fail, each failed node waiting out its time before it is used again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from diffuse.errors import DiffuseError
from diffuse.client.heard import Heard
from diffuse.client.routing import route as placement_route
from diffuse.plan.contracts import Slice, SlicingPlan, Stage, even_route

AVOID_FIRST_S = 30.0
AVOID_MAX_S = 600.0


class Avoidance:
    """Nodes that failed, and until when each is avoided. One table is shared by every ring of a process
    by default (``AVOIDED``), so a node that failed a moment ago is left out of the next session too."""

    def __init__(self):
        self.failures: dict[str, tuple[float, int]] = {}  # node address -> (avoided until, failures in a row)

    def failed(self, address: str, wait_for, now: float | None = None) -> float:
        """Avoid ``address`` for ``wait_for(failures in a row before this one)`` seconds; returns them."""
        now = time.monotonic() if now is None else now
        _, count = self.failures.get(address, (0.0, 0))
        wait = float(wait_for(count))
        self.failures[address] = (now + wait, count + 1)
        return wait

    def served(self, address: str) -> None:
        self.failures.pop(address, None)

    def avoided(self, address: str, now: float | None = None) -> bool:
        until, _ = self.failures.get(address, (0.0, 0))
        return (time.monotonic() if now is None else now) < until

    def clear(self) -> None:
        self.failures.clear()


AVOIDED = Avoidance()


@dataclass
class RepairPolicy:
    """How a ring repairs its route when a node fails; the defaults are Diffuse's own behaviour.

    ``avoid_first_s``, ``avoid_max_s``: a failed node is avoided this long after its first failure,
    twice as long after each further failure in a row, at most ``avoid_max_s``; once a session opens
    on it again its count starts over. ``replay``: True moves the session to a route without the
    failed node, resends the passes in flight and replays a language model's passes since its cache
    was last started anew; False leaves the failure to the caller. ``avoidance``: the table of failed
    nodes (default: the one the whole process shares). Listeners (``listen``) run after each repair,
    before anything is replayed: a cache of per-step state on the client (PipeFusion's branches, the
    first-block cache) starts again there. One policy may serve several rings (branch groups): its
    listeners then hear of a repair of any of them. ``placement``: how nodes that hold nothing fixed
    share the stacks, at the start and after a repair ("planned" or "even", ``diffuse.plan.placement``); ``depth``:
    the passes in flight at once the planned placement is made for (the run's patches); ``heard``: the nodes'
    hellos and the links measured by its rings (``diffuse.client.heard``), which placement plans from."""

    avoid_first_s: float = AVOID_FIRST_S
    avoid_max_s: float = AVOID_MAX_S
    replay: bool = True
    avoidance: Avoidance = field(default_factory=lambda: AVOIDED)
    listeners: list = field(default_factory=list)
    placement: str = "planned"
    depth: int = 1  # passes in flight at once (patches), which the planned placement is made for
    heard: Heard = field(default_factory=Heard)  # what this policy's rings heard of their nodes, planned from
    decoder: object = None  # the VAE's stack on one node (a diffuse.client.decoders.DecoderPin), when asked

    def avoid_s(self, failures_before: int) -> float:
        """How long a node is avoided after a failure, given its failures in a row before this one."""
        return min(self.avoid_first_s * 2 ** failures_before, self.avoid_max_s)

    def failed(self, address: str, now: float | None = None) -> float:
        """``address`` failed: avoid it for a while; returns for how many seconds."""
        return self.avoidance.failed(address, self.avoid_s, now)

    def served(self, address: str) -> None:
        """A session opened on ``address``: its next failure starts from the first wait again."""
        self.avoidance.served(address)

    def avoided(self, address: str, now: float | None = None) -> bool:
        return self.avoidance.avoided(address, now)

    def choose(self, plan: SlicingPlan, candidates: tuple[Stage, ...], held: list, usable: list[bool]) -> SlicingPlan:
        """The route to use (``choose_route``; the VAE's block where ``decoder`` pins it); a policy that prefers other
        holders overrides this."""
        if self.decoder is not None:
            return self.decoder.routed(plan, lambda rest: choose_route(rest, candidates, held, usable, self.placement,
                                                                        self.depth, self.heard),
                                       candidates, usable, self.heard)
        return choose_route(plan, candidates, held, usable, self.placement, self.depth, self.heard)

    def listen(self, hook) -> None:
        """Run ``hook()`` after every repair of a ring using this policy (once, however often it is given)."""
        if hook not in self.listeners:
            self.listeners.append(hook)

    def repaired(self) -> None:
        for hook in list(self.listeners):
            hook()


def _key(held: list[Slice]) -> tuple:
    return tuple(sorted((s.stack, s.start, s.stop) for s in held if not s.empty))


def _in_block_order(plan: SlicingPlan, ranges: list[tuple]) -> list[tuple]:
    """``ranges`` (each a tuple of (stack, start, stop)) ordered so that in every stack a range that starts
    earlier comes first; ranges no stack orders keep their given order (a circle: the given order)."""
    after: dict[tuple, set] = {r: set() for r in ranges}
    for st in plan.stacks:
        holding = sorted((s[1], n, r) for n, r in enumerate(ranges) for s in r if s[0] == st.path)
        for (a_start, _, a), (b_start, _, b) in zip(holding, holding[1:]):
            if a_start < b_start:
                after[b].add(a)
    order, left = [], list(ranges)
    while left:
        ready = next((r for r in left if after[r] <= set(order)), None)
        if ready is None:
            return order + left
        order.append(ready)
        left.remove(ready)
    return order


def _gap(plan: SlicingPlan, ranges: list[tuple]) -> str | None:
    """The first part of a stack that none of ``ranges`` (in route order) holds, or None."""
    for st in plan.stacks:
        pos = 0
        for r in ranges:
            for stack, start, stop in r:
                if stack == st.path:
                    if start > pos:
                        return str(Slice(st.path, pos, start))
                    pos = max(pos, stop)
        if pos < st.length:
            return str(Slice(st.path, pos, st.length))
    return None


def choose_route(plan: SlicingPlan, candidates: tuple[Stage, ...], held: list, usable: list[bool],
                 placement: str = "planned", depth: int = 1, heard: Heard | None = None) -> SlicingPlan:
    """The plan routed through one usable holder per range, the ranges in block order.

    ``held[i]``: the slices candidate ``i`` said it holds (None: whatever it is asked for);
    ``usable[i]``: it answered and is not being avoided; ``placement``: how nodes that hold nothing
    fixed share the stacks (``diffuse.client.routing.route``). Raises DiffuseError naming a range no usable
    node holds when no complete route is left (the caller says which nodes were lost), or when the
    model fits no placement on them."""
    live = [i for i in range(len(candidates)) if usable[i]]
    if not live:
        raise DiffuseError("no listed node is left to route through")
    if all(held[i] is None for i in live):  # nodes that load what they are asked for: slices planned for them
        return placement_route(heard if heard is not None else Heard(), plan, [candidates[i] for i in live], placement,
                               depth)
    if any(held[i] is None for i in live):
        # such nodes with others: an even split over the usable ones
        stages = [candidates[i] for i in live]
        return plan.with_route(even_route(plan.stacks, [s.address for s in stages], [s.key for s in stages]))
    picked: dict[tuple, int] = {}
    for i in range(len(candidates)):  # every range any node said it holds, first listed first
        if held[i] is not None:  # (a node that never answered said nothing of what it holds)
            picked.setdefault(_key(held[i]), -1)
    for i in live:
        if picked[_key(held[i])] < 0:
            picked[_key(held[i])] = i
    lost = [k for k, i in picked.items() if i < 0]
    if lost:
        names = ", ".join(str(Slice(*s)) for s in lost[0])
        raise DiffuseError(f"no usable node holds {names}")
    ranges = _in_block_order(plan, list(picked))
    gap = _gap(plan, ranges)
    if gap is not None and any(held[i] is None for i in range(len(candidates))):
        # a node that never answered may hold it (when every node answered, the handshake says how their
        # slices fail to chain)
        raise DiffuseError(f"no usable node holds {gap}")
    return plan.with_route(candidates[picked[r]] for r in ranges)
