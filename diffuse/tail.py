"""The end of a language model's pass on the last node: final norm, output head, top candidates home.

A language model's forward, after its decoder stack, normalises the last
hidden state, keeps the rows it needs (the last position, when generating) and
projects them onto the vocabulary. Split, that tail runs on the node holding the
last layer, and only what decoding needs comes back: for plain greedy decoding
the best ``GREEDY_TOP`` candidates of each row (ids and exact values, ties
ordered as argmax breaks them: lowest id first), from which the client builds
logits that are ``-inf`` elsewhere, so ``generate`` picks the very same token.
With sampling the last node also applies ``generate``'s processors to the whole
row and draws there (``diffuse.sampling``): the drawn token comes home with the
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

from diffuse.errors import DiffuseError

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


def stack_heads(heads: nn.ModuleList, h: torch.Tensor) -> torch.Tensor:
    """Every head on ``h`` (batch x rows x hidden), laid out as ``generate`` reads a list of heads' logits: stacked
    per head after the batch, then (batch * heads) x rows x vocab. The client checks that the model itself reads
    them so (``diffuse.sampling.DrawnToken``) before a token picked from this layout is taken."""
    logits = torch.stack([head(h) for head in heads], dim=1)
    return logits.reshape(-1, *logits.shape[2:])


def is_norm(module: nn.Module) -> bool:
    """A leaf module whose parameters are all vectors (a LayerNorm or RMSNorm, whatever its class), or that has
    none at all (OLMo's norms carry no weights): run on the last node, it computes what it computes here."""
    params = list(module.parameters())
    return next(module.children(), None) is None and all(p.dim() == 1 for p in params)


def rows_of(x: torch.Tensor, full: torch.Tensor) -> tuple[int, int] | None:
    """``(start, stop)`` when ``x`` is ``full[:, start:stop]`` (a view sharing its storage), else None."""
    if x.dim() != 3 or full.dim() != 3 or x.shape[0] != full.shape[0] or x.shape[2] != full.shape[2]:
        return None
    if x.untyped_storage().data_ptr() != full.untyped_storage().data_ptr() or x.stride() != full.stride():
        return None
    offset = x.storage_offset() - full.storage_offset()
    if offset < 0 or offset % full.stride(1):
        return None
    start = offset // full.stride(1)
    return (start, start + x.shape[1]) if start + x.shape[1] <= full.shape[1] else None


def top_candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest logits of each row and their ids; equal values in id order (a stable sort)."""
    values, ids = torch.sort(logits, dim=-1, descending=True, stable=True)
    return ids[..., :k].contiguous(), values[..., :k].contiguous()


def logits_from(ids: torch.Tensor, values: torch.Tensor, vocab: int) -> torch.Tensor:
    out = torch.full((*ids.shape[:-1], vocab), float("-inf"), dtype=values.dtype, device=values.device)
    return out.scatter_(-1, ids.long(), values)


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


def candidates_needed(model, kwargs: dict) -> int | None:
    """How many candidates per row a ``generate(**kwargs)`` call needs back: ``GREEDY_TOP`` for plain greedy
    decoding, None (the whole row) for sampling or any logits processor, until ``generate`` builds its processors
    (sampling then draws on the last node and ``GREEDY_TOP`` raw candidates come home: ``diffuse.sampling``)."""
    config = copy.deepcopy(kwargs.get("generation_config") or getattr(model, "generation_config", None))
    if config is None:
        return None
    for key, value in kwargs.items():
        if hasattr(config, key):
            setattr(config, key, value)
    if kwargs.get("logits_processor") or getattr(config, "do_sample", False) or (getattr(config, "num_beams", 1) or 1) > 1:
        return None
    for key in _WHOLE_ROW:
        value = getattr(config, key, None)
        if value not in (None, _NEUTRAL.get(key), [], {}):
            return None
    return GREEDY_TOP


class HeldElsewhere(nn.Module):
    """A stand-in for one of a model's modules whose weights a node holds (the output head, the input
    embedding): code that reads its ``weight`` (tying, resizing) sees the original's."""

    def __init__(self, splitter, original: nn.Module):
        super().__init__()
        self._splitter = (splitter,)
        self._original = (original,)  # tuples: not registered, so their weights are not this module's
        # an empty parameter of the original's dtype and device: a model whose every weight is elsewhere (OLMo's
        # norms have none) still answers ``generate``'s ``self.device`` and ``self.dtype``
        first = next(original.parameters(), None)
        if first is not None:
            self.held_here = nn.Parameter(torch.empty(0, dtype=first.dtype, device=first.device), requires_grad=False)

    @property
    def weight(self):
        return self._original[0].weight


class HeadStandIn(HeldElsewhere):
    """Where the output head was: answers with logits built from what the last node sent back."""

    def __init__(self, splitter, vocab: int, original: nn.Module):
        super().__init__(splitter, original)
        self.out_features = vocab

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._splitter[0].run_head(x)

    def extra_repr(self) -> str:
        return f"out_features={self.out_features}, on the last node"


class _HeadProxy(nn.Module):
    def __init__(self, owner: "HeadListStandIn", index: int):
        super().__init__()
        self._owner = (owner,)
        self.index = index
        self.out_features = owner.out_features

    @property
    def weight(self):
        return self._owner[0]._original[0][self.index].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._owner[0]._splitter[0].run_head_of(self.index, x)

    def extra_repr(self) -> str:
        return f"index={self.index}, on the last node"


class HeadListStandIn(nn.ModuleList):
    """Where a list of heads was: as many parameterless heads, each answering its part of what the last node sent
    back for all of them (the first one called sends the pass)."""

    def __init__(self, splitter, original: nn.ModuleList):
        super().__init__()
        self._splitter = (splitter,)
        self._original = (original,)  # a tuple: not registered, its weights are not this module's
        self.out_features = head_vocab(original)
        self.extend([_HeadProxy(self, i) for i in range(len(original))])


def unsupported_view(path: str) -> DiffuseError:
    return DiffuseError(f"the model hands its output head ({path}) rows it did not slice from the final norm's "
                        "output; Diffuse cannot follow that selection to the last node")
