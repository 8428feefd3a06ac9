"""A node's stale activations for PipeFusion: per branch, per block, last step's values.

One ``StaleStack`` per stack per session, entered through ``run``. An uncut pass
(the first step of a branch) records, for every block this node holds, the
block's input over all N tokens (for the plain path) and its self-attention keys
and values (for the quick path). A cut pass runs each block on the patch's rows
only, by one of the attention paths in ``diffuse.pipefusion.node_attention``.

Each block's path is chosen on the first patch it sees in the session: plain and
quick both run, and quick is kept only if it agrees with plain to
``QUICK_TOLERANCE`` (relative); the buffers the other path would need are then
dropped, and the kept path answers that patch as it will answer every later one.
The choice is per block, so it does not depend on how the stack is split over
nodes or groups. Branches never share buffers; all of it goes with the session.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from diffuse.errors import DiffuseError
from diffuse.measure import relative_error
from diffuse.pipefusion.node_attention import AttentionBuffer, QuickUnsupported, attention_scope
from diffuse.pipefusion.policy import QUICK_TOLERANCE, why_uncut
from diffuse.plan.calltree import unflatten
from diffuse.plan.contracts import PATCHABLE, ReturnMap
from diffuse.plan.messages import Patch
from diffuse.wire.kinds import PassKind, kind
from collections.abc import Callable


def per_token_axis(t: torch.Tensor, tokens: int) -> int | None:
    """The axis of ``t`` that runs over the N tokens (not its last, which is channels), if any."""
    return next((k for k in range(t.dim() - 1) if t.shape[k] == tokens), None)


@dataclass
class PatchRun:
    """One call on its way through this node's blocks: what every attention path needs.
    ``values`` is the call's own list, updated in place: its stream slot always holds the
    input of the next block (the patch's rows on a cut pass)."""

    tree: dict
    values: list
    rmap: ReturnMap
    patch: Patch
    check: AttentionBuffer | None = None  # while a block's path is chosen: this step's keys and values
    _cut: list | None = field(default=None, repr=False)

    @property
    def stream(self) -> int:
        return self.rmap.streams[0]

    def cut(self) -> list:
        """The slots for a block run on the patch alone: per-token arguments (rotary tables: any
        tensor with an axis of N other than its last) cut to the patch once per pass, the stream as it stands."""
        if self._cut is None:
            pt, self._cut = self.patch, []
            for i, t in enumerate(self.values):
                ax = None if i == self.stream else per_token_axis(t, pt.tokens)
                self._cut.append(t if ax is None else t.narrow(ax, pt.lo, pt.count))
        self._cut[self.stream] = self.values[self.stream]
        return self._cut

    def stream_of(self, out) -> torch.Tensor:
        return out if self.rmap.single else out[self.rmap.output_of(self.stream)]

    def rows(self, out):
        """``out`` with its stream cut to the patch's rows; a fresh copy, so the next block sees the
        same memory layout on any split."""
        pt = self.patch
        if self.rmap.single:
            return out.narrow(pt.axis, pt.lo, pt.count).clone()
        return type(out)(o.narrow(pt.axis, pt.lo, pt.count).clone() if slot == self.stream and o is not None else o
                         for o, slot in zip(out, self.rmap.outputs))

    def advance(self, out) -> None:
        """Thread a block's answer on: its stream output is the next block's input."""
        s = self.stream_of(out)
        if s is not None:
            self.values[self.stream] = s


class StaleStack:
    """One stack's stale activations and attention paths within one session on one node."""

    def __init__(self, stack: str, attention: str = "auto"):
        self.stack = stack
        self.attention = attention  # "auto" (verify quick, keep it if it agrees) or "plain"
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}  # (branch, block) -> block input, all tokens
        self.kv: dict[tuple[int, int], AttentionBuffer] = {}  # (branch, block) -> self-attention K/V
        self.paths: dict[int, dict] = {}  # block -> {"path", "agreement", "why"}
        self.memo: dict[tuple[int, int], dict] = {}  # (branch, block) -> projections of repeated inputs (quick)
        self.branches: set[int] = set()
        self.patches = 0

    def run(self, blocks: list, tree: dict, values: list, rmap: ReturnMap, patch: Patch):
        """Run ``blocks`` ((index, module) pairs, in order) on one call; returns the last block's answer.
        ``values`` are the call's tensor slots, its stream at ``rmap.streams[0]``, updated in place."""
        p = PatchRun(tree, values, rmap, patch)
        if patch.uncut:
            return self._record(blocks, p)
        if patch.branch not in self.branches:
            raise DiffuseError(f"{self.stack}: a patch of branch {patch.branch} arrived before any uncut step of it; "
                               "the first step of every branch must run uncut")
        self.patches += 1
        out = None
        for idx, block in blocks:
            choice = self.paths.get(idx)
            out = self._choose(idx, block, p) if choice is None else PATHS[choice["path"]](self, idx, block, p)
            p.advance(out)
        return out

    def _record(self, blocks: list, p: PatchRun):
        branch = p.patch.branch
        self.branches.add(branch)
        out = None
        for idx, block in blocks:
            path = self.paths.get(idx, {}).get("path")
            if path != "quick":
                self.inputs[(branch, idx)] = p.values[p.stream]
            args, kwargs = unflatten(p.tree, p.values)
            if path == "plain" or self.attention == "plain":
                out = block(*args, **kwargs)
            else:  # recording calls the kernels with exactly their own arguments: not a bit changes
                buf = self.kv[(branch, idx)] = AttentionBuffer()
                with attention_scope(block, "record", p.patch.tokens, buf):
                    out = block(*args, **kwargs)
            p.advance(out)
        return out

    def _choose(self, idx: int, block, p: PatchRun):
        """The first patch this block sees: plain runs (recording this step's keys and values), then quick
        on them; quick is kept if it agrees. The answer that goes on is then the kept path's own, run on
        the branch's buffers as every later patch will be: which session or which branch happened to
        choose never changes a bit (branch groups choose once per group)."""
        if self.attention == "plain":
            self.paths[idx] = {"path": "plain", "agreement": None, "why": "plain path forced"}
            return PATHS["plain"](self, idx, block, p)
        fresh = p.check = AttentionBuffer()
        try:
            plain = PATHS["plain"](self, idx, block, p)
            try:
                err, why = relative_error(p.stream_of(PATHS["quick"](self, idx, block, p)), p.stream_of(plain)), ""
            except QuickUnsupported as exc:
                err, why = float("inf"), str(exc)
            except Exception as exc:  # a block that cannot run on a patch alone (reshapes to a grid, ...)
                err, why = float("inf"), f"{type(exc).__name__}: {exc}"
        finally:
            p.check = None
        del fresh
        if err <= QUICK_TOLERANCE:
            self.paths[idx] = {"path": "quick", "agreement": err, "why": ""}
            self._drop(idx, self.inputs)
            return PATHS["quick"](self, idx, block, p)
        why = why or f"quick differs from plain by {err:.2e} (relative), more than {QUICK_TOLERANCE:g}"
        self.paths[idx] = {"path": "plain", "agreement": err, "why": why}
        self._drop(idx, self.kv)
        return plain

    @staticmethod
    def _drop(idx: int, store: dict) -> None:
        for key in [k for k in store if k[1] == idx]:
            del store[key]

    def report(self) -> dict:
        nbytes = sum(t.numel() * t.element_size() for t in self.inputs.values())
        nbytes += sum(b.nbytes() for b in self.kv.values())
        nbytes += sum(o.numel() * o.element_size() for m in self.memo.values() for (_, _, o) in m.values()
                      if isinstance(o, torch.Tensor))
        return {"paths": {str(k): v for k, v in sorted(self.paths.items())}, "branches": len(self.branches),
                "patches": self.patches, "buffer_bytes": nbytes}


PATHS: dict[str, Callable] = {}  # name -> (stale, idx, block, pass) -> the block's answer for the patch's rows


def attention_path(name: str):
    """Register an attention path under ``name``."""
    def register(fn):
        PATHS[name] = fn
        return fn
    return register


@attention_path("plain")
def plain(stale: StaleStack, idx: int, block, p: PatchRun):
    """The whole buffered input with the patch's rows fresh; the patch's rows of the answer. While a
    path is being chosen (``p.check``), this step's keys and values are recorded for quick to read."""
    pt = p.patch
    buf = stale.inputs[(pt.branch, idx)]
    buf.narrow(pt.axis, pt.lo, pt.count).copy_(p.values[p.stream])
    full = list(p.values)
    full[p.stream] = buf
    args, kwargs = unflatten(p.tree, full)
    with nullcontext() if p.check is None else attention_scope(block, "record", pt.tokens, p.check):
        out = block(*args, **kwargs)
    return p.rows(out)


@attention_path("quick")
def quick(stale: StaleStack, idx: int, block, p: PatchRun):
    """The patch's rows alone against buffered keys and values (``p.check``'s while being chosen;
    then the linear projections of repeated inputs, like the text, are not reused either)."""
    pt = p.patch
    args, kwargs = unflatten(p.tree, p.cut())
    kv = p.check if p.check is not None else stale.kv[(pt.branch, idx)]
    memo = stale.memo.setdefault((pt.branch, idx), {}) if p.check is None else None
    with attention_scope(block, "quick", pt.tokens, kv, pt.lo, pt.count, memo) as scope:
        out = block(*args, **kwargs)
    if not scope.hits:
        raise QuickUnsupported("no self-attention over the tokens was found")
    return out


# ---- A PipeFusion pass on a node: its ``Patch`` run through the session's ``StaleStack`` for the stack.

MAX_BRANCHES = 4  # PipeFusion branches one stack keeps stale buffers for (guidance needs two)


@kind(Patch)
class StalePatches(PassKind):
    def check(self, sess, message, rmap) -> None:
        why = why_uncut(rmap, PATCHABLE, False)
        if why:
            raise DiffuseError(f"{message.stack!r}: {why}, so its steps are never cut into patches")

    def run(self, sess, p):
        stale = sess.stale.get(p.stack)
        if stale is None:
            stale = sess.stale[p.stack] = StaleStack(p.stack, sess.stage.attention)
        if p.part.branch not in stale.branches and len(stale.branches) >= MAX_BRANCHES:
            raise DiffuseError(f"{p.stack!r}: stale buffers are kept for {MAX_BRANCHES} branches at most")
        out = stale.run(p.blocks, p.tree, p.values, p.rmap, p.part)
        sess.count_buffers(stale_changed=True)
        return out
