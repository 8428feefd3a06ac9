"""The first-block cache's node half: the residuals a node keeps and the pass kind that skips a step.

At each step of a diffusion stack called whole, the node holding block 0 runs
that block and compares its residual (output minus input of the main stream)
with the one it kept at the last step it computed in full for the same branch:
``mean|r - r_prev| / mean|r_prev|``. Below ``T`` the rest of the stack is not
run: every node adds the residual its own slice made at that last full step
(what its blocks added to each stream) and hands on, so a skipped step costs a
subtraction and an addition everywhere. Otherwise every block runs, and each
node keeps its slice's new residuals. ``r_prev`` changes only on full steps, so
drift is bounded by ``T`` against the last step computed (the rule of the known
first-block cache technique, applied per node).

The client tags each call with a ``Reuse`` part (``diffuse.wire.passes``; on the wire
``{"reuse": {"t": T, "branch": b, "fresh": bool}}``):
``b`` tells guidance branches apart (``diffuse.pipefusion.client.BranchTracker``), so
each branch decides for itself; ``fresh`` asks for a full step (after a repair,
nodes new to the session hold nothing). The block-0 node marks the call
``skip`` for the next hops; the last node's result says ``skipped``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from diffuse.plan.calltree import thread_outputs, unflatten
from diffuse.errors import DiffuseError
from diffuse.wire.passes import Reuse
from diffuse.plan.contracts import ReturnMap

from diffuse.wire.kinds import PassKind, kind

MAX_BRANCHES = 4  # branches one stack keeps residuals for (guidance needs two)
_STREAM = object()  # where the remembered answer held a stream tensor


def relative_change(r: torch.Tensor, prev: torch.Tensor) -> float:
    """mean|r - prev| / mean|prev|, in float32 (inf where prev is all zeros)."""
    r, prev = r.float(), prev.float()
    return float((r - prev).abs().mean() / prev.abs().mean())


# --------------------------------------------------------------------------- the client


# --------------------------------------------------------------------------- a node


@dataclass
class _Kept:
    """What one node kept of a branch's last full step."""

    first: torch.Tensor | None  # block 0's residual of the main stream (the node holding block 0 only)
    rest: dict  # stream slot -> what this node's blocks (after block 0) added to it
    answer: list | None  # the last block's return value, its stream tensors marked (the last node only)
    single: bool = True

    @property
    def nbytes(self) -> int:
        ts = [self.first, *self.rest.values(), *(self.answer or ())]
        return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))

    def answer_with(self, values: list, rmap: ReturnMap):
        """The last block's return value as a full step returned it, its streams replaced by ``values``."""
        if self.single:
            return values[rmap.outputs[0]]
        return tuple(values[slot] if kept is _STREAM else kept for kept, slot in zip(self.answer, rmap.outputs))


@dataclass
class NodeResiduals:
    """One session's first-block cache on one node: per (stack, branch), what its last full step left."""

    kept: dict = field(default_factory=dict)
    skipped: int = 0
    full: int = 0

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes for k in self.kept.values())

    def run(self, p, last: bool):
        """Thread the prepared pass ``p``'s values (``diffuse.node.stage.Prepared``) through this node's blocks (a whole
        step) or reuse its residuals; returns (the last block's answer, whether the step was skipped). The node
        holding block 0 decides; others follow ``skip``, as the previous hop decided. ``last``: this node holds
        the stack's last block."""
        stack, blocks, tree, values, rmap, reuse = p.stack, p.blocks, p.tree, p.values, p.rmap, p.part
        holds_first, skip, where = p.sl.start == 0, bool(reuse.skip), str(p.sl)
        key = (stack, reuse.branch)
        held = self.kept.get(key)
        streams = rmap.streams
        out = None
        first_residual = None
        rest = blocks
        if holds_first:
            main = streams[0]
            x0 = values[main]
            args, kwargs = unflatten(tree, values)
            out = blocks[0][1](*args, **kwargs)
            thread_outputs(values, out, rmap)
            first_residual = values[main] - x0
            skip = not reuse.fresh and held is not None and held.first is not None \
                and relative_change(first_residual, held.first) < reuse.threshold
            rest = blocks[1:]
        if skip:
            if rest:
                if held is None or set(held.rest) != set(streams) or (last and held.answer is None):
                    raise DiffuseError(f"the node holding {where} has no residual of branch {reuse.branch} to reuse "
                                       "in a skipped step (its session lost them): run again")
                for s in streams:
                    values[s] = values[s] + held.rest[s]
                out = held.answer_with(values, rmap) if last else None
            self.skipped += 1
            return out, True
        start = {s: values[s] for s in streams}
        for _, block in rest:
            args, kwargs = unflatten(tree, values)
            out = block(*args, **kwargs)
            thread_outputs(values, out, rmap)
        if key not in self.kept and sum(1 for k in self.kept if k[0] == stack) >= MAX_BRANCHES:
            raise DiffuseError(f"{stack!r}: residuals are kept for {MAX_BRANCHES} branches at most")
        answer = None
        if last:  # its shape, to answer a skipped step as the last block would have
            answer = [] if rmap.single else [_STREAM if slot is not None and o is not None else o
                                             for o, slot in zip(out, rmap.outputs)]
        self.kept[key] = _Kept(first_residual, {s: values[s] - start[s] for s in streams} if rest else {},
                               answer, rmap.single)
        self.full += 1
        return out, False

    def report(self) -> dict:
        return {"skipped": self.skipped, "full": self.full, "bytes": self.nbytes}


@kind(Reuse)
class FirstBlockCache(PassKind):
    """A whole step tagged for the first-block cache: skipped, or run and kept (``NodeResiduals``)."""

    def run(self, sess, p):
        out, skipped = sess.residuals.run(p, last=p.sl.stop == sess.store.stacks[p.stack].length)
        p.part = replace(p.part, skip=skipped)
        sess.count_buffers(stale_changed=True)
        return out

    def answer(self, sess, p, out) -> tuple:
        return out, p.part.skip
