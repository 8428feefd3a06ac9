"""The per-session state of an autoregressive stack: each layer's key/value cache, kept on the node
that holds the layer.

A language model hands every decoder layer the same cache object; the layer
writes its own keys and values into it (``cache.update(k, v, layer_idx)``).
Split, the cache cannot travel: in the call plan it becomes a marker naming its
class (``{"$state": "DynamicCache"}``), and each node keeps, per session and
stack, a cache of that class for the layers it holds (global layer indices, so
a model mixing sliding-window and full-attention layers gets the right kind of
cache layer for each). The client's own cache object stays with ``generate``,
which reads its length to build masks and positions: after each pass the
client writes a *shadow* into it (one zero per new position and layer) so that
those lengths are what they would be whole, while the keys and values
themselves live only on the nodes.

A new cache object on the client, or one that is empty, starts fresh caches on
the nodes (``generate`` makes a new cache per call; MusicGen prefills twice).

A session's cache is capped at the model's ``max_position_embeddings`` (of its
text part; models that name none are not capped here): the client refuses a
prompt longer than that before any pass (``check_prompt``), and a node refuses a
pass that would take its cache beyond it (``NodeCaches.check_room``), in one
line naming the cap, so a session's keys and values, and the client's replay
history of them (``diffuse.client.replay``), stay within what the model was made for.
"""

from __future__ import annotations

import weakref

import torch

from diffuse.errors import DiffuseError

STATE = "$state"  # call-plan marker where the cache object sat


def is_cache(x) -> bool:
    """A per-request cache, by what it does: layers write into it and the caller reads its length."""
    return callable(getattr(x, "update", None)) and callable(getattr(x, "get_seq_length", None)) \
        and not isinstance(x, (torch.Tensor, dict))


def self_attention_part(cache):
    """The part of ``cache`` a decoder layer's self-attention writes (an encoder-decoder cache holds two)."""
    return getattr(cache, "self_attention_cache", cache)


def max_positions(config) -> int | None:
    """The positions a model's attention was made for: ``max_position_embeddings`` of its text part (None
    when it names none, as models with relative positions do)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    most = getattr(text, "max_position_embeddings", None)
    return most if isinstance(most, int) and not isinstance(most, bool) and most > 0 else None


def over_cap(positions: int, most: int, what: str) -> str:
    return (f"{what} {positions} positions, over the model's max_position_embeddings ({most}), the cap on a "
            "session's key/value cache: use a shorter prompt, fewer new tokens, or a new conversation")


def check_prompt(config, input_ids) -> None:
    """Refuse, before any pass, a decoder prompt longer than the model's positions (``max_positions``)."""
    most = max_positions(config)
    if most is None or getattr(config, "is_encoder_decoder", False) or not isinstance(input_ids, torch.Tensor):
        return
    if input_ids.dim() >= 2 and input_ids.shape[-1] > most:
        raise DiffuseError(over_cap(input_ids.shape[-1], most, "the prompt holds"))


def cached_positions(cache) -> int:
    """Positions a cache's self-attention part holds (the longest of its layers; a sliding-window layer counts
    every position it has seen)."""
    lengths = [layer.get_seq_length() for layer in getattr(self_attention_part(cache), "layers", ())
               if callable(getattr(layer, "get_seq_length", None))]
    return max(lengths, default=0)


# what beam and contrastive search do to a cache (a crop, as assisted decoding makes, travels: diffuse.lm.client_cache)
EDITS = ("reorder_cache", "crop", "batch_repeat_interleave", "batch_select_indices")


def refuse_edit(name: str):
    def refuse(*_args, **_kwargs):
        raise DiffuseError(f"generate called cache.{name}(): beam search and contrastive search reorder or "
                           "repeat the cache, whose keys and values live on the nodes, so Diffuse refuses them "
                           "rather than give a wrong answer (greedy decoding, sampling and assisted decoding work)")
    return refuse
