"""The client's routes planned from what its nodes said at hello and the links it measured (a ``Heard``):
the one place a route is planned from (``route``; ``diffuse.client.repair`` calls it)."""

from __future__ import annotations

from diffuse.client.heard import Heard
from diffuse.errors import DiffuseError
from diffuse.plan.contracts import SlicingPlan, Stage, even_route
from diffuse.plan.needs import block_costs, pass_bytes, per_pass
from diffuse.plan.placement import Capacity, Placement
from diffuse.plan.solver import even_placement, place
from diffuse.wire.links import CLIENT


PLACEMENTS = ("planned", "even")


def capacities(heard: Heard, stages, dtype: str, model_hash: str, per: str = "token") -> list[Capacity] | None:
    """The planner's view of ``stages`` from their nodes' hello reports (as ``heard``); None if any has not reported.
    ``per``: the speed planned with (``NodeReport.s_per_gib_token``)."""
    out = []
    for s in stages:
        r = heard.report_of(s.address)
        if r is None:
            return None
        speed = r.s_per_gib_token(dtype, model_hash, per)
        holds = frozenset((st, i) for st, i, d in r.holds if d == dtype)
        out.append(Capacity(s.address, r.available, speed, holds, r.pool, (r.rtt_s or 0.0) / 2,
                            r.pass_s if speed is not None else None))
    return out


def link_hops(heard: Heard, addresses: list[str], nbytes: int,
              fallback: list[float] | None = None) -> list[list[float]]:
    """Seconds of a hop carrying ``nbytes`` from end i to end j (index ``len(addresses)``: the client), from
    the links ``heard`` measured: the client's link to a node counts both ways; a link between two
    nodes not measured yet counts as the mean of their links to the client; a client link not measured as
    ``fallback[i]`` (half the hello's round trip)."""
    n = len(addresses)
    client = []
    for i, a in enumerate(addresses):
        link = heard.link(CLIENT, a)
        client.append(link.hop_s(nbytes) if link else (fallback[i] if fallback else 0.0))
    m = [[0.0] * (n + 1) for _ in range(n + 1)]
    for i in range(n + 1):
        for j in range(n + 1):
            if i == j:
                continue
            if n in (i, j):
                m[i][j] = client[j if i == n else i]
                continue
            link = heard.link(addresses[i], addresses[j])
            m[i][j] = link.hop_s(nbytes) if link else (client[i] + client[j]) / 2
    return m


def plan_for(heard: Heard, plan: SlicingPlan, stages, placement: str = "planned", context: int | None = None,
             depth: int = 1) -> Placement | None:
    """The placement of ``plan``'s model on ``stages`` (None when a node has not reported, or the model is
    not on this machine to read its headers: the caller then splits evenly, as before reports)."""
    from diffuse.plan.encoders import plan_subject

    try:
        subject = plan_subject(plan)
    except (DiffuseError, OSError):
        return None
    # a pass as it comes: a language model's token, a diffusion stack's call (its tokens not known yet)
    caps = capacities(heard, stages, plan.compute_dtype, plan.model.content_hash, per_pass(subject))
    if caps is None:
        return None
    try:
        blocks = block_costs(subject, plan.stacks, plan.compute_dtype, context, heard.costs, plan.quantize)
        nbytes = pass_bytes(plan, subject, plan.compute_dtype)
    except (DiffuseError, OSError, ValueError):  # headers this client cannot read: the nodes read their own
        return None
    hops = link_hops(heard, [s.address for s in stages], nbytes, [c.hop_s for c in caps])
    if placement == "even":
        return even_placement(blocks, caps, links=hops, depth=depth)
    return place(blocks, caps, links=hops, depth=depth)


def route(heard: Heard, plan: SlicingPlan, stages, placement: str = "planned", depth: int = 1) -> SlicingPlan:
    """``plan`` routed over ``stages`` (nodes that load what they are asked for): slices planned from the
    nodes' reports and links (nodes given none stay out of the route; ``depth``: passes in flight at once,
    as ``place`` takes it), or even slices (``placement="even"``, or when a node has not reported), checked
    against their memory where they reported it."""
    if placement not in PLACEMENTS:
        raise DiffuseError(f"unknown placement {placement!r}: {' or '.join(PLACEMENTS)}")
    stages = list(stages)
    p = plan_for(heard, plan, stages, placement, depth=depth)
    if p is None or placement == "even":
        return plan.with_route(even_route(plan.stacks, [s.address for s in stages], [s.key for s in stages]))
    return plan.with_route(Stage(s.address, s.key, p.rows[i]) for i, s in enumerate(stages) if i in p.used)
