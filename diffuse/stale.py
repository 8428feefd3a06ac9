"""A node's stale activations for PipeFusion: per branch, per block, last step's values.

One ``StaleStack`` per stack per session. A whole pass (the first step of a
branch) records, for every block this node holds, the block's input over all N
tokens (for the plain path) and its self-attention keys and values (for the
quick path). A patch pass then runs each block on rows [lo, lo+n) only:

- *plain*: the patch's fresh rows go into the block's input buffer, the block
  runs on the whole buffer, the patch's rows are taken out. Right for any block.
- *quick*: the block runs on the patch's rows alone, with per-token arguments
  (rotary tables: any tensor with an axis of length N other than its last) cut
  to the patch, and self-attention reads the buffered keys and values.

Each block's path is chosen on the first patch it sees in the session: both
run, and quick is kept only if it agrees with plain to ``QUICK_TOLERANCE``
(relative). The choice is per block, so it does not depend on how the stack is
split over nodes. Branches never share buffers; all of it goes with the session.
"""

from __future__ import annotations

import torch

from diffuse.attention import AttentionBuffer, attention_scope, relative_error
from diffuse.callplan import thread_outputs, unflatten
from diffuse.errors import DiffuseError

QUICK_TOLERANCE = 1e-4  # relative, ||quick - plain|| / ||plain|| on the first real patch


def per_token_axis(t: torch.Tensor, tokens: int) -> int | None:
    """The axis of ``t`` that runs over the N tokens (not its last, which is channels), if any."""
    for k in range(t.dim() - 1):
        if t.shape[k] == tokens:
            return k
    return None


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

    # -- whole passes ----------------------------------------------------------
    def run_whole(self, blocks, tree, values, rmap, stream, branch, tokens):
        self.branches.add(branch)
        out = None
        for idx, block in blocks:
            path = self.paths.get(idx, {}).get("path")
            if path != "quick":
                self.inputs[(branch, idx)] = values[stream]
            args, kwargs = unflatten(tree, values)
            if path == "plain" or self.attention == "plain":
                out = block(*args, **kwargs)
            else:  # recording calls the kernels with exactly their own arguments: not a bit changes
                buf = AttentionBuffer()
                with attention_scope(block, "record", tokens, buf):
                    out = block(*args, **kwargs)
                self.kv[(branch, idx)] = buf
            thread_outputs(values, out, rmap)
        return out

    # -- patch passes ----------------------------------------------------------
    def run_patch(self, blocks, tree, values, rmap, stream, branch, axis, lo, count, tokens):
        if branch not in self.branches:
            raise DiffuseError(f"{self.stack}: a patch of branch {branch} arrived before any whole step of it; "
                               "the first step of every branch must run whole")
        self.patches += 1
        cut = None  # the per-token arguments cut to the patch, made once for all blocks
        out = None
        for idx, block in blocks:
            choice = self.paths.get(idx)
            if choice is None:
                if cut is None:
                    cut = _cut(values, stream, tokens, lo, count)
                out = self._choose(idx, block, tree, values, cut, rmap, stream, branch, axis, lo, count, tokens)
            elif choice["path"] == "plain":
                out = self._plain(idx, block, tree, values, rmap, stream, branch, axis, lo, count)
            else:
                if cut is None:
                    cut = _cut(values, stream, tokens, lo, count)
                out, _ = self._quick(idx, block, tree, values, cut, stream, branch, lo, count, tokens)
            thread_outputs(values, out, rmap)
            if cut is not None:
                cut[stream] = values[stream]
        return out

    def _plain(self, idx, block, tree, values, rmap, stream, branch, axis, lo, count, record=None):
        buf = self.inputs[(branch, idx)]
        buf.narrow(axis, lo, count).copy_(values[stream])
        full = list(values)
        full[stream] = buf
        args, kwargs = unflatten(tree, full)
        if record is None:
            out = block(*args, **kwargs)
        else:
            with attention_scope(block, "record", buf.shape[axis], record):
                out = block(*args, **kwargs)
        # a fresh copy, so the next block sees the same memory layout on any split
        return _map_stream(out, rmap, stream, lambda t: t.narrow(axis, lo, count).clone())

    def _quick(self, idx, block, tree, cut_values, cut, stream, branch, lo, count, tokens, kv=None):
        cut[stream] = cut_values[stream]
        args, kwargs = unflatten(tree, cut)
        memo = self.memo.setdefault((branch, idx), {}) if kv is None else None  # not while verifying
        with attention_scope(block, "quick", tokens, kv or self.kv[(branch, idx)], lo, count, memo) as scope:
            out = block(*args, **kwargs)
        return out, scope.hits

    def _choose(self, idx, block, tree, values, cut, rmap, stream, branch, axis, lo, count, tokens):
        """The first patch this block sees: run plain (recording fresh K/V), then quick on them; compare."""
        if self.attention == "plain":
            self.paths[idx] = {"path": "plain", "agreement": None, "why": "plain path forced"}
            self._drop(idx, "kv")
            return self._plain(idx, block, tree, values, rmap, stream, branch, axis, lo, count)
        fresh = AttentionBuffer()
        plain = self._plain(idx, block, tree, values, rmap, stream, branch, axis, lo, count, record=fresh)
        try:
            quick, hits = self._quick(idx, block, tree, values, cut, stream, branch, lo, count, tokens, kv=fresh)
            err = relative_error(_stream_of(quick, rmap, stream), _stream_of(plain, rmap, stream))
            why = "" if hits else "no self-attention over the tokens was found"
        except Exception as exc:  # a block that cannot run on a patch alone (reshapes to a grid, ...)
            err, hits, why = float("inf"), 0, f"{type(exc).__name__}: {exc}"
        if hits and err <= QUICK_TOLERANCE:
            self.paths[idx] = {"path": "quick", "agreement": err, "why": ""}
            self.kv[(branch, idx)] = fresh  # this step's keys/values, the patch's rows among them
            self._drop(idx, "inputs")
        else:
            why = why or f"quick differs from plain by {err:.2e} (relative), more than {QUICK_TOLERANCE:g}"
            self.paths[idx] = {"path": "plain", "agreement": err, "why": why}
            self._drop(idx, "kv")
        return plain

    def _drop(self, idx: int, which: str) -> None:
        store = self.inputs if which == "inputs" else self.kv
        for key in [k for k in store if k[1] == idx]:
            del store[key]

    def report(self) -> dict:
        nbytes = sum(t.numel() * t.element_size() for t in self.inputs.values())
        nbytes += sum(b.nbytes() for b in self.kv.values())
        nbytes += sum(o.numel() * o.element_size() for m in self.memo.values() for (_, _, o) in m.values()
                      if isinstance(o, torch.Tensor))
        return {"paths": {str(k): v for k, v in sorted(self.paths.items())}, "branches": len(self.branches),
                "patches": self.patches, "buffer_bytes": nbytes}


def _cut(values: list, stream: int, tokens: int, lo: int, count: int) -> list:
    out = []
    for i, t in enumerate(values):
        ax = None if i == stream else per_token_axis(t, tokens)
        out.append(t if ax is None else t.narrow(ax, lo, count))
    return out


def _stream_of(out, rmap: dict, stream: int) -> torch.Tensor:
    if rmap["single"]:
        return out
    return out[rmap["outputs"].index(stream)]


def _map_stream(out, rmap: dict, stream: int, fn):
    if rmap["single"]:
        return fn(out)
    return type(out)(fn(o) if slot == stream and o is not None else o for o, slot in zip(out, rmap["outputs"]))
