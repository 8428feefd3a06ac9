"""The client's side of a split language model's key/value cache: a stand-in object generate holds, whose layers live on the nodes."""

from __future__ import annotations

import weakref

import torch

from diffuse.plan.kvcache import EDITS, refuse_edit, self_attention_part


class ClientCaches:
    """The client's side: tells a new or emptied cache from one that continues, and keeps its shadow."""

    def __init__(self):
        self._last: dict[str, weakref.ref] = {}

    def fresh(self, stack: str, cache) -> bool:
        """Must the nodes start new caches for this call? (a cache object not seen before, or one emptied)."""
        last = self._last.get(stack)
        seen = last is not None and last() is cache
        self._last[stack] = weakref.ref(cache)
        if not seen:
            self.guard(cache)
        return not seen or self_attention_part(cache).get_seq_length() == 0

    @staticmethod
    def guard(cache) -> None:
        """The client's cache refuses the edits it cannot forward to the nodes (see ``EDITS``)."""
        for part in {id(p): p for p in (cache, self_attention_part(cache),
                                        getattr(cache, "cross_attention_cache", None)) if p is not None}.values():
            for name in EDITS:
                if callable(getattr(part, name, None)):
                    setattr(part, name, refuse_edit(name))

    @staticmethod
    def shadow(cache, layers: range, hidden: torch.Tensor) -> None:
        """Write one zero per new position into each layer's slot of ``cache``, so the lengths ``generate``
        reads from it are those of a whole run (the keys and values themselves are on the nodes)."""
        part = self_attention_part(cache)
        cross = getattr(cache, "cross_attention_cache", None)
        b, q = hidden.shape[0], hidden.shape[1]
        for i in layers:
            z = torch.zeros(b, 1, q, 1, dtype=hidden.dtype, device=hidden.device)  # numel > 0: an empty tensor would read as length 0
            part.update(z, z.clone(), i)
            if cross is not None and cross.get_seq_length(i) == 0:
                # the encoder memory's keys and values are on the nodes too; a placeholder says "filled"
                one = torch.zeros(b, 1, 1, 1, dtype=hidden.dtype, device=hidden.device)
                cross.update(one, one.clone(), i)
