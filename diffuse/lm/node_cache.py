"""A node's key/value caches, per session and layer, for the layers it holds."""

from __future__ import annotations

import torch

from diffuse.errors import DiffuseError
from diffuse.plan.kvcache import cached_positions, max_positions, over_cap, self_attention_part


class NodeCaches:
    """The node's side: per stack, the cache of this session's layers, made from the model's config."""

    def __init__(self, config_factory):
        self._config_factory = config_factory  # () -> the model's config object (built once, on first need)
        self._config = None
        self.caches: dict[str, object] = {}

    def get(self, stack: str, kind: str, fresh: bool):
        if fresh or stack not in self.caches:
            self.caches[stack] = self._new(kind)
        return self.caches[stack]

    def _new(self, kind: str):
        from transformers import cache_utils

        if self._config is None:
            self._config = self._config_factory()
        if kind == "DynamicCache":
            return cache_utils.DynamicCache(config=self._config)
        if kind == "EncoderDecoderCache":  # a decoder reading an encoder's memory: self- and cross-attention parts,
            # each growing with the layers that write it (an encoder-decoder config sizes the encoder too)
            return cache_utils.EncoderDecoderCache(cache_utils.DynamicCache(), cache_utils.DynamicCache())
        raise DiffuseError(f"a cache of class {kind[:64]!r} cannot be kept on a node "
                           "(DynamicCache and EncoderDecoderCache can)")

    @staticmethod
    def edit(cache, record: bool, crops) -> None:
        """Edit ``cache`` as the client's own was edited since the last pass (``diffuse.lm.client_cache``):
        ``record`` keeps what a sliding window would drop until the next crop, each of ``crops`` removes that
        many of the last positions (0 only trims a sliding window back)."""
        if record and callable(getattr(cache, "activate_past_recording", None)):
            cache.activate_past_recording()
        # only the layers held here have keys: the others, never written, are left alone (cropping an empty
        # sliding-window layer fails in transformers)
        layers = [layer for layer in getattr(self_attention_part(cache), "layers", ())
                  if getattr(layer, "is_initialized", True)]
        for n in crops:
            held = cached_positions(cache)
            if -n > held:
                raise DiffuseError(f"asked to cut {-n} positions from a cache holding {held}")
            try:
                for layer in layers:
                    layer.crop(n)
            except (RuntimeError, ValueError) as exc:
                raise DiffuseError(f"this session's cache could not be cut back: {str(exc)[:160]}") from None

    def check_room(self, cache, new: int) -> None:
        """Refuse a pass that would take ``cache`` (one of this session's) beyond the model's positions."""
        if self._config is None:
            self._config = self._config_factory()
        most = max_positions(self._config)
        if most is not None and cached_positions(cache) + new > most:
            raise DiffuseError(over_cap(cached_positions(cache) + new, most, "this session's cache would hold"))

    def nbytes(self) -> int:
        """Bytes of keys and values held for this session."""
        total = 0
        for cache in self.caches.values():
            parts = [cache.self_attention_cache, cache.cross_attention_cache] if hasattr(
                cache, "cross_attention_cache") else [cache]
            for part in parts:
                for layer in getattr(part, "layers", ()):
                    for name in ("keys", "values"):
                        t = getattr(layer, name, None)
                        if isinstance(t, torch.Tensor):
                            total += t.numel() * t.element_size()
        return total

    def clear(self) -> None:
        self.caches.clear()
