"""PipeFusion on the client: cutting a stack's hidden states into patches and telling branches apart.

A patchable stack carries one stream (the return map's single stream slot). Its
token axis is found by shape; the stream is cut into P contiguous token ranges,
sent into the ring back to back, and the answers are put back together. The
first step of each branch runs whole, because nodes have nothing to borrow from
yet; every later step of that branch is cut.

Branches (classifier-free guidance done as separate calls) are told apart by
their text conditioning, found without knowing which argument it is: two calls
that carry the same hidden states belong to the same step, so the non-stream
tensors on which they differ are the conditioning that names a branch. A later
call belongs to the branch whose conditioning it repeats. A guidance batch of
two in one call is one branch whose buffers hold both rows, which never mix.
"""

from __future__ import annotations

import os

import torch

from diffuse.callplan import digest
from diffuse.plan import split_evenly


def token_axis(shape) -> int:
    """The axis of a hidden-state stream that runs over tokens: the longest one that is
    not the last (channels), the later one on a tie (batch comes first).

    >>> token_axis((2, 256, 8)), token_axis((1, 12, 24)), token_axis((64, 32))
    (1, 1, 0)
    """
    dims = list(shape)[:-1] or [shape[0]]
    best = max(dims)
    return max(i for i, d in enumerate(dims) if d == best)


def patch_ranges(tokens: int, patches: int) -> list[tuple[int, int]]:
    """``patches`` contiguous token ranges covering [0, tokens) (fewer if there are fewer tokens)."""
    return split_evenly(tokens, max(1, min(patches, tokens)))


class BranchTracker:
    """Which branch a call into one stack belongs to, and whether it is that branch's first step."""

    def __init__(self):
        self.branches: list[list[bytes]] = []  # each branch's non-stream digests at its first call
        self.step: list[tuple[bytes, list[bytes], int]] = []  # this step's calls: (stream, digests, branch)
        self.conditioning: set[int] = set()  # slots on which calls of one step differ
        self.steps = 0

    def identify(self, tensors: list[torch.Tensor], stream: int, d: list[bytes] | None = None) -> tuple[int, int, bool]:
        """(branch, step number from 1, first step of this branch?) for one call; ``d``: the digests
        of its tensors where known (the stream's is not used)."""
        sd = digest(tensors[stream])
        d = list(d) if d else [digest(t) for t in tensors]
        d[stream] = b""
        same = [c for c in self.step if c[0] == sd]
        if not same:  # new hidden states: the scheduler has stepped
            self.step = []
            self.steps += 1
        for c in same:
            if len(c[1]) == len(d):
                self.conditioning |= {i for i, (a, b) in enumerate(zip(c[1], d)) if a != b}
        taken = {c[2] for c in self.step}
        branch = next((b for b, bd in enumerate(self.branches)
                       if b not in taken and len(bd) == len(d) and all(bd[i] == d[i] for i in self.conditioning)),
                      None)
        first = branch is None
        if first:
            branch = len(self.branches)
            self.branches.append(d)
        self.step.append((sd, d, branch))
        return branch, self.steps, first


def reassemble(answers: list, axis: int, rmap: dict):
    """The patches' answers (each the last block's return value) as one answer over all tokens."""
    if rmap["single"]:
        return torch.cat(answers, dim=axis)
    out = []
    for j, slot in enumerate(rmap["outputs"]):
        parts = [a[j] for a in answers]
        out.append(None if parts[0] is None else torch.cat(parts, dim=axis) if slot is not None else parts[0])
    return type(answers[0])(out)


class Patcher:
    """Runs one patchable stack's calls as patches through a ring (owned by the ``Splitter``)."""

    def __init__(self, ring, patches: int):
        self.ring = ring
        self.patches = patches
        self.trackers: dict[str, BranchTracker] = {}
        # test-only: one buffer for all branches, to show that sharing them changes the output
        self.share_branches = os.environ.get("DIFFUSE_SHARE_BRANCHES") == "1"
        self.calls = {"whole": 0, "patched": 0}

    def run(self, stack: str, tree: dict, tensors: list, rmap: dict):
        stream = rmap["streams"][0]
        x = tensors[stream]
        axis = token_axis(x.shape)
        tokens = x.shape[axis]
        digests = [b"" if i == stream else digest(t) for i, t in enumerate(tensors)]  # once per call, not per patch
        branch, step, first = self.trackers.setdefault(stack, BranchTracker()).identify(tensors, stream, digests)
        info = {"branch": 0 if self.share_branches else branch, "step": step, "axis": axis, "tokens": tokens}
        ranges = patch_ranges(tokens, self.patches)
        if first or len(ranges) < 2:
            self.calls["whole"] += 1
            return self.ring.call_flat(stack, tree, tensors, rmap, dict(info, whole=True), digests)
        self.calls["patched"] += 1
        answers = self.ring.call_patches(stack, tree, tensors, rmap, stream, axis, ranges, info, digests)
        return reassemble(answers, axis, rmap)


def attention_paths(node_stats: list[dict]) -> dict[str, dict]:
    """Per stack, the attention path its blocks took, merged over the nodes' close reports:
    ``{"path": "quick" | "plain" | "mixed", "blocks": {i: ...}, "agreement": worst measured}``."""
    merged: dict[str, dict] = {}
    for ns in node_stats:
        for stack, rep in ((ns or {}).get("stale") or {}).items():
            m = merged.setdefault(stack, {"blocks": {}, "branches": 0, "patches": 0})
            m["blocks"].update({int(k): v for k, v in rep["paths"].items()})
            m["branches"] = max(m["branches"], rep["branches"])
            m["patches"] = max(m["patches"], rep["patches"])
    for m in merged.values():
        kinds = {b["path"] for b in m["blocks"].values()}
        m["path"] = kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else "none")
        errs = [b["agreement"] for b in m["blocks"].values() if b.get("agreement") is not None]
        m["agreement"] = max(errs) if errs else None
        m["blocks"] = dict(sorted(m["blocks"].items()))
    return merged


def describe_paths(paths: dict[str, dict]) -> list[str]:
    """One line per stack for the run summary."""
    lines = []
    for stack, m in paths.items():
        n = len(m["blocks"])
        agree = "" if m["agreement"] is None else f", quick vs plain {m['agreement']:.1e} (relative; kept under 1e-4)"
        if m["path"] == "mixed":
            quick = sum(b["path"] == "quick" for b in m["blocks"].values())
            lines.append(f"{stack}: quick attention in {quick} of {n} blocks, plain in the rest{agree}")
        else:
            why = next((b["why"] for b in m["blocks"].values() if b.get("why")), "")
            lines.append(f"{stack}: {m['path']} attention in all {n} blocks{agree}" + (f" ({why})" if why and m["path"] == "plain" else ""))
    return lines
