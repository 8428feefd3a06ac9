"""The placement solver: contiguous runs of blocks, one per node, that fit every node's memory and make a pass as quick as it can be (``place``), or the even slices checked against the same memory (``even_placement``)."""

from __future__ import annotations
from diffuse.plan.needs import GIB
from diffuse.errors import DiffuseError
from diffuse.plan.contracts import Slice
from diffuse.plan.needs import BlockCost
from diffuse.plan.placement import Capacity
from diffuse.plan.placement import DoesNotFit
from diffuse.plan.placement import Placement
from diffuse.plan.placement import shortfall
from diffuse.plan.placement import rooms
import math
import statistics


SPEEDS_ALIKE = 1.25  # measured speeds within this factor of each other count alike: one busy machine measures


# the same node this far apart from one session to the next, and a placement should not swing with that
LEAVE_OUT = 0.10  # a node is left out of a route of passes one at a time only where that saves this share of the


LEAVE_OUT_S = 0.005  # pass's compute (at the median speed) and this many seconds: listed nodes are used, unless one


def _alike(speeds: list[float]) -> dict[float, float]:
    """Each speed, with those within ``SPEEDS_ALIKE`` of the quickest of its group set to the group's median."""
    groups: list[list[float]] = []
    for s in sorted(set(speeds)):
        if groups and s <= groups[-1][0] * SPEEDS_ALIKE:
            groups[-1].append(s)
        else:
            groups.append([s])
    return {s: statistics.median(g) for g in groups for s in g}


def _around(nodes: list[Capacity]) -> list[float]:
    """Each node's seconds a pass spends on it besides its blocks: as measured, else the median of those
    measured (0 when none is)."""
    known = [c.pass_s for c in nodes if c.pass_s is not None]
    median = statistics.median(known) if known else 0.0
    return [c.pass_s if c.pass_s is not None else median for c in nodes]


def _speeds(nodes: list[Capacity]) -> tuple[list[float], list[bool], bool]:
    measured = [c.speed is not None and c.speed > 0 for c in nodes]
    known = [c.speed for c, m in zip(nodes, measured) if m]
    median = statistics.median(known) if known else 1.0
    snap = _alike(known)
    return [snap[c.speed] if m else median for c, m in zip(nodes, measured)], measured, bool(known)


class _Costs:
    """Prefix sums over the blocks, for what a run of them costs a node in time and in memory."""

    def __init__(self, blocks: list[BlockCost], nodes: list[Capacity], speeds: list[float], tokens: int):
        self.blocks, self.nodes, self.speeds, self.tokens = blocks, nodes, speeds, tokens
        self.around = _around(nodes) if any(c.speed for c in nodes) else [0.0] * len(nodes)
        self.room = rooms(nodes)
        self.W, self.S = [0], [0]  # compute in weight bytes; memory besides the blocks' weights
        for b in blocks:
            self.W.append(self.W[-1] + b.compute_bytes)
            self.S.append(self.S[-1] + b.held_bytes)
        self.fresh = []  # per node: prefix sums of the weight bytes it does not hold yet
        for c in nodes:
            p = [0]
            for b in blocks:
                p.append(p[-1] + (0 if (b.stack, b.index) in c.holds else b.weight_bytes))
            self.fresh.append(p)

    def cost(self, i: int, a: int, b: int) -> float:
        """Seconds node ``i`` takes a pass to run blocks [a, b): their weights at its speed, and what a pass
        costs it besides (none where it runs no block)."""
        return self.speeds[i] * (self.W[b] - self.W[a]) / GIB * self.tokens + (self.around[i] if b > a else 0.0)

    def need(self, i: int, a: int, b: int) -> int:
        return self.fresh[i][b] - self.fresh[i][a] + self.S[b] - self.S[a]

    def fits(self, i: int, a: int, b: int) -> bool:
        return self.room[i] is None or self.need(i, a, b) <= self.room[i]


def _hop_matrix(n: int, nodes: list[Capacity], links: list[list[float]] | None) -> list[list[float]]:
    """Seconds of a hop from end i to end j (index n: the client): ``links`` where given, else the mean of
    the nodes' own ``hop_s``."""
    if links is not None:
        return links
    hop = statistics.mean(c.hop_s for c in nodes)
    return [[hop] * (n + 1) for _ in range(n + 1)]


def place(blocks: list[BlockCost], nodes: list[Capacity], tokens: int = 1, links: list[list[float]] | None = None,
          depth: int = 1) -> Placement:
    """Contiguous runs of ``blocks`` (every stack's blocks in plan order), one per node in the given order,
    that fit every node's room. ``depth`` 1 (passes one after another: a language model's tokens, a diffusion
    step at one patch): the least time for a pass, every used node's share plus every hop (``links[i][j]``:
    seconds from end i to end j, index ``len(nodes)`` the client; a slow link between two nodes is then
    worth one fewer hop), a node left out only where that saves ``LEAVE_OUT`` of the compute; among those
    as quick, the most even. ``depth`` > 1 (patches in flight): the least slowest share, every node that can
    take a block taking one; among those, the least total compute, then the most even. Raises
    ``DoesNotFit`` with the shortfall in GiB."""
    if not nodes:
        raise DiffuseError("no node to place the model on")
    if not blocks:
        raise DiffuseError("the model has no block to place")
    speeds, measured, any_measured = _speeds(nodes)
    t = _Costs(blocks, nodes, speeds, tokens)
    n = len(nodes)
    hop = _hop_matrix(n, nodes, links) if any_measured else [[0.0] * (n + 1) for _ in range(n + 1)]
    ranges = _one_at_a_time(t, hop) if depth <= 1 else _in_flight(t)
    return _placement(t, ranges, measured, hop, depth)


def _better(v: tuple, w: tuple | None) -> bool:
    """``v`` before ``w``: the float parts in order, each to a relative 1e-9, then the rest as they compare."""
    if w is None:
        return True
    for x, y in zip(v[:2], w[:2]):
        if x < y - 1e-9 * max(1.0, abs(y)):
            return True
        if x > y + 1e-9 * max(1.0, abs(y)):
            return False
    return v[2:] < w[2:]


def leave_out_s(speeds: list[float], weight_bytes: int, tokens: int = 1, timed: bool = True) -> float:
    """What leaving a node out must save a pass (see ``LEAVE_OUT``); ``timed``: the speeds are seconds
    (measured), not all counted alike."""
    share = LEAVE_OUT * statistics.median(speeds) * weight_bytes / GIB * tokens
    return max(share, LEAVE_OUT_S) if timed else share


def _one_at_a_time(t: _Costs, hop: list[list[float]]) -> list[tuple[int, int]]:
    """Ranges per node for passes one after another (see ``place``): (time with hops and any left-out
    penalty, sum of squared shares, earlier runs longer), over states (blocks placed, last node used)."""
    n, L = len(t.nodes), len(t.blocks)
    penalty = leave_out_s(t.speeds, t.W[L], t.tokens, any(h for row in hop for h in row))
    best: dict[tuple[int, int], tuple] = {(0, -1): (0.0, 0.0, ())}
    back: list[dict] = []
    for i in range(n):
        nxt: dict[tuple[int, int], tuple] = {}
        bk: dict[tuple[int, int], tuple] = {}
        for (a, j), v in best.items():
            options = [((a, j), (v[0] + penalty, v[1], v[2]), None)]  # node i left out
            for b in range(a + 1, L + 1):
                if not t.fits(i, a, b):
                    break
                c = t.cost(i, a, b)
                options.append(((b, i), (v[0] + c + hop[j if j >= 0 else n][i], v[1] + c * c, v[2] + (a - b,)),
                                (a, b)))
            for state, value, run in options:
                if _better(value, nxt.get(state)):
                    nxt[state], bk[state] = value, ((a, j), run)
        best = nxt
        back.append(bk)
    end = None
    for (b, j), v in best.items():
        if b == L and j >= 0:
            value = (v[0] + hop[j][n], v[1], v[2])
            if _better(value, end and end[0]):
                end = (value, (b, j))
    if end is None:
        raise shortfall(t.blocks, t.nodes, t.room)
    ranges: list[tuple[int, int]] = [(0, 0)] * n
    state = end[1]
    for i in range(n - 1, -1, -1):
        state, run = back[i][state]
        ranges[i] = run if run is not None else (state[0], state[0])
    return ranges


def _in_flight(t: _Costs) -> list[tuple[int, int]]:
    """Ranges per node for passes in flight at once (see ``place``)."""
    n, L = len(t.nodes), len(t.blocks)
    inf, tol = math.inf, 1e-12
    # phase 1: per number of nodes used, the least possible slowest share
    f = [[inf] * (L + 1) for _ in range(n + 1)]  # f[u][b]: blocks [0, b) on u of the nodes so far
    f[0][0] = 0.0
    for i in range(n):
        g = [row[:] for row in f]
        for u in range(i + 1):
            for a in range(L):
                if f[u][a] == inf:
                    continue
                for b in range(a + 1, L + 1):
                    if not t.fits(i, a, b):
                        break
                    v = max(f[u][a], t.cost(i, a, b))
                    if v < g[u + 1][b]:
                        g[u + 1][b] = v
        f = g
    options = [u for u in range(1, n + 1) if f[u][L] < inf]
    if not options:
        raise shortfall(t.blocks, t.nodes, t.room)
    u_star = max(options)  # every listed node that can take a block takes one: the user chose them
    return _least_total(t, u_star, f[u_star][L] * (1 + 1e-9) + tol)


def _least_total(t: _Costs, u_star: int, cap: float) -> list[tuple[int, int]]:
    """Under the slowest share ``cap``, on ``u_star`` nodes: the least total, then the least sum of squares;
    ties go to the placement whose earlier nodes take more (as even slices do)."""
    n, L, inf = len(t.nodes), len(t.blocks), math.inf
    zero = (inf, inf)
    h = [[zero] * (L + 1) for _ in range(u_star + 1)]
    h[0][0] = (0.0, 0.0)
    back: list[list[list]] = []
    for i in range(n):
        g = [row[:] for row in h]
        bk = [[None] * (L + 1) for _ in range(u_star + 1)]  # (u, a) it came from; None: node i unused
        for u in range(min(i, u_star - 1), -1, -1):
            for b in range(L, 0, -1):
                for a in range(b - 1, -1, -1):
                    if h[u][a][0] == inf:
                        continue
                    if not t.fits(i, a, b):
                        break
                    c = t.cost(i, a, b)
                    if c > cap:
                        break
                    v = (h[u][a][0] + c, h[u][a][1] + c * c)
                    if _less(v, g[u + 1][b]):
                        g[u + 1][b] = v
                        bk[u + 1][b] = (u, a)
        back.append(bk)
        h = g
    ranges: list[tuple[int, int]] = [(0, 0)] * n
    u, b = u_star, L
    for i in range(n - 1, -1, -1):
        step = back[i][u][b]
        if step is None:
            ranges[i] = (b, b)
        else:
            ranges[i] = (step[1], b)
            u, b = step
    return ranges


def _route_hops(ranges: list[tuple[int, int]], hop: list[list[float]]) -> list[float]:
    """Each hop of the route the ranges make: the client to the first used node, between used nodes, home."""
    n = len(ranges)
    used = [i for i, (a, b) in enumerate(ranges) if b > a]
    ends = [n, *used, n]
    return [hop[x][y] for x, y in zip(ends, ends[1:])]


def _placement(t: _Costs, ranges: list[tuple[int, int]], measured: list[bool], hop: list[list[float]],
               depth: int) -> Placement:
    blocks, nodes, L = t.blocks, t.nodes, len(t.blocks)
    need = [t.need(i, a, b) for i, (a, b) in enumerate(ranges)]
    shares = [t.cost(i, a, b) for i, (a, b) in enumerate(ranges)]
    notes = []
    for i, c in enumerate(nodes):
        a, b = ranges[i]
        if b == a:
            notes.append(f"{c.name} holds nothing: it {_why_none(t, i, a, depth)}")
        elif t.room[i] is not None and b < L and not t.fits(i, a, b + 1) and shares[i] < max(shares) * (1 - 1e-9):
            notes.append(f"{c.name} holds {b - a} block(s), as many as its memory allows")
    size = [sum(blk.weight_bytes + blk.held_bytes for blk in blocks[a:b]) for a, b in ranges]
    hops = _route_hops(ranges, hop)
    return Placement(list(nodes), list(blocks), _rows(blocks, ranges), t.room, need, size, t.speeds, measured,
                     shares, statistics.mean(hops), notes, t.tokens, hops, depth)


def _why_none(t: _Costs, i: int, a: int, depth: int) -> str:
    one = min(blk.weight_bytes + blk.held_bytes for blk in t.blocks)
    if t.room[i] is not None and t.room[i] < one:
        return "has room for no block"
    if depth > 1 or len(t.blocks) < len(t.nodes) or (a < len(t.blocks) and not t.fits(i, a, a + 1)):
        return "is one node too many for the blocks there are, or has no room where its turn comes"
    return "would make a pass slower than the others make it without it (its speed, or its links)"


def _stacks_of(blocks: list[BlockCost]) -> list[tuple[str, int]]:
    """(stack, length) in the order the blocks list them."""
    out: dict[str, int] = {}
    for b in blocks:
        out[b.stack] = out.get(b.stack, 0) + 1
    return list(out.items())


def _rows(blocks: list[BlockCost], ranges: list[tuple[int, int]]) -> list[tuple[Slice, ...]]:
    """Per node, its run of the blocks as a slice of every stack (empty where the run has none of it)."""
    out = []
    for a, b in ranges:
        row, off = [], 0
        for stack, length in _stacks_of(blocks):
            lo, hi = min(max(a - off, 0), length), min(max(b - off, 0), length)
            row.append(Slice(stack, lo, max(lo, hi)))
            off += length
        out.append(tuple(row))
    return out


def _less(v: tuple, w: tuple) -> bool:
    """``v`` before ``w``, comparing in order, each to a relative 1e-9 (sums of the same costs in another order)."""
    for x, y in zip(v, w):
        if y == math.inf:
            return x < y
        if x < y - 1e-9 * max(1.0, abs(y)):
            return True
        if x > y + 1e-9 * max(1.0, abs(y)):
            return False
    return False


def even_placement(blocks: list[BlockCost], nodes: list[Capacity], tokens: int = 1,
                   links: list[list[float]] | None = None, depth: int = 1) -> Placement:
    """Even slices of every stack (as ``diffuse.plan.contracts.even_route`` cuts them), checked against the nodes'
    memory: refused, naming each node that would run short and by how much, when they do not fit."""
    from diffuse.plan.contracts import split_evenly

    speeds, measured, any_measured = _speeds(nodes)
    t = _Costs(blocks, nodes, speeds, tokens)
    rows = [tuple(Slice(stack, *split_evenly(length, len(nodes))[i]) for stack, length in _stacks_of(blocks))
            for i in range(len(nodes))]
    need, size, shares, short = [], [], [], []
    for i, c in enumerate(nodes):
        mine = [b for b in blocks for s in rows[i] if s.stack == b.stack and s.start <= b.index < s.stop]
        need.append(sum((0 if (b.stack, b.index) in c.holds else b.weight_bytes) + b.held_bytes for b in mine))
        size.append(sum(b.weight_bytes + b.held_bytes for b in mine))
        shares.append(speeds[i] * sum(b.compute_bytes for b in mine) / GIB * tokens
                      + (t.around[i] if mine else 0.0))
        if t.room[i] is not None and need[-1] > t.room[i]:
            short.append(f"{c.name} would take {need[-1] / GIB:.2f} GiB and has room for {t.room[i] / GIB:.2f} "
                         f"({(need[-1] - t.room[i]) / GIB:.2f} GiB short)")
    if short:
        raise DoesNotFit("even slices do not fit these nodes: " + "; ".join(short) +
                         " (the default placement plans the slices by memory)")
    n = len(nodes)
    hop = _hop_matrix(n, nodes, links) if any_measured else [[0.0] * (n + 1) for _ in range(n + 1)]
    ranges = [(0, 1) if any(not s.empty for s in row) else (0, 0) for row in rows]  # which nodes the route uses
    hops = _route_hops(ranges, hop)
    return Placement(list(nodes), list(blocks), rows, t.room, need, size, speeds, measured, shares,
                     statistics.mean(hops), [], tokens, hops, depth)


def placement_of(blocks: list[BlockCost], nodes: list[Capacity], rows, tokens: int = 1,
                 links: list[list[float]] | None = None, depth: int = 1) -> Placement:
    """A given placement (``rows``: per node its slices, as a route's stages hold them), costed as ``place``
    costs its own: what a bench predicts a route's pass takes."""
    offsets, off = {}, 0
    for stack, length in _stacks_of(blocks):
        offsets[stack] = off
        off += length
    ranges = []
    for row in rows:
        held = [(offsets[s.stack] + s.start, offsets[s.stack] + s.stop) for s in row if not s.empty]
        ranges.append((min(a for a, _ in held), max(b for _, b in held)) if held else (0, 0))
    speeds, measured, any_measured = _speeds(nodes)
    n = len(nodes)
    hop = _hop_matrix(n, nodes, links) if any_measured else [[0.0] * (n + 1) for _ in range(n + 1)]
    return _placement(_Costs(blocks, nodes, speeds, tokens), ranges, measured, hop, depth)
