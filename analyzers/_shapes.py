"""Shape helpers shared by the built-in analyzers: where the block stacks are, how wide a block is.

Everything here looks at module structure and parameter shapes only; no class
or family name is ever compared against a list.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import logging
import textwrap
import warnings
from collections import Counter
from contextlib import contextmanager

from torch import nn

# Modules that only hold others; an entry of one of these is not a callable block.
_HOLDERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _is_container(module: nn.Module) -> bool:
    """Holds nothing but one ModuleList (parameter-free helpers aside), directly or through another container.

    Two lists side by side (a U-Net mid block: resnets and attentions, called
    interleaved) are parts of one block, not a container.
    """
    if next(module.parameters(recurse=False), None) is not None:
        return False
    weighted = [c for c in module.children() if _has_params(c)]
    return len(weighted) == 1 and (isinstance(weighted[0], nn.ModuleList) or _is_container(weighted[0]))


def top_lists(model: nn.Module, prefix: str = "") -> list[tuple[str, nn.ModuleList]]:
    """The ModuleLists the model itself exposes, in registration order.

    A list reached only through a module with weights of its own outside the
    list (a block, an embedder with a refiner inside) belongs to that module and
    is not returned; a pure container on the way (``trunk`` in ``trunk.layers``,
    holding nothing but the list) is looked through.
    """
    found = []
    for name, child in model.named_children():
        path = prefix + name
        if isinstance(child, nn.ModuleList):
            found.append((path, child))
        elif _has_params(child) and _is_container(child):
            found.extend(top_lists(child, path + "."))
    return found


def is_block(module: nn.Module) -> bool:
    """A block is built from layers (has children) and has weights; a bare Linear is a layer, not a block."""
    return not isinstance(module, _HOLDERS) and next(module.children(), None) is not None and _has_params(module)


def picked_not_looped(cls: type, paths: list[str]) -> set[str]:
    """Which of ``paths`` (attribute paths from ``self``) the class's code indexes (``self.heads[i]``) but never
    loops over (``for ... in``, ``range(len(...))`` included).

    A stack is called as a chain, block after block, in a loop; a list whose
    entries are picked one by one is not one. A list that is only passed on or
    aliased (``blocks = self.blocks``) is not judged; nor is anything when no
    source can be read.
    """
    looped, indexed = set(), set()
    for klass in cls.__mro__:
        try:
            text = "".join(linecache.getlines(inspect.getsourcefile(klass) or ""))
        except TypeError:  # builtins, C extensions
            continue
        if not any(f"self.{p.split('.')[0]}" in text for p in paths):
            continue  # cheap: most bases (ModelMixin, ...) never name the lists
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                looped.update(map(_self_path, ast.walk(node.iter)))
            elif isinstance(node, ast.Subscript):
                indexed.add(_self_path(node.value))
    return {p for p in paths if p in indexed and p not in looped}


def _self_path(node: ast.AST) -> str | None:
    """``self.trunk.layers`` -> "trunk.layers"."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join(reversed(parts)) if parts and isinstance(node, ast.Name) and node.id == "self" else None


def describe_blocks(blocks) -> str:
    """'4 blocks of 2 classes (DownBlock2D, CrossAttnDownBlock2D) and 3 different widths (320, 640, 1280, 1280)'."""
    classes = list(dict.fromkeys(type(b).__name__ for b in blocks))
    ws = [block_width(b) for b in blocks]
    parts = []
    if len(classes) > 1:
        parts.append(f"{len(classes)} classes ({', '.join(classes)})")
    if len(set(ws)) > 1:
        parts.append(f"{len(set(ws))} different widths ({', '.join(map(str, ws))})")
    return f"{len(blocks)} blocks of " + (" and ".join(parts) or f"one class ({classes[0]}) and width {ws[0]}")


def block_params(block: nn.Module) -> int:
    return sum(p.numel() for p in block.parameters())


def block_width(block: nn.Module) -> int:
    """The dimension that occurs most often among the block's parameter shapes (ties: the larger).

    For a transformer block this is its hidden size; for a U-Net stage its channel count.
    """
    counts = Counter(d for p in block.parameters() for d in p.shape)
    if not counts:
        return 0
    return max(counts, key=lambda d: (counts[d], d))


@contextmanager
def quiet():
    """Constructors of some models warn or log on odd configs; a nudge is not the place to show that."""
    loggers = [logging.getLogger(n) for n in ("diffusers", "transformers")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
