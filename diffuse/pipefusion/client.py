"""PipeFusion on the client: cutting a stack's hidden states into patches and telling branches apart.

A patchable stack carries one stream (the return map's single stream slot). Its
token axis is found by shape; the stream is cut into P contiguous token ranges,
sent into the ring back to back, and the answers are put back together. The
first step of each branch runs uncut, because nodes have nothing to borrow from
yet; every later step of that branch is cut.

Branches (classifier-free guidance done as separate calls) are told apart by
their text conditioning, found without knowing which argument it is: two calls
that carry the same hidden states belong to the same step, so the non-stream
tensors on which they differ are the conditioning that names a branch. A later
call belongs to the branch whose conditioning it repeats. A guidance batch of
two in one call is one branch whose buffers hold both rows, which never mix.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from diffuse.plan.calltree import digest
from diffuse.errors import Repaired
from diffuse.plan.contracts import ReturnMap, split_evenly
from diffuse.plan.messages import Patch
from diffuse.pipefusion.policy import QUICK_TOLERANCE


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
    """``patches`` contiguous token ranges covering [0, tokens); fewer if there are fewer tokens,
    which is why a run reports the patches it used, not the ones it asked for.

    >>> patch_ranges(10, 3), patch_ranges(2, 4)
    ([(0, 4), (4, 7), (7, 10)], [(0, 1), (1, 2)])
    """
    return split_evenly(tokens, max(1, min(patches, tokens)))


class BranchTracker:
    """Which branch a call into one stack belongs to, and whether it is that branch's first step; and, from
    the order the branches came in last step, which call should come next and with what inputs."""

    def __init__(self):
        self.branches: list[list[bytes]] = []  # each branch's non-stream digests at its first call
        self.step: list[tuple[bytes, list[bytes], int]] = []  # this step's calls: (stream, digests, branch)
        self.conditioning: set[int] = set()  # slots on which calls of one step differ
        self.steps = 0
        self.latest: dict[int, tuple[list, list[bytes]]] = {}  # branch -> its last call's (tensors, digests)
        self.last_order: list[int] = []  # the branches of the previous step, in the order they came

    def identify(self, tensors: list[torch.Tensor], stream: int, d: list[bytes] | None = None) -> tuple[int, int, bool]:
        """(branch, step number from 1, first step of this branch?) for one call; ``d``: the digests
        of its tensors where known (the stream's is not used)."""
        sd = digest(tensors[stream])
        d = list(d) if d else [digest(t) for t in tensors]
        d[stream] = b""
        same = [c for c in self.step if c[0] == sd]
        if not same:  # new hidden states: the scheduler has stepped
            self.last_order = [c[2] for c in self.step]
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
        self.latest[branch] = (list(tensors), d)
        return branch, self.steps, first

    def expected_after(self, branch: int) -> int | None:
        """The branch that followed ``branch`` last step, if this step has not had it yet (and the inputs that
        tell branches apart are known)."""
        order, taken = self.last_order, {c[2] for c in self.step}
        if not self.conditioning or branch not in order or order.index(branch) + 1 >= len(order):
            return None
        nxt = order[order.index(branch) + 1]
        return nxt if nxt not in taken and nxt in self.latest else None

    def guess(self, branch: int, tensors: list, digests: list[bytes]) -> tuple[list, list[bytes]]:
        """The call ``branch`` should make next in this step: this call's inputs, with the conditioning
        ``branch`` had at its last call."""
        own, own_d = self.latest[branch]
        return ([own[i] if i in self.conditioning else t for i, t in enumerate(tensors)],
                [own_d[i] if i in self.conditioning else x for i, x in enumerate(digests)])


def reassemble(answers: list, axis: int, rmap: ReturnMap):
    """The patches' answers (each the last block's return value) as one answer over all tokens."""
    if rmap.single:
        return torch.cat(answers, dim=axis)
    out = []
    for j, slot in enumerate(rmap.outputs):
        parts = [a[j] for a in answers]
        out.append(None if parts[0] is None else torch.cat(parts, dim=axis) if slot is not None else parts[0])
    return type(answers[0])(out)


@dataclass(frozen=True)
class _Call:
    """One call into a patchable stack, as the ring sends it: the stack, the call tree, its tensors, the
    stack's return map, and every input's digest (the stream's left empty)."""

    stack: str
    tree: dict
    tensors: list
    rmap: ReturnMap
    digests: list


@dataclass
class _Ahead:
    """The patches of a call sent before the pipeline made it: its branch, what it was sent with, the ring's
    numbers of its patches' passes, and their answers once taken off the ring before their call came."""

    branch: int
    step: int  # the step it was guessed for: calls of one step carry the same hidden states
    tree: dict
    digests: list  # the stream's is not among them; the step stands for it
    seqs: list
    answers: list | None = None


class Patcher:
    """Runs one-stream stacks' calls through a ring: uncut on a branch's first step, else as patches.

    The ring is used through ``send`` (returns a sequence number) and ``receive(seq)`` only. All
    patches of a step are sent before any answer is awaited, so each node works on one patch while
    the next node works on the one before. ``calls`` counts uncut and cut calls; ``used`` says per
    stack how many patches were asked, the most actually used, and why fewer where they were.

    Guidance branches called one after the other (Wan) are sent ahead: once a cut call's patches are
    on their way, the call the next branch made after it last step is sent too, with this call's
    inputs and that branch's conditioning, so the first node starts on it while the last one
    finishes this call (and with branch groups, the other group works at the same time). When the
    call comes, its tree and every input's digest must equal what was sent; then the answers on
    their way are its answers (the same passes on the same buffers, so not a bit differs from
    sending it then). Otherwise they are received and dropped, and as the nodes' buffers of that
    branch now hold the guessed call's activations, its next call runs uncut, recording them anew.
    ``ahead`` counts calls answered that way, and passes sent ahead in vain.
    """

    def __init__(self, ring, patches: int, ahead: bool = True):
        self.ring = ring
        self.patches = patches
        self.send_ahead = ahead
        self.trackers: dict[str, BranchTracker] = {}
        self._ahead: dict[str, _Ahead] = {}
        self._rerecord: set[tuple[str, int]] = set()  # (stack, branch) whose buffers a dropped guess overwrote
        if hasattr(ring, "repair"):  # nodes new to the session hold no stale buffers: every branch
            ring.repair.listen(self._forget)  # starts again with a whole step
        self.calls = {"uncut": 0, "cut": 0}
        self.ahead = {"used": 0, "dropped": 0}
        self.used: dict[str, dict] = {}

    def _forget(self) -> None:
        self.trackers.clear()  # passes sent ahead stay listed: asking the ring for them says whether they were lost
        self._rerecord.clear()

    def run(self, stack: str, tree: dict, tensors: list, rmap: ReturnMap):
        stream = rmap.streams[0]
        x = tensors[stream]
        axis = token_axis(x.shape)
        tokens = x.shape[axis]
        digests = [b"" if i == stream else digest(t) for i, t in enumerate(tensors)]  # once per call, not per patch
        tracker = self.trackers.setdefault(stack, BranchTracker())
        branch, step, first = tracker.identify(tensors, stream, digests)
        try:
            for other in [k for k in self._ahead if k != stack]:  # the ring answers in order: theirs first
                self._take(other)
            ahead = self._ahead.pop(stack, None)
            if ahead is not None:
                if (ahead.branch, ahead.step, ahead.tree, ahead.digests) == (branch, step, tree, digests) and not first:
                    self.ahead["used"] += 1
                    return self._cut(_Call(stack, tree, tensors, rmap, digests), tracker, branch, step, ahead)
                self._drop(stack, ahead)
            ranges = patch_ranges(tokens, self.patches)
            if first or (stack, branch) in self._rerecord or len(ranges) < 2:
                self._note(stack, 1 if first else len(ranges), tokens, len(ranges))
                self._rerecord.discard((stack, branch))
                self.calls["uncut"] += 1
                patch = Patch(branch, step, axis, tokens, uncut=True)
                return self.ring.receive(self.ring.send(stack, tree, tensors, rmap, patch, digests))
            return self._cut(_Call(stack, tree, tensors, rmap, digests), tracker, branch, step)
        except Repaired:  # a node was replaced mid-step (or a pass lost with the old route came up): every branch
            self.trackers.clear()  # starts again whole, this call first, on the repaired route
            return self.run(stack, tree, tensors, rmap)

    def settle(self) -> None:
        """Take whatever was sent ahead off the ring (kept for its call), before a call that does not go through
        here: the ring answers in order, so those answers come before that call's."""
        for stack in list(self._ahead):
            try:
                self._take(stack)
            except Repaired:  # lost with the old route; every branch starts whole again
                pass

    def _take(self, stack: str) -> None:
        """The answers of the passes sent ahead for ``stack``, received now and kept until its call comes (they
        are that call's answers if it matches); a pass a repair dropped raises Repaired, and is forgotten."""
        ahead = self._ahead[stack]
        if ahead.answers is None:
            try:
                ahead.answers = [self.ring.receive(seq) for seq in ahead.seqs]
            except Repaired:
                del self._ahead[stack]
                raise

    def _drop(self, stack: str, ahead: _Ahead) -> None:
        if ahead.answers is None:
            for seq in ahead.seqs:  # due before any later answer of the ring: received, and not used
                self.ring.receive(seq)
        self.ahead["dropped"] += 1
        self._rerecord.add((stack, ahead.branch))  # the nodes' buffers of that branch now hold the guess

    def _cut(self, call: _Call, tracker: BranchTracker, branch: int, step: int, ahead: _Ahead | None = None):
        """A cut call: its patches sent (unless they were, ``ahead``), then the next branch's call sent ahead
        where one is expected, then this call's answers awaited (or taken as kept) and joined."""
        stack, tensors, rmap = call.stack, call.tensors, call.rmap
        stream = rmap.streams[0]
        x = tensors[stream]
        axis = token_axis(x.shape)
        tokens = x.shape[axis]
        ranges = patch_ranges(tokens, self.patches)
        self._note(stack, len(ranges), tokens, len(ranges))
        self.calls["cut"] += 1
        seqs = ahead.seqs if ahead is not None else \
            self._send_cut(call, Patch(branch, step, axis, tokens), ranges)
        nxt = tracker.expected_after(branch) if self.send_ahead else None
        if nxt is not None and (stack, nxt) not in self._rerecord:
            guess, guess_digests = tracker.guess(nxt, tensors, call.digests)
            sent = self._send_cut(replace(call, tensors=guess, digests=guess_digests), Patch(nxt, step, axis, tokens),
                                  ranges)
            self._ahead[stack] = _Ahead(nxt, step, call.tree, guess_digests, sent)
        answers = ahead.answers if ahead is not None and ahead.answers is not None else \
            [self.ring.receive(seq) for seq in seqs]
        return reassemble(answers, axis, rmap)

    def _send_cut(self, call: _Call, patch: Patch, ranges: list) -> list[int]:
        stream = call.rmap.streams[0]
        x = call.tensors[stream]
        seqs = []
        for i, (lo, hi) in enumerate(ranges):
            cut = list(call.tensors)
            cut[stream] = x.narrow(patch.axis, lo, hi - lo)
            seqs.append(self.ring.send(call.stack, call.tree, cut, call.rmap, patch.cut(i, lo, hi), call.digests))
        return seqs

    def _note(self, stack: str, n: int, tokens: int, possible: int) -> None:
        u = self.used.setdefault(stack, {"asked": self.patches, "used": 0, "why": ""})
        if n >= u["used"]:
            u["used"] = n
            u["why"] = ("" if n == self.patches else f"only {tokens} tokens" if possible < self.patches
                        else "no step after a branch's first, which runs uncut")


# ---- What the run summary says about PipeFusion's attention, from the nodes' close reports.

def attention_paths(node_stats: list[dict]) -> dict[str, dict]:
    """Per stack, the attention path its blocks took, merged over the nodes' close reports:
    ``{"path": "quick" | "plain" | "mixed" | "none", "blocks": {i: ...}, "branches", "patches",
    "agreement": worst measured}``.

    >>> r = {"stale": {"blocks": {"paths": {"0": {"path": "quick", "agreement": 1e-6, "why": ""}},
    ...                           "branches": 2, "patches": 4, "buffer_bytes": 1}}}
    >>> m = attention_paths([r, None])["blocks"]; (m["path"], m["branches"], m["agreement"])
    ('quick', 2, 1e-06)
    """
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
    """One line per stack for the run summary (``paths`` from ``attention_paths``)."""
    lines = []
    for stack, m in paths.items():
        n = len(m["blocks"])
        agree = ("" if m["agreement"] is None
                 else f", quick vs plain {m['agreement']:.1e} (relative; kept under {QUICK_TOLERANCE:g})")
        if m["path"] == "mixed":
            quick = sum(b["path"] == "quick" for b in m["blocks"].values())
            lines.append(f"{stack}: quick attention in {quick} of {n} blocks, plain in the rest{agree}")
        else:
            why = next((b["why"] for b in m["blocks"].values() if b.get("why")), "")
            lines.append(f"{stack}: {m['path']} attention in all {n} blocks{agree}"
                         + (f" ({why})" if why and m["path"] == "plain" else ""))
    return lines
