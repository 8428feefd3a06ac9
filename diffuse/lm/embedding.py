"""The start of a language model's pass on the first node: token ids in, the first hidden states out.

A language model's forward turns token ids into hidden states with its input
embedding table and hands them to the first decoder layer. By default the
client keeps the table and passes carry hidden states. With
``--embedding-on-node`` (``diffuse.split(..., embedding_on_node=True)``), where
the model's forward does nothing else with them, the table lives on the node
holding the first layer: the client's embedding becomes ``EmbedStandIn``, which answers
with a placeholder of the right shape and dtype (NaN, so that a value read by
mistake shows); the pass carries the token ids in the hidden-state slot, and
the first node looks them up in its own exact copy of the table (bit-identical)
before running its layers. With the head tied to the table, the client then
holds neither.

Whether a model allows it is decided once, when it is split with that option (``embedding_stays``),
by shape alone: a decoder-only model whose forward takes token ids and nothing
that could be merged into the embeddings (images, audio: any other input), and
whose first decoder layer, run on the model's own forward with two different
embedding outputs, receives that very output object, unchanged, and otherwise
the same arguments (so no value of it was read on the way: scaling, scattered
features, positions). Any other model keeps its table on the client, and the
reason is reported. Each pass is checked again (``Splitter.run_layers``): the
first layer must receive the placeholder itself, unchanged, or the pass is
refused rather than answered wrongly.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from diffuse.plan.calltree import flatten

# a causal LM's forward arguments that carry nothing to merge into the embeddings
TEXT_INPUTS = frozenset({
    "input_ids", "attention_mask", "position_ids", "cache", "past_key_values", "inputs_embeds", "labels",
    "use_cache", "logits_to_keep", "num_logits_to_keep", "cache_position", "output_attentions",
    "output_hidden_states", "return_dict"})


class _Stop(Exception):
    """Raised before the first decoder layer runs: the trial has seen what it needs."""


def embedding_path(model: nn.Module) -> str | None:
    """Where the model's input embedding sits (``get_input_embeddings()``, a 2-D table), or None."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        emb = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        return None
    weight = getattr(emb, "weight", None)
    if not isinstance(emb, nn.Module) or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    return next((name for name, m in model.named_modules() if m is emb), None)


def media_inputs(model: nn.Module) -> list[str]:
    """The arguments of the model's forward beyond token ids and their bookkeeping (``TEXT_INPUTS``)."""
    try:
        params = inspect.signature(type(model).forward).parameters.values()
    except (TypeError, ValueError):
        return ["(a forward without a signature)"]
    return [p.name for p in params if p.name != "self" and p.name not in TEXT_INPUTS
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]


def embedding_stays(model: nn.Module, path: str | None, first_layer: nn.Module) -> str | None:
    """Why the model's embedding table must stay on the client, in a few words; None when its first decoder
    layer takes the embedding's output as is and nothing else reads it, so the first node can hold the table."""
    if path is None:
        return "the model has no input embedding table"
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder's decoder starts from its own prompt and the encoder's memory"
    extra = media_inputs(model)
    if extra:
        return (f"its forward also takes {', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''}, which it may "
                "merge into the token embeddings before the first layer")
    emb = model.get_submodule(path)
    vocab, dim = emb.weight.shape
    ids = torch.tensor([_plain_ids(config, vocab)], dtype=torch.long)
    seen: list[tuple[torch.Tensor, int, tuple, dict]] = []
    fake: list[torch.Tensor] = []

    def replace(_module, _args, _out):
        g = torch.Generator().manual_seed(len(seen))
        fake.append(torch.randn(*ids.shape, dim, generator=g).to(emb.weight.dtype))
        return fake[-1]

    def stop(_module, args, kwargs):
        t = fake[-1] if fake else None
        seen.append((t, t._version if t is not None else 0, args, kwargs))
        raise _Stop

    hooks = [emb.register_forward_hook(replace), first_layer.register_forward_pre_hook(stop, with_kwargs=True)]
    try:
        with torch.no_grad():
            for _ in range(2):
                try:
                    model(input_ids=ids, attention_mask=torch.ones_like(ids))
                except _Stop:
                    pass
    except Exception as exc:  # noqa: BLE001 (any failure of the trial keeps the table here)
        return f"its forward did not run on token ids alone ({type(exc).__name__})"
    finally:
        for h in hooks:
            h.remove()
    if len(seen) != 2 or len(fake) != 2:
        return "its forward did not hand the embedding's output to the first decoder layer"
    rest = []
    for made, version, args, kwargs in seen:
        hidden = args[0] if args else kwargs.get("hidden_states")
        if hidden is not made or made._version != version:
            return "it changes the token embeddings before the first decoder layer (a scale, merged features)"
        tree, tensors = flatten(args, kwargs)
        if sum(t is made for t in tensors) != 1:
            return "its first decoder layer reads the token embeddings in more than one argument"
        rest.append((tree, [t for t in tensors if t is not made]))
    (tree_a, a), (tree_b, b) = rest
    if tree_a != tree_b or len(a) != len(b) or not all(
            x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b)):
        return "it derives the first decoder layer's other arguments from the token embeddings' values"
    return None


def _plain_ids(config, vocab: int) -> list[int]:
    """Three token ids that no setting of the config names (not an image or pad token, say)."""
    special: set[int] = set()

    def walk(d) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v)
            elif isinstance(k, str) and ("token" in k or k.endswith("_id")):
                for x in v if isinstance(v, (list, tuple)) else (v,):
                    if type(x) is int:
                        special.add(x)

    if config is not None and callable(getattr(config, "to_dict", None)):
        walk(config.to_dict())
    plain = [i for i in range(1, vocab) if i not in special][:3]
    return plain if len(plain) == 3 else [0, 0, 0]


def placeholder(ids: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """What the embedding answers on the client: the shape and dtype of its output, NaN everywhere."""
    return torch.full((*ids.shape, dim), float("nan"), dtype=dtype, device=ids.device)
