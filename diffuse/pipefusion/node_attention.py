"""The quick attention path's mechanism: a patch's queries against buffered keys and values.

The two ways a node runs one block on one patch (``PATHS`` in ``diffuse.pipefusion.node``, registered
with ``@attention_path``; each is ``(stale, idx, block, run) -> out``):

- *plain*: the patch's fresh rows go into the block's buffered input over all N
  tokens, the block runs on the whole buffer, the patch's rows are taken out.
  Right for any block; costs the whole picture per patch.
- *quick*: the block runs on the patch's rows alone, with per-token arguments
  (rotary tables) cut to the patch, and self-attention reads buffered keys and
  values. What makes patching pay, where it is right.

Which one a block keeps is decided in ``diffuse.pipefusion.node``: both run on
its first patch and quick is kept only if it agrees with plain.

A block's self-attention is found, not assumed: every module of the block that
has an attention ``processor`` gets a stand-in processor for the duration of one
call (``attention_scope``, which always restores the originals), and
``torch.nn.functional.scaled_dot_product_attention`` is intercepted inside it.
The stand-in processor only says which attention module is running; the
processor's own code (projections, norms, rotary) runs unchanged, so nothing
about a family's layout is reimplemented here. Two scope modes:

- ``record`` (a pass over all N tokens): every attention call whose queries and
  keys both span the N tokens is self-attention over the picture; its keys and
  values (after projection and rotary) are kept. The kernel is called with
  exactly the arguments it was given, so recording changes no bit.
- ``quick`` (one patch of n tokens, rows [lo, lo+n)): for a module recorded as
  self-attention, the patch's fresh keys and values replace their rows in the
  kept buffer and the patch's n queries attend over all N keys.

Anything quick cannot honour (a mask over the patch, a causal flag, no
self-attention found at all) raises ``QuickUnsupported``, which makes that
block use the plain path.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from diffuse.errors import DiffuseError
from diffuse.measure import relative_error


__all__ = ["AttentionBuffer", "QuickUnsupported", "attention_scope"]

_REAL_SDPA = F.scaled_dot_product_attention
_SDPA_NAMES = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]


class QuickUnsupported(DiffuseError):
    """This block's attention cannot be restricted to a patch's queries."""


@dataclass
class AttentionBuffer:
    """Keys and values of one block's self-attention modules over all N tokens, by module name."""

    kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.kv.values() for t in pair)


@dataclass
class _Scope:
    mode: str  # "record" | "quick"
    tokens: int  # N, the whole stream's token count
    buffer: AttentionBuffer
    lo: int = 0
    count: int = 0  # n, the patch's token count (quick)
    module: str | None = None  # the attention module running now
    hits: int = 0  # attention calls served from the buffer (quick)


_ACTIVE: list[_Scope] = []


def _sdpa(*args, **kwargs):
    scope = _ACTIVE[-1] if _ACTIVE else None
    if scope is None or scope.module is None:
        return _REAL_SDPA(*args, **kwargs)
    bound = dict(zip(_SDPA_NAMES, args), **kwargs)
    q, k, v = bound["query"], bound["key"], bound["value"]
    if scope.mode == "record":
        if q.shape[-2] == scope.tokens and k.shape[-2] == scope.tokens:
            scope.buffer.kv[scope.module] = (k.contiguous().clone(), v.contiguous().clone())
        return _REAL_SDPA(*args, **kwargs)
    kept = scope.buffer.kv.get(scope.module)
    if kept is None or q.shape[-2] != scope.count or k.shape[-2] != scope.count:
        return _REAL_SDPA(*args, **kwargs)  # cross-attention, or a module never seen over all tokens
    if bound.get("attn_mask") is not None or bound.get("is_causal"):
        raise QuickUnsupported(f"{scope.module}: self-attention with a mask or causal flag")
    kb, vb = kept
    if kb.shape[:-2] != k.shape[:-2] or kb.shape[-1] != k.shape[-1]:
        raise QuickUnsupported(f"{scope.module}: patch keys {tuple(k.shape)} do not fit the buffer {tuple(kb.shape)}")
    kb.narrow(-2, scope.lo, scope.count).copy_(k)
    vb.narrow(-2, scope.lo, scope.count).copy_(v)
    scope.hits += 1
    bound.update(key=kb, value=vb)
    return _REAL_SDPA(**bound)


def _scoped_processor(original, name: str, scope: _Scope):
    """A processor that runs ``original`` with ``scope.module`` set; its ``__call__`` shows
    the original's signature, because attention modules filter keyword arguments by it."""
    fn = type(original).__call__

    @functools.wraps(fn)
    def __call__(self, *args, **kwargs):
        outer, scope.module = scope.module, name
        try:
            return original(*args, **kwargs)
        finally:
            scope.module = outer

    def __getattr__(self, attr):
        return getattr(original, attr)

    cls = type(f"Scoped{type(original).__name__}", (), {"__call__": __call__, "__getattr__": __getattr__})
    return cls()


def _set_processor(module, processor) -> None:
    # legacy Attention and the AttentionModuleMixin have set_processor; Mochi's attention is a plain
    # module whose processor is an attribute (FACTS Table 4)
    if hasattr(module, "set_processor"):
        module.set_processor(processor)
    else:
        module.processor = processor


def _memo_forward(linear: torch.nn.Linear, name: str, memo: dict, count: int):
    """``linear.forward`` that reuses its last output when given the very same, unchanged tensor
    again. Cross-attention projects the text this way once per branch instead of once per patch;
    the patch's own rows (``count`` long) are never kept."""
    forward = type(linear).forward.__get__(linear)

    def memo_forward(x):
        kept = memo.get(name)
        if kept is not None and kept[0] is x and kept[1] == x._version:
            return kept[2]
        out = forward(x)
        if x.dim() >= 2 and x.shape[-2] != count:
            memo[name] = (x, x._version, out)
        return out

    return memo_forward


@contextmanager
def attention_scope(block: torch.nn.Module, mode: str, tokens: int, buffer: AttentionBuffer,
                    lo: int = 0, count: int = 0, memo: dict | None = None):
    """Run ``block`` with its attention processors scoped (record or quick); always restores them.
    With ``memo`` (quick), the attention modules' linear projections reuse outputs for repeated inputs."""
    scope = _Scope(mode, tokens, buffer, lo, count)
    swapped, memoized = [], []
    try:
        for name, m in block.named_modules():
            original = getattr(m, "processor", None)
            if original is None or not callable(original) or isinstance(original, torch.nn.Module):
                continue
            _set_processor(m, _scoped_processor(original, name, scope))
            swapped.append((m, original))
            if memo is not None:
                for sub, lin in m.named_modules():
                    if type(lin) is torch.nn.Linear and "forward" not in vars(lin):
                        lin.forward = _memo_forward(lin, f"{name}.{sub}", memo, count)
                        memoized.append(lin)
        _ACTIVE.append(scope)
        F.scaled_dot_product_attention = _sdpa
        yield scope
    finally:
        if _ACTIVE and _ACTIVE[-1] is scope:
            _ACTIVE.pop()
        if not _ACTIVE:
            F.scaled_dot_product_attention = _REAL_SDPA
        for m, original in reversed(swapped):
            _set_processor(m, original)
        for lin in memoized:
            del lin.forward


# --------------------------------------------------------------------------- the two paths
