"""The client's projections of repeated inputs: computed once, not once per step.

A pipeline hands its denoiser the same prompt embeddings at every step, and the
denoiser projects them again each time (Wan's text projection, 4096 -> hidden,
over 512 text tokens, is nine tenths of the client's own work per call). While a
model is split, every ``Linear`` of the client's part of it (outside the block
stacks) keeps the outputs of its last few large inputs and answers again with
the kept output when it is handed the very same tensor, unchanged:

- the same bits in the same layout: the very tensor kept (so its address is
  never reused by another), or one equal to it element for element (the
  projection after an activation gets a new tensor each step, with the same
  values); neither changed in place since (version counters), and the layer's
  weights at the same versions;
- the kept output itself unchanged since (a caller that edited it in place
  makes the next call compute afresh);
- gradients off (an autograd graph is never shared between calls).

The answer is then the very tensor the layer computed from those bits before, so
no bit of any output changes (``tests/test_exact.py`` runs with it on). Inputs
under ``MIN_ELEMENTS`` are not kept: they change at every call (timesteps) or cost
less than the bookkeeping. The nodes do the same for cross-attention inside
patches (``diffuse.pipefusion.attention``).
"""

from __future__ import annotations

import torch

MIN_ELEMENTS = 1 << 16  # inputs smaller than this are computed every time
KEEP = 4  # inputs and outputs kept per layer (guidance: one per branch, with room to spare)


class RepeatMemo:
    """Installed on a model's client-side ``Linear`` layers while a ring is attached; ``remove`` restores them."""

    def __init__(self, model: torch.nn.Module, skip: tuple[str, ...] = ()):
        self.layers = [m for name, m in model.named_modules()
                       if type(m) is torch.nn.Linear and "forward" not in vars(m)
                       and not any(name == s or name.startswith(s + ".") for s in skip)]
        self.hits = self.misses = 0
        self._kept: dict[int, list] = {}

    def install(self) -> None:
        for layer in self.layers:
            layer.forward = self._forward(layer)

    def remove(self) -> None:
        for layer in self.layers:
            vars(layer).pop("forward", None)
        self._kept.clear()

    def _forward(self, layer: torch.nn.Linear):
        compute = type(layer).forward.__get__(layer)
        kept = self._kept.setdefault(id(layer), [])

        def forward(x):
            if not isinstance(x, torch.Tensor) or x.numel() < MIN_ELEMENTS or torch.is_grad_enabled():
                return compute(x)
            weights = tuple(p._version for p in layer.parameters(recurse=False))
            for i, entry in enumerate(kept):
                if _same(entry, x, weights):
                    self.hits += 1
                    kept.append(kept.pop(i))  # most recently used last
                    return entry[3]
            out = compute(x)
            self.misses += 1
            del kept[:-(KEEP - 1)]
            kept.append((x, x._version, weights, out, out._version))
            return out

        return forward


def _same(entry: tuple, x: torch.Tensor, weights: tuple) -> bool:
    """Whether ``entry`` answers ``x``: its input the same bits in the same layout (the very tensor, or an equal
    one), neither it nor its output changed in place since, the layer's weights unchanged."""
    old, version, wv, out, out_version = entry
    if old._version != version or out._version != out_version or wv != weights:
        return False
    if old is x:
        return True
    if old.shape != x.shape or old.dtype != x.dtype or old.device != x.device or old.stride() != x.stride():
        return False
    flat_old, flat_x = old.reshape(-1), x.reshape(-1)
    return bool(torch.equal(flat_old[:64], flat_x[:64])) and bool(torch.equal(old, x))
