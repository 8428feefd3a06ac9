"""Taking a call into a block stack apart, and putting it back together.

A call ``block(*args, **kwargs)`` becomes a *tree* (plain CBOR/JSON data with
constants inline and ``{"$t": i}`` where tensor ``i`` sat) plus a flat list of
tensors, the *slots*. Tuples, lists and dicts of tensors nest (rotary
``(cos, sin)``, complex included). The tree is the call plan: it travels once
per branch; afterwards only the tensors that changed do. A language model's
key/value cache becomes a marker naming its class (``diffuse.plan.kvcache``): each
node supplies its own.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch

from diffuse.errors import DiffuseError
from diffuse.plan.kvcache import STATE, is_cache

TENSOR, TUPLE, DICT = "$t", "$tuple", "$dict"


class UnsplittableCall(DiffuseError):
    """A block was called with an argument that cannot travel."""


def flatten(args: tuple, kwargs: dict) -> tuple[dict, list[torch.Tensor]]:
    tensors: list[torch.Tensor] = []

    def enc(x: Any, where: str):
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return {TENSOR: len(tensors) - 1}
        if x is None or isinstance(x, (bool, int, str)):
            return x
        if isinstance(x, float):
            if not math.isfinite(x):
                return {"$float": repr(x)}
            return x
        if isinstance(x, tuple):
            return {TUPLE: [enc(v, f"{where}[{i}]") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [enc(v, f"{where}[{i}]") for i, v in enumerate(x)]
        if is_cache(x):
            return {STATE: type(x).__name__}
        if isinstance(x, dict):
            if not all(isinstance(k, str) for k in x):
                raise UnsplittableCall(f"block argument {where} is a dict with non-string keys")
            return {DICT: {k: enc(v, f"{where}[{k!r}]") for k, v in x.items()}}
        raise UnsplittableCall(
            f"block argument {where} is a {type(x).__name__}, which cannot be sent to a node "
            "(only tensors, numbers, strings, None and tuples/lists/dicts of them travel)"
        )

    tree = {
        "args": [enc(a, f"args[{i}]") for i, a in enumerate(args)],
        "kwargs": {k: enc(v, k) for k, v in kwargs.items()},
    }
    return tree, tensors


def flatten_layers(calls: list[tuple[tuple, dict]]) -> tuple[dict, dict[str, dict], list[torch.Tensor]]:
    """The calls a language model made into each layer of a stack, as one message: the first layer's
    tree, the trees of layers whose call differs from it (a model mixing sliding-window and full
    attention hands each layer its own mask), keyed by layer index as a string, and the tensors of all
    calls, each once. The first call's slots keep their numbers, so its return map holds for every layer."""
    tensors: list[torch.Tensor] = []
    index: dict[int, int] = {}
    trees = []
    for args, kwargs in calls:
        if trees and same_objects((args, kwargs), calls[0]):  # the first call's very objects: its very tree
            trees.append(trees[0])
            continue
        tree, own = flatten(args, kwargs)
        numbers = []
        for t in own:
            if id(t) not in index:
                index[id(t)] = len(tensors)
                tensors.append(t)
            numbers.append(index[id(t)])
        trees.append(_renumber(tree, numbers))
    first = trees[0]
    return first, {str(i): t for i, t in enumerate(trees) if i and t != first}, tensors


def same_objects(call: tuple[tuple, dict], first: tuple[tuple, dict]) -> bool:
    """Whether a layer was called with the very objects the first layer was (a decoder's layers usually are: the
    stand-ins hand each the same hidden state, mask, positions and cache), so that it flattens as the first did."""
    (args, kwargs), (args0, kwargs0) = call, first
    return len(args) == len(args0) and all(a is b for a, b in zip(args, args0)) and kwargs.keys() == kwargs0.keys() \
        and all(kwargs[k] is kwargs0[k] for k in kwargs0)


def _renumber(x, numbers: list[int]):
    if isinstance(x, dict):
        if TENSOR in x:
            return {TENSOR: numbers[x[TENSOR]]}
        return {k: _renumber(v, numbers) for k, v in x.items()}
    if isinstance(x, list):
        return [_renumber(v, numbers) for v in x]
    return x


def unflatten(tree: dict, tensors: list, state=None) -> tuple[tuple, dict]:
    """The call again; a cache marker becomes ``state`` (the node's own cache for this session)."""
    def dec(x):
        if isinstance(x, dict):
            if TENSOR in x:
                return tensors[x[TENSOR]]
            if STATE in x:
                if state is None:
                    raise UnsplittableCall("this call carries a cache, and no cache was given for it")
                return state
            if TUPLE in x:
                return tuple(dec(v) for v in x[TUPLE])
            if DICT in x:
                return {k: dec(v) for k, v in x[DICT].items()}
            if "$float" in x:
                return float(x["$float"])
            raise UnsplittableCall(f"malformed call plan node {x!r}")
        if isinstance(x, list):
            return [dec(v) for v in x]
        return x

    return tuple(dec(a) for a in tree["args"]), {k: dec(v) for k, v in tree["kwargs"].items()}


def encode_value(value: Any) -> tuple[Any, list[torch.Tensor]]:
    """A block's return value (tensor, tuple with None, ...) as a tree plus tensors."""
    tree, tensors = flatten((value,), {})
    return tree["args"][0], tensors


def decode_value(tree: Any, tensors: list) -> Any:
    args, _ = unflatten({"args": [tree], "kwargs": {}}, tensors)
    return args[0]


def slot_names(tree: dict) -> list[str]:
    """Human names of the tensor slots, e.g. ``args[0]``, ``image_rotary_emb[1]``."""
    names: dict[int, str] = {}

    def walk(x, where):
        if isinstance(x, dict):
            if TENSOR in x:
                names[x[TENSOR]] = where
            elif TUPLE in x:
                for i, v in enumerate(x[TUPLE]):
                    walk(v, f"{where}[{i}]")
            elif DICT in x:
                for k, v in x[DICT].items():
                    walk(v, f"{where}[{k!r}]")
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, f"{where}[{i}]")

    for i, a in enumerate(tree["args"]):
        walk(a, f"args[{i}]")
    for k, v in tree["kwargs"].items():
        walk(v, k)
    return [names[i] for i in sorted(names)]


def thread_outputs(values: list, out, return_map) -> None:
    """Put what a block returned into the slots it replaces (``return_map``: a ``diffuse.plan.contracts.ReturnMap``),
    ready for the next block."""
    outs = (out,) if return_map.single else out
    if len(outs) != len(return_map.outputs):
        raise DiffuseError(f"a block returned {len(outs)} values; its return map expects {len(return_map.outputs)}")
    for j, slot in enumerate(return_map.outputs):
        if slot is not None and outs[j] is not None:
            values[slot] = outs[j]


def raw_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes as they lie in memory (dtype kept, no conversion): what travels and is hashed."""
    t = t.detach().contiguous().cpu()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def digest(t: torch.Tensor) -> bytes:
    """Content hash of a tensor (dtype, shape and bytes), to send each value once."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(raw_bytes(t))
    return h.digest()
