"""Language-model decoding passes of several sessions run through a node's layers as one batch.

The node's compute thread takes what waits in its queue together
(``diffuse.node.server``); among those, decoding passes of different sessions that
call the same layers the same way (same stack and slice, same call plans, same
tensor shapes and dtypes: ``batch_key``) run each layer once over all their
rows (``run_batch``):

- the stream slots (hidden states) are joined on the batch axis; every other
  slot that differs between the sessions (position ids, rotary cos/sin) must
  have one row per hidden-state row and is joined likewise; one that is the
  same in all is passed once, as each session passed it;
- the layer is handed a ``JoinedCache`` in place of the session's cache: its
  ``update`` writes each session's new keys and values into that session's own
  cache (so the cache is what a lone run leaves) and answers with all sessions'
  keys and values, padded on the left to the longest; when the lengths differ,
  an additive attention mask hides the padding and keeps causality (the layer
  must take ``attention_mask``, and its own must be empty);
- the last layer's output and the stream slots are cut back into each
  session's rows, and each session's message is made as for a lone pass; on
  the stack's last node, the tails that read one row each run their output
  head as one product over all those rows, each row still answered with the
  candidates and value bits its tail alone gives (``diffuse.lm.node_layers.joint_tails``,
  ``diffuse.lm.node_tail.JointHead``).

Passes through bitsandbytes' LLM.int8 layers with an outlier threshold (a checkpoint
saved quantized 8-bit, ``diffuse.plan.bnbread``) are never batched: such a layer takes
out of its int8 product every column where any row of the call holds an outlier, so
another session's rows would change this one's.
Whatever does not fit (a cache layer other than a plain growing one, such as a
sliding window; a prefill; a mask already present; a layer that asks the
cache anything else; an output without one row per input row) raises, every
session's cache is put back as it was, and the passes run one by one: never a
wrong answer. Padding makes attention use a masked kernel, whose last bits may
differ from the lone run's; greedy tokens are the same (the tests and
``python -m diffuse.bench lm --sessions`` check it).
"""

from __future__ import annotations

import json

import torch

from diffuse.plan.bnbread import rows_depend
from diffuse.plan.calltree import thread_outputs, unflatten
from diffuse.errors import DiffuseError
from diffuse.plan.kvcache import is_cache

MAX_BATCH = 32  # messages taken from the queue at once (a batch holds at most that many sessions)


class NotBatchable(DiffuseError):
    """These passes cannot run as one batch; they run one by one."""


def _growing_layers(cache, indices) -> bool:
    """Does ``cache`` keep each of these layers as a plain growing key/value store, already holding keys
    (a decoding pass, not a prefill)? Only such layers can be joined, and put back if the batch fails."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if not is_cache(cache) or not isinstance(layers, list):
        return False
    return all(0 <= i < len(layers) and type(layers[i]) is DynamicLayer and layers[i].get_seq_length() > 0
               for i in indices)


def batch_key(dtype, p) -> tuple | None:
    """What must be the same for passes (``diffuse.node.stage.Prepared``) of different sessions to run as one batch;
    None: this pass runs alone (no cache: a diffusion pass, PipeFusion's patches included; a prefill; an unusual
    cache). Only a language model's pass (``diffuse.wire.passes.LayerPass``) carries a cache."""
    if p.cache is None or not p.blocks or not p.rmap.streams or p.rmap.sides or getattr(p.part, "keep", ()):
        return None  # side outputs threaded on (T5's position biases) are not per row: not joined
    if not _growing_layers(p.cache, [i for i, _ in p.blocks]):
        return None
    if rows_depend(b for _, b in p.blocks):
        return None  # LLM.int8's outlier columns come from every row of the call: each session alone
    hidden = p.values[p.rmap.streams[0]]
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        return None  # (rows, new positions, width), as a decoder layer takes it
    shapes = tuple((tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else repr(type(v))
                   for v in p.values)
    plans = json.dumps([p.tree, p.layer_trees, p.rmap.to_dict()], sort_keys=True)
    return p.stack, p.sl.start, p.sl.stop, str(dtype), id(p.blocks[0][1]), plans, shapes


class JoinedCache:
    """What the layer of a batch sees as its cache: each session's own cache behind it, one row range each."""

    def __init__(self, caches: list, bounds: list[tuple[int, int]], layer: int, pasts: list[int], new: int):
        self.caches, self.bounds, self.layer, self.pasts, self.new = caches, bounds, layer, pasts, new

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        rows = self.bounds[-1][1]
        if layer_idx != self.layer or keys.dim() != 4 or keys.shape[0] != rows or values.shape[0] != rows \
                or keys.shape[-2] != self.new or values.shape[-2] != self.new:
            raise NotBatchable(f"layer {layer_idx} wrote keys of shape {tuple(keys.shape)} to its cache, not "
                               f"{rows} rows of {self.new} new positions for layer {self.layer}")
        longest = max(self.pasts) + self.new
        joined_k = keys.new_zeros(rows, *keys.shape[1:-2], longest, keys.shape[-1])
        joined_v = values.new_zeros(rows, *values.shape[1:-2], longest, values.shape[-1])
        for cache, (a, b), past in zip(self.caches, self.bounds, self.pasts):
            if cache.get_seq_length(layer_idx) != past:
                raise NotBatchable("a session's cache changed length while its batch was being joined")
            k, v = cache.update(keys[a:b], values[a:b], layer_idx, *args, **kwargs)
            joined_k[a:b, ..., longest - k.shape[-2]:, :] = k
            joined_v[a:b, ..., longest - v.shape[-2]:, :] = v
        return joined_k, joined_v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        lengths = {c.get_seq_length(layer_idx) for c in self.caches}
        if len(lengths) != 1:
            raise NotBatchable("a layer asked the cache for one length; the sessions of the batch have several")
        return lengths.pop()

    def __getattr__(self, name):  # anything else a layer asks of its cache: these passes run one by one
        raise NotBatchable(f"a layer asked its cache for {name!r}, which a batch of sessions cannot answer")


def padding_mask(pasts: list[int], rows: list[int], new: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask (rows, 1, new, longest): keys padded on the left hidden, and each new position
    sees the keys up to its own."""
    longest = max(pasts) + new
    mask = torch.full((sum(rows), 1, new, longest), torch.finfo(dtype).min, dtype=dtype)
    start = 0
    for past, n in zip(pasts, rows):
        first = longest - past - new
        for j in range(new):
            mask[start:start + n, :, j, first:longest - new + j + 1] = 0
        start += n
    return mask


def _join(tensors: list, rows: int, stream: bool):
    """One slot of every session's pass, as the batch's (``rows``: each session's hidden-state rows)."""
    first = tensors[0]
    if not stream and all(t is first or (t.shape == first.shape and t.dtype == first.dtype and torch.equal(t, first))
                          for t in tensors[1:]):
        return first  # the same in every session: passed once, as each passed it alone
    if first.dim() == 0 or first.shape[0] != rows:
        raise NotBatchable(f"a tensor that differs between the sessions has shape {tuple(first.shape)}, not one "
                           f"row per hidden-state row ({rows})")
    return torch.cat(tensors)


def _rows(out, a: int, b: int, total: int):
    """Rows a:b of a layer's output (a tensor, or a tuple/list of them and None)."""
    if out is None:
        return None
    if isinstance(out, torch.Tensor):
        if out.dim() == 0 or out.shape[0] != total:
            raise NotBatchable(f"a layer returned a tensor of shape {tuple(out.shape)}, not one row per input row")
        return out[a:b]
    if isinstance(out, (tuple, list)):
        return type(out)(_rows(o, a, b, total) for o in out)
    raise NotBatchable(f"a layer returned a {type(out).__name__}")


def run_batch(passes: list) -> list:
    """Run ``passes`` (of different sessions, one ``batch_key``) through their layers as one batch; each
    pass's ``values`` then hold its own rows of the stream slots, and its part of the last layer's output is
    returned. Raises (``NotBatchable`` or whatever a layer raised) with every cache as it was before."""
    first = passes[0]
    streams, rmap = set(first.rmap.streams), first.rmap
    hidden = [p.values[first.rmap.streams[0]] for p in passes]
    rows = [h.shape[0] for h in hidden]
    total, new = sum(rows), hidden[0].shape[1]
    bounds, start = [], 0
    for n in rows:
        bounds.append((start, start + n))
        start += n
    caches = [p.cache for p in passes]
    if len({id(c) for c in caches}) != len(caches):
        raise NotBatchable("two passes of one batch share a cache")
    joined = [_join([p.values[s] for p in passes], rows[0], s in streams) for s in range(len(first.values))]
    kept = [[(layer.keys, layer.values) for layer in c.layers] for c in caches]
    try:
        out = None
        with torch.no_grad():
            for i, block in first.blocks:
                tree = first.layer_trees.get(str(i), first.tree)
                pasts = [c.layers[i].get_seq_length() for c in caches]
                state = JoinedCache(caches, bounds, i, pasts, new)
                args, kwargs = unflatten(tree, joined, state)
                if len(set(pasts)) > 1:  # padded: a mask hides the padding (in place of an empty one)
                    if "attention_mask" not in kwargs or kwargs["attention_mask"] is not None:
                        raise NotBatchable("the sessions' caches differ in length and the layer's call has no empty "
                                           "attention_mask to put the padding mask in")
                    kwargs["attention_mask"] = padding_mask(pasts, rows, new, hidden[0].dtype).to(hidden[0].device)
                out = block(*args, **kwargs)
                thread_outputs(joined, out, rmap)
            outs = [_rows(out, a, b, total) for a, b in bounds]
            parts = {s: [_rows(joined[s], a, b, total) for a, b in bounds] for s in streams}
    except BaseException:
        for c, layers in zip(caches, kept):
            for layer, (k, v) in zip(c.layers, layers):
                layer.keys, layer.values = k, v
        raise
    for j, p in enumerate(passes):
        for s in streams:
            p.values[s] = parts[s][j]
    return outs
