"""A PipeFusion pass on a node: its ``Patch`` run through the session's ``StaleStack`` for the stack."""

from __future__ import annotations

from diffuse.errors import DiffuseError
from diffuse.pipefusion import why_uncut
from diffuse.pipefusion.buffers import StaleStack
from diffuse.plan.contracts import PATCHABLE, Patch
from diffuse.wire.kinds import PassKind, kind

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
