"""Whether a stack may be cut into patches at all: the one rule both the client and the node read."""

from __future__ import annotations

from diffuse.plan.contracts import PATCHABLE, UNCUT_STEPS, ReturnMap

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


QUICK_TOLERANCE = 1e-4  # relative, ||quick - plain|| / ||plain|| on the first real patch
