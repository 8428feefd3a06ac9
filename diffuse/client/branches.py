"""Guidance branches on separate groups of nodes, computed at the same time.

A model that runs classifier-free guidance makes two passes per step, with and
without the prompt. With ``--nodes "A,B;C,D"`` (or ``--local-nodes 4
--branch-groups 2``) each group is a complete ring with its own session, and
``BranchRings`` stands where one ``Ring`` would, sending each branch to its group:

- Branches batched in one call (SD3, PixArt, Sana, LTX, ...: a batch of two
  whose text conditioning differs): the batch is cut into one part per group,
  the parts run at once, and the answers are joined again.
- Branches called one after the other (Wan): the calls of a step differ only in
  their conditioning; which inputs those are is learned from the first step (by
  content, never by family). From the second step on, the first call of a step
  also sends the call that will follow it to its own group, its conditioning
  taken from the same branch's call one step earlier. When that call comes, its
  inputs are compared with what was sent, tensor by tensor; equal, the answer
  already on its way is used (the same computation, placed elsewhere, so the
  bits are those of one ring); different, it is dropped and the call is sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffuse.plan.calltree import digest, flatten
from diffuse.client.channel import ChannelStats
from diffuse.errors import DiffuseError
from diffuse.firstblock.client import with_branch
from diffuse.pipefusion.client import BranchTracker, reassemble
from diffuse.client.ring import NodeStats, RingStats


def parse_groups(spec: str | list) -> list:
    """``"A,B;C,D"`` (or a list of such group strings, or of lists) as one node list per group."""
    if isinstance(spec, str):
        parts = [p for p in spec.split(";")]
    else:
        parts = list(spec)
    if any(isinstance(p, str) and not p.strip() for p in parts):
        raise DiffuseError("--nodes: an empty group between ';' separators")
    return parts


@dataclass
class _Sent:
    """A pass sent ahead for the call expected next, and what it was sent with."""

    group: int
    n: int
    stack: str
    tree: dict
    digests: list
    extra: dict | None = None


class _EveryRing:
    """``repair.listen(hook)`` for several rings: the hook runs (once) whichever ring is repaired."""

    def __init__(self, rings: list):
        self.rings = rings

    def listen(self, hook) -> None:
        for r in self.rings:
            r.repair.listen(hook)


class BranchRings:
    """Several rings (one per group of nodes) in place of one: the ``Ring`` calls a pipeline's stand-ins make."""

    def __init__(self, rings: list):
        self.rings = rings
        self._branches: dict[str, BranchTracker] = {}  # per stack: its branches, and which call comes next
        self._ahead: dict[str, _Sent] = {}
        self._n = 0
        self._sent: dict[int, list] = {}  # send number -> [(group, ring pass number)], and how to join
        self._kept: dict[tuple, object] = {}  # (group, ring pass number) -> an answer taken off its ring early
        self.ahead_used = 0  # calls answered by a pass sent ahead
        self.ahead_dropped = 0  # passes sent ahead whose call did not come as expected
        self.batches_cut = 0  # calls whose batch was cut between the groups

    # the parts of Ring the stand-ins and the run read
    @property
    def plan(self):
        return self.rings[0].plan

    @property
    def uncut(self) -> set[str]:
        return set().union(*(r.uncut for r in self.rings))

    @property
    def scheme(self) -> str:
        return self.rings[0].scheme

    @property
    def repairs(self) -> list[str]:
        return [line for r in self.rings for line in r.repairs]

    @property
    def repair(self) -> "_EveryRing":
        return _EveryRing(self.rings)

    @property
    def node_reports(self) -> list[dict]:
        return [rep for r in self.rings for rep in r.node_reports]

    @property
    def channel_stats(self) -> ChannelStats:
        out = ChannelStats()
        for r in self.rings:
            c = r.channel_stats
            out.passes += c.passes
            out.bytes_sent += c.bytes_sent
            out.bytes_received += c.bytes_received
            out.dropped += c.dropped
            out.messages += c.messages
            out.returns += c.returns
            out.stream_rows += c.stream_rows
            out.max_return_bytes = max(out.max_return_bytes, c.max_return_bytes)
            for stack, (skipped, calls) in c.reuse.items():
                t = out.reuse.setdefault(stack, [0, 0])
                t[0] += skipped
                t[1] += calls
            for stack, s in c.per_stack.items():
                t = out.per_stack.setdefault(stack, {"calls": 0, "bytes": []})
                t["calls"] += s["calls"]
                t["bytes"] += s["bytes"]
        return out

    @property
    def stats(self) -> RingStats:
        c = self.channel_stats
        nodes: list[NodeStats] = [n for r in self.rings for n in r.stats.nodes]
        return RingStats(c.passes, c.bytes_sent, c.bytes_received, nodes)

    def close(self, hurry: bool = False, tell_nodes: bool = True) -> None:
        self._ahead.clear()
        for r in self.rings:
            r.close(hurry, tell_nodes)

    # -- passes ----------------------------------------------------------------------------------------
    def call(self, stack: str, args: tuple, kwargs: dict, rmap):
        tree, tensors = flatten(args, kwargs)
        return self.receive(self.send(stack, tree, tensors, rmap))

    def call_layers(self, *args, **kwargs):
        raise DiffuseError("branch groups are for guidance passes of diffusion models; a language model's "
                           "passes go through one ring (give --nodes without ';')")

    def send(self, stack: str, tree: dict, tensors: list, rmap, patch=None, digests=None, extra=None) -> int:
        """As ``Ring.send``; ``extra``'s first-block cache tag names the branch as this group numbers it
        (``diffuse.firstblock``), so a pass sent ahead keeps its own branch's residuals."""
        digests = list(digests) if digests else [digest(t) for t in tensors]
        stream = rmap.streams[0]
        self._n += 1
        parts = self._cut(tensors, stream)
        for g in range(len(self.rings)):  # a ring answers in order: what was sent ahead there comes first
            self._take(g, but=stack if parts is None and patch is None else None)
        if parts is not None:  # branches batched in one call: a part of the batch per group
            self.batches_cut += 1
            self._sent[self._n] = [[(g, self.rings[g].send(stack, tree, part, rmap, patch, extra=extra))
                                    for g, part in parts], rmap]
            return self._n
        if patch is not None:  # patches of a branch's step go to that branch's group
            g = patch.branch % len(self.rings)
            self._sent[self._n] = [[(g, self.rings[g].send(stack, tree, tensors, rmap, patch, digests))], rmap]
            return self._n
        if not digests[stream]:  # left out by a caller that does not send it by digest; steps are told by it
            digests[stream] = digest(tensors[stream])
        branches = self._branches.setdefault(stack, BranchTracker())
        branch, _, _ = branches.identify(tensors, stream, digests)
        extra = with_branch(extra, branch)
        ahead = self._ahead.pop(stack, None)
        if ahead is not None:
            if ahead.group == branch % len(self.rings) and ahead.tree == tree and ahead.digests == digests \
                    and ahead.extra == extra:
                self.ahead_used += 1
                self._sent[self._n] = [[(ahead.group, ahead.n)], rmap]
                return self._n
            if self._kept.pop((ahead.group, ahead.n), None) is None:
                self.rings[ahead.group].receive(ahead.n)  # its answer is due before any later one on that ring
            self.ahead_dropped += 1
        g = branch % len(self.rings)
        self._sent[self._n] = [[(g, self.rings[g].send(stack, tree, tensors, rmap, None, digests, extra))], rmap]
        nxt = branches.expected_after(branch)
        if nxt is not None and nxt % len(self.rings) != g:
            guess, guess_digests = branches.guess(nxt, tensors, digests)
            h = nxt % len(self.rings)
            guess_extra = with_branch(extra, nxt)
            self._ahead[stack] = _Sent(h, self.rings[h].send(stack, tree, guess, rmap, None, guess_digests, guess_extra),
                                       stack, tree, guess_digests, guess_extra)
        return self._n

    def _take(self, g: int, but: str | None) -> None:
        """Receive now, and keep for their calls, the answers of passes sent ahead on ring ``g`` for stacks
        other than ``but`` (whose own is claimed or dropped by the call being sent)."""
        for stack, ahead in self._ahead.items():
            if stack != but and ahead.group == g and (g, ahead.n) not in self._kept:
                self._kept[(g, ahead.n)] = self.rings[g].receive(ahead.n)

    def receive(self, n: int):
        parts, rmap = self._sent.pop(n)
        answers = [self._kept.pop((g, seq)) if (g, seq) in self._kept else self.rings[g].receive(seq)
                   for g, seq in parts]
        return answers[0] if len(answers) == 1 else reassemble(answers, 0, rmap)

    def _cut(self, tensors: list, stream: int):
        """One part of the batch per group when the call carries several branches side by side (the batch
        divides evenly, and some input other than the hidden states differs between the parts); None if not."""
        x, g = tensors[stream], len(self.rings)
        if x.dim() < 2 or x.shape[0] < g or x.shape[0] % g:
            return None
        b = x.shape[0]
        rows = b // g
        batched = [i for i, t in enumerate(tensors) if t.dim() >= 1 and t.shape[0] == b]
        differ = any(not torch.equal(tensors[i][:rows], tensors[i][k * rows:(k + 1) * rows])
                     for i in batched if i != stream for k in range(1, g))
        if not differ:
            return None
        parts = []
        for k in range(g):
            part = [t[k * rows:(k + 1) * rows] if i in batched else t for i, t in enumerate(tensors)]
            parts.append((k, part))
        return parts
