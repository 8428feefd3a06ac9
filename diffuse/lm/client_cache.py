"""The client's side of a split language model's key/value cache: a stand-in object generate holds, whose layers live on the nodes.

Assisted decoding (drafts verified by the ring, ``diffuse.lm.client_drafts``) edits the cache between passes: it
asks sliding-window layers to keep their past (``activate_past_recording``) and cuts the positions of rejected
drafts (``crop``). Those edits run on the client's shadow and are kept for the next pass of the same cache, whose
nodes make them on theirs before its layers run (``LayerPass.record``, ``LayerPass.crops``)."""

from __future__ import annotations

import weakref

import torch

from diffuse.errors import DiffuseError
from diffuse.plan.kvcache import EDITS, refuse_edit, self_attention_part


class ClientCaches:
    """The client's side: tells a new or emptied cache from one that continues, and keeps its shadow."""

    def __init__(self):
        self._last: dict[str, weakref.ref] = {}
        self._crops: dict[int, list[int]] = {}  # id of a cache object -> crops made on it since its last pass

    def fresh(self, stack: str, cache) -> bool:
        """Must the nodes start new caches for this call? (a cache object not seen before, or one emptied)."""
        last = self._last.get(stack)
        seen = last is not None and last() is cache
        self._last[stack] = weakref.ref(cache)
        if not seen:
            self.guard(cache)
        return not seen or self_attention_part(cache).get_seq_length() == 0

    def guard(self, cache) -> None:
        """The client's cache refuses the edits it cannot forward to the nodes (see ``EDITS``); its ``crop``
        runs on the shadow and is kept for the nodes (``edits``)."""
        crop = getattr(cache, "crop", None)
        self._crops[id(cache)] = []
        weakref.finalize(cache, self._crops.pop, id(cache), None)
        for part in {id(p): p for p in (cache, self_attention_part(cache),
                                        getattr(cache, "cross_attention_cache", None)) if p is not None}.values():
            for name in EDITS:
                if callable(getattr(part, name, None)) and name != "crop":  # a crop is kept (below)
                    setattr(part, name, refuse_edit(name))
        if callable(crop):
            def kept_crop(tokens_to_remove: int) -> None:
                if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int) or tokens_to_remove > 0:
                    raise DiffuseError("a split language model's cache is cut by a number of positions to remove "
                                       f"(<= 0), not {str(tokens_to_remove)[:24]}")
                crop(tokens_to_remove)
                if tokens_to_remove or self.recording(cache):  # cutting nothing trims a recording window only
                    self._crops[id(cache)].append(tokens_to_remove)
            cache.crop = kept_crop

    @staticmethod
    def recording(cache) -> bool:
        """Whether a layer of ``cache`` keeps the past a sliding window would drop (``activate_past_recording``)."""
        return any(getattr(layer, "record_past", False) for layer in getattr(self_attention_part(cache), "layers", ()))

    def edits(self, cache) -> tuple[bool, tuple[int, ...]]:
        """What the nodes do to their caches before this pass of ``cache``: keep the past a sliding window would
        drop (as the shadow's layers do once ``activate_past_recording`` ran on it), then cut as it was cut."""
        record = self.recording(cache)
        crops = self._crops.get(id(cache))
        taken = tuple(crops) if crops else ()
        if crops:
            crops.clear()
        return record, taken

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
