"""Call plans from a peer, checked before any of it is used (``checked_tree``)."""

from __future__ import annotations

from typing import Any

from diffuse.plan.calltree import DICT, TENSOR, TUPLE
from diffuse.plan.contracts import ContractError, is_int
from diffuse.plan.kvcache import STATE

MAX_TREE_DEPTH = 16
MAX_TREE_NODES = 4096


def checked_tree(tree: Any, what: str, slots: int | None = None) -> dict:
    """A call plan from a peer, checked before any of it is used: a map of ``args`` (a list) and
    ``kwargs`` (a map of strings), nodes of known kinds, tensor numbers in range (``slots``), bounded
    in depth and size.

    >>> checked_tree({"args": [{"$t": 0}], "kwargs": {"scale": 1.5}}, "call plan", 1)
    {'args': [{'$t': 0}], 'kwargs': {'scale': 1.5}}
    >>> checked_tree({"args": [{"$t": 2}], "kwargs": {}}, "call plan", 1)
    Traceback (most recent call last):
    ...
    diffuse.plan.contracts.ContractError: malformed call plan: tensor number 2 is not one of its 1
    """
    if not isinstance(tree, dict) or set(tree) != {"args", "kwargs"} or not isinstance(tree["args"], list) \
            or not isinstance(tree["kwargs"], dict) or not all(isinstance(k, str) for k in tree["kwargs"]):
        raise ContractError(f"malformed {what}: a map of args (a list) and kwargs (a map)")
    count = 0

    def walk(x, depth: int) -> None:
        nonlocal count
        count += 1
        if depth > MAX_TREE_DEPTH or count > MAX_TREE_NODES:
            raise ContractError(f"malformed {what}: nested deeper than {MAX_TREE_DEPTH} or larger than "
                                f"{MAX_TREE_NODES} entries")
        if x is None or isinstance(x, (bool, int, float, str)):
            return
        if isinstance(x, list):
            for v in x:
                walk(v, depth + 1)
            return
        if not isinstance(x, dict) or len(x) != 1:
            raise ContractError(f"malformed {what}: a {type(x).__name__} where a value or a one-key marker belongs")
        (k, v), = x.items()
        if k == TENSOR:
            if not is_int(v) or v < 0 or (slots is not None and v >= slots):
                raise ContractError(f"malformed {what}: tensor number {str(v)[:24]} is not one of its "
                                    f"{slots if slots is not None else 'slots'}")
        elif k == TUPLE and isinstance(v, list) or k == DICT and isinstance(v, dict) and all(
                isinstance(n, str) for n in v):
            for e in (v if isinstance(v, list) else v.values()):
                walk(e, depth + 1)
        elif not (k == "$float" and v in ("nan", "inf", "-inf") or k == STATE and isinstance(v, str)):
            raise ContractError(f"malformed {what}: unknown marker {str(k)[:24]!r}")

    for v in (*tree["args"], *tree["kwargs"].values()):
        walk(v, 1)
    return tree
