"""The first-block cache's client half: each call tagged with its branch and threshold, and what the run summary says of the steps the nodes skipped."""

from __future__ import annotations

from dataclasses import replace

from diffuse.plan.calltree import digest
from diffuse.wire.passes import Reuse


class CacheTagger:
    """Tags a client's calls into whole-step stacks with the threshold, their branch and whether the nodes
    must compute in full (the first call of each branch after a repair)."""

    def __init__(self, threshold: float, ring=None):
        self.threshold = threshold
        self.trackers: dict = {}
        self._since_repair: set | None = None  # (stack, branch) tagged fresh since the last repair
        if ring is not None and hasattr(ring, "repair"):
            ring.repair.listen(self.repaired)

    def repaired(self) -> None:
        self._since_repair = set()

    def tag(self, stack: str, tensors: list, stream: int) -> tuple[Reuse, list]:
        """(the call's part, the tensors' digests with the stream's left out) for one call."""
        from diffuse.pipefusion.client import BranchTracker

        digests = [b"" if i == stream else digest(t) for i, t in enumerate(tensors)]
        branch, _, _ = self.trackers.setdefault(stack, BranchTracker()).identify(tensors, stream, digests)
        fresh = self._since_repair is not None and (stack, branch) not in self._since_repair
        if fresh:
            self._since_repair.add((stack, branch))
        return Reuse(self.threshold, branch, fresh), digests


def with_branch(part, branch: int):
    """``part`` naming ``branch`` if it is a reuse tag (a group of nodes numbers the branches it sees itself)."""
    return replace(part, branch=branch) if isinstance(part, Reuse) else part


def counts(stats) -> dict:
    """Per stack: calls tagged and calls skipped, from a ``ChannelStats``."""
    return {stack: {"skipped": s, "calls": c} for stack, (s, c) in sorted(stats.reuse.items())}


def summary_line(per_stack: dict, threshold: float) -> str:
    skipped = sum(v["skipped"] for v in per_stack.values())
    calls = sum(v["calls"] for v in per_stack.values())
    return f"first-block cache: skipped {skipped} of {calls} calls at threshold {threshold:g}"
