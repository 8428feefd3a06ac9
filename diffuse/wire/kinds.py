"""How a node runs a pass: one registered kind per type of part (``diffuse.wire.passes``).

A kind is a small class registered for one part type with ``@kind(PartType)``;
the session (``diffuse.node.stage.StageSession``) looks it up by the type of the part
a call carries and asks it, in order, to ``check`` the call against what the
session remembers, ``prepare`` it (after its tensors are resolved), ``run`` it
through this node's blocks, and, on the stack's last node, make the ``answer``.
Built in: the plain loop (``Whole``, here), PipeFusion's stale stack
(``Patch``, ``diffuse.pipefusion.node``), the first-block cache (``Reuse``,
``diffuse.firstblock``) and a language model's layers with their cache, tail
and sampling (``LayerPass``, ``diffuse.lm.node_layers``).
"""

from __future__ import annotations

from diffuse.plan.calltree import thread_outputs, unflatten
from diffuse.errors import DiffuseError
from diffuse.wire.passes import Whole

KINDS: dict[type, "PassKind"] = {}


def kind(part_type: type):
    """Class decorator: the decorated ``PassKind`` runs passes whose part is a ``part_type``."""
    def register(cls):
        KINDS[part_type] = cls()
        return cls

    return register


def kind_for(part) -> "PassKind":
    found = KINDS.get(type(part))
    if found is None:
        raise DiffuseError(f"this node runs no pass of kind {type(part).__name__}")
    return found


class PassKind:
    """What one kind of pass does on a node; every step but ``run`` does nothing by default. ``sess`` is the
    ``StageSession``, ``p`` the prepared pass (``diffuse.node.stage.Prepared``), whose ``part`` a kind may replace
    with what the next hop is to see."""

    def check(self, sess, message, rmap) -> None:
        """Refuse a call that does not fit what the session remembers (``rmap``: the stack's return map)."""

    def prepare(self, sess, p) -> None:
        """Work on the call's slots before it runs (a language model's embedding, its cache)."""

    def run(self, sess, p):
        """Thread ``p.values`` through ``p.blocks``; the last block's output."""
        raise NotImplementedError

    def answer(self, sess, p, out) -> tuple:
        """On the stack's last node: (what the answer carries, its ``skipped`` or None)."""
        return out, None


def run_blocks(blocks: list, tree: dict, values: list, rmap, layer_trees: dict | None = None, cache=None):
    """Every block in order, each called as its call plan says (``layer_trees``: a layer's own where it has one),
    its output threaded into ``values``; the last block's output."""
    out = None
    for i, block in blocks:
        args, kwargs = unflatten(layer_trees.get(str(i), tree) if layer_trees else tree, values, cache)
        out = block(*args, **kwargs)
        thread_outputs(values, out, rmap)
    return out


@kind(Whole)
class PlainLoop(PassKind):
    """A plain call: every block this node holds, in order."""

    def run(self, sess, p):
        return run_blocks(p.blocks, p.tree, p.values, p.rmap)
