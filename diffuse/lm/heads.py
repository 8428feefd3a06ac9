"""The end of a language model's pass on the last node: final norm, output head, top candidates home.

A language model's forward, after its decoder stack, normalises the last
hidden state, keeps the rows it needs (the last position, when generating) and
projects them onto the vocabulary. Split, that tail runs on the node holding the
last layer, and only what decoding needs comes back: for plain greedy decoding
the best ``GREEDY_TOP`` candidates of each row (ids and exact values, ties
ordered as argmax breaks them: lowest id first), from which the client builds
logits that are ``-inf`` elsewhere, so ``generate`` picks the very same token.
With sampling the last node also applies ``generate``'s processors to the whole
row and draws there (``diffuse.lm.sampling``): the drawn token comes home with the
same best candidates. Greedy decoding under a logits processor (a repetition
penalty, say) gets the whole row of logits, so nothing is picked from a
shortlist.

Nothing about a family is named: the head is the model's own
``get_output_embeddings()``; the norm is the module the model applies to the
stack's answer (a leaf whose parameters are vectors), seen at the first pass;
the rows are read from the view the model takes of the norm's output. The
decoder stand-in holds the layers' calls back until the head is called
(``Splitter.run_layers``), only inside ``generate``, which always calls the
head; a module other than a norm that reads the stack's answer gets the real
hidden state at once instead (the pass is sent then, and the head runs on the
client). Outside ``generate`` (a direct forward, the base model alone) every
pass is sent at the last layer and the answer is the real hidden state.

A model may have several heads side by side: its output head is then a list of
``Linear`` of one shape reading the final norm's output (MusicGen: one head per
codebook, their logits stacked per codebook and the batch flattened, batch
then codebook). The last node runs every head and lays their logits out the
same way (``stack_heads``); ``HeadListStandIn`` hands each head its part of
the answer. Under classifier-free guidance (the batch doubled inside
``generate``) both halves are on the last node together, so ``generate``'s
processors, the guidance combination among them, run there with greedy
decoding too, and only the codes and ``LISTED_TOP`` raw candidates per row
come home (ids as int32).
"""

from __future__ import annotations

import copy

import torch
from torch import nn


GREEDY_TOP = 8
LISTED_TOP = 2  # raw candidates per row that come home with the codes a node picked for a list of heads


def head_path(model: nn.Module) -> str | None:
    """Where the model's output head sits (``get_output_embeddings()``), or None."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        return None
    return next((name for name, m in model.named_modules() if m is head), None)


def is_head_list(module: nn.Module) -> bool:
    """A list of ``Linear`` heads of one shape, side by side (each reads the same hidden state)."""
    if not isinstance(module, nn.ModuleList) or len(module) == 0:
        return False
    heads = list(module)
    return all(type(h) is nn.Linear for h in heads) and len({(h.in_features, h.out_features) for h in heads}) == 1


def head_vocab(module: nn.Module) -> int:
    """The logits per row the head (or each head of a list) answers."""
    return module[0].out_features if is_head_list(module) else module.weight.shape[0]


def is_norm(module: nn.Module) -> bool:
    """A leaf module whose parameters are all vectors (a LayerNorm or RMSNorm, whatever its class), or that has
    none at all (OLMo's norms carry no weights): run on the last node, it computes what it computes here."""
    params = list(module.parameters())
    return next(module.children(), None) is None and all(p.dim() == 1 for p in params)


# generate settings under which greedy decoding reads only the best logits (each one here would change which
# token wins with values outside the best few, or reads the whole row)
_WHOLE_ROW = ("repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size",
              "encoder_no_repeat_ngram_size", "bad_words_ids", "sequence_bias", "suppress_tokens",
              "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id", "forced_decoder_ids",
              "exponential_decay_length_penalty", "renormalize_logits", "watermarking_config", "guidance_scale",
              "diversity_penalty", "low_memory", "penalty_alpha", "output_scores")
_NEUTRAL = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
            "encoder_no_repeat_ngram_size": 0, "renormalize_logits": False, "guidance_scale": 1.0,
            "diversity_penalty": 0.0, "low_memory": False, "output_scores": False}


def effective_config(model, kwargs: dict):
    """The generation config a ``generate(**kwargs)`` call runs with (None where the model has none)."""
    config = copy.deepcopy(kwargs.get("generation_config") or getattr(model, "generation_config", None))
    for key, value in kwargs.items() if config is not None else ():
        if hasattr(config, key):
            setattr(config, key, value)
    return config


def candidates_needed(config, kwargs: dict) -> int | None:
    """How many candidates per row a ``generate(**kwargs)`` call running with ``config`` (``effective_config``)
    needs back: ``GREEDY_TOP`` for plain greedy decoding, None (the whole row) for sampling or any logits processor,
    until ``generate`` builds its processors (sampling then draws on the last node and ``GREEDY_TOP`` raw candidates
    come home: ``diffuse.lm.sampling``)."""
    if config is None:
        return None
    if kwargs.get("logits_processor") or getattr(config, "do_sample", False) or (getattr(config, "num_beams", 1) or 1) > 1:
        return None
    for key in _WHOLE_ROW:
        value = getattr(config, key, None)
        if value not in (None, _NEUTRAL.get(key), [], {}):
            return None
    return GREEDY_TOP
