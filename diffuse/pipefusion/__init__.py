"""PipeFusion (``--patches P > 1``): one-stream stacks run as pipelined token patches.

- ``cutting``: the client side. Finds the token axis, tells guidance branches
  apart, cuts each step after a branch's first into patches, sends them all
  into the ring before awaiting any, puts the answers back together.
- ``buffers``: the node side. Per session, per branch, per block, last step's
  activations (``StaleStack``), and each block's choice of attention path.
- ``attention``: the two attention paths (plain, quick) and the quick path's
  mechanism (buffered keys and values under scoped attention processors).
- ``stale``: the node's pass kind for a ``Patch`` (``diffuse.wire.kinds``).
- ``summary``: what the run summary says about the paths the nodes took.

``why_uncut`` is the one place that decides whether a stack may be cut at all.
"""

from __future__ import annotations

from diffuse.pipefusion.attention import PATHS, AttentionBuffer, QuickUnsupported, attention_path, attention_scope, \
    relative_error
from diffuse.pipefusion.buffers import QUICK_TOLERANCE, Pass, StaleStack
from diffuse.pipefusion.cutting import BranchTracker, Patcher, patch_ranges, reassemble, token_axis
from diffuse.pipefusion.summary import attention_paths, describe_paths
from diffuse.plan.contracts import PATCHABLE, UNCUT_STEPS, ReturnMap

__all__ = ["PATHS", "QUICK_TOLERANCE", "AttentionBuffer", "BranchTracker", "Pass", "Patcher", "QuickUnsupported",
           "StaleStack", "attention_path", "attention_paths", "attention_scope", "describe_paths", "patch_ranges",
           "reassemble", "relative_error", "token_axis", "why_uncut"]

TWO_STREAMS = "its blocks carry two streams (image and text side by side)"


def why_uncut(return_map: ReturnMap, policy: str, nodes_say: bool) -> str | None:
    """None if the stack may be cut into patches, else why its steps run uncut. Patches need one
    stream: with two (image and text side by side) the text would be cut with the picture.

    ``policy``: the plan's ``PATCHABLE`` or ``UNCUT_STEPS`` for the stack; ``nodes_say``: a node
    said at open that the stack's blocks carry two streams.

    >>> one = ReturnMap(single=True, outputs=[0], names=["args[0]"])
    >>> why_uncut(one, PATCHABLE, False) is None
    True
    >>> why_uncut(ReturnMap(False, [0, 3], ["args[0]", "encoder_hidden_states"]), PATCHABLE, False)
    'its blocks return 2 streams (args[0], encoder_hidden_states)'
    >>> why_uncut(one, UNCUT_STEPS, False)
    'the plan says its blocks carry two streams (image and text side by side)'
    """
    if policy not in (PATCHABLE, UNCUT_STEPS):
        raise ValueError(f"unknown patch policy {policy!r} ({PATCHABLE} or {UNCUT_STEPS})")
    if nodes_say:
        return f"the nodes say {TWO_STREAMS}"
    if policy == UNCUT_STEPS:
        return f"the plan says {TWO_STREAMS}"
    streams = return_map.streams
    if len(streams) != 1:
        names = [n for n, o in zip(return_map.names, return_map.outputs) if o is not None]
        return f"its blocks return {len(streams)} streams ({', '.join(map(str, names))})"
    return None
