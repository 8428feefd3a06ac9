"""Tell whether a stack's blocks carry two streams (image and text side by side), from the block's source.

Method: read the source of the block class's ``forward`` (``inspect`` + ``ast``)
and look at its ``return`` statements. A block that returns a tuple of two or
more non-constant values (``return encoder_hidden_states, hidden_states``), or
a name last bound to such a tuple, hands two streams to the next block; one
that returns a single value carries one. A block that returns what one of its
own submodules returns (``return self.block(...)``, a wrapper) is judged by
that submodule's forward. Where the source cannot be read (a compiled or
generated class) the answer is "two streams", the safe side: such a model runs
whole steps instead of patches, which is slower but never wrong. The return map
learned at the first real call confirms it at run time.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

from torch import nn

from diffuse.plan.analysis import Analyzer

from analyzers.stack_finder import denoiser_on_meta


class TwoStream(Analyzer):
    name = "two_stream"
    phase = "config"
    needs = ("stacks", "stack_widths")  # stack_widths: after chain_check, only on accepted stacks
    provides = ("two_stream", "two_stream_evidence")
    description = "Whether each stack's blocks return two streams (a tuple of tensors), read from forward's source."

    def analyze(self, subject, draft):
        model = denoiser_on_meta(subject)
        found, evidence = {}, {}
        for s in draft["stacks"]:
            found[s.path], evidence[s.path] = returns_two_streams(model.get_submodule(s.path)[0])
        return {"two_stream": found, "two_stream_evidence": evidence}


def returns_two_streams(block: nn.Module, depth: int = 0) -> tuple[bool, str]:
    """(two streams?, the evidence in words) for one block instance."""
    forward = type(block).forward
    where = getattr(forward, "__qualname__", type(block).__name__ + ".forward")
    try:
        fn = ast.parse(textwrap.dedent(inspect.getsource(forward))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return True, f"source of {where} unavailable: assumed two streams (whole steps) until the first call shows"
    tuples, returns = {}, []  # tuples: name -> last tuple bound to it, in source order
    for node in _own_nodes(fn):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
            tuples.update((t.id, node.value) for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.Return) and node.value is not None:
            returns.append(tuples.get(node.value.id, node.value) if isinstance(node.value, ast.Name) else node.value)
    for value in returns:
        if isinstance(value, ast.Tuple) and sum(not isinstance(e, ast.Constant) for e in value.elts) >= 2:
            return True, f"{where} returns {ast.unparse(value)}"
    for value in returns:
        inner = _delegate(block, value)
        if inner is not None and depth < 3:
            two, why = returns_two_streams(inner, depth + 1)
            return two, f"{where} returns self.{ast.unparse(value.func).split('.', 1)[1]}(...), and {why}"
    return False, f"{where} returns {', '.join(sorted({ast.unparse(v) for v in returns})) or 'nothing'}"


def _delegate(block: nn.Module, value: ast.AST) -> nn.Module | None:
    """The submodule in ``return self.<name>(...)``, if that is what the return is."""
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) \
            and isinstance(value.func.value, ast.Name) and value.func.value.id == "self":
        inner = getattr(block, value.func.attr, None)
        return inner if isinstance(inner, nn.Module) else None
    return None


def _own_nodes(fn: ast.AST):
    """The nodes of ``fn`` in source order, not descending into nested functions or classes."""
    for child in ast.iter_child_nodes(fn):
        yield child
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            yield from _own_nodes(child)
