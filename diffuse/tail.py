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
    """The ``k`` largest logits of each row and their ids; equal values in id order, exactly as the first ``k`` of a
    stable descending sort of the row. ``topk`` finds each row's ``k``-th value; only the values at or above it
    (``k`` of them, more where others tie with it) are sorted, a twentieth of the time of sorting the whole row at
    a vocabulary of 8192. A row holding NaN is sorted whole (``topk`` and the sort each order NaN their own way)."""
    n = logits.shape[-1]
    if not 0 < k < n or logits.numel() == 0 or not logits.is_floating_point():
        return _sorted_top(logits, k)
    rows = logits.reshape(-1, n)
    if bool(torch.isnan(rows).any()):
        return _sorted_top(logits, k)
    kth = torch.topk(rows, k, dim=-1, sorted=True).values[:, -1:]
    kept = rows >= kth  # every value above the k-th, and every one equal to it
    counts = kept.sum(dim=-1)
    if bool((counts == k).all()):  # no tie across the k-th value: k per row, in id order
        ids = kept.nonzero()[:, 1].view(-1, k)
        ids, values = _stable_desc(ids, rows.gather(1, ids))
    else:
        picked = [_stable_desc(row.nonzero().view(1, -1), r.view(1, -1)[:, row]) for row, r in zip(kept, rows)]
        ids = torch.cat([i[:, :k] for i, _ in picked])
        values = torch.cat([v[:, :k] for _, v in picked])
    shape = (*logits.shape[:-1], k)
    return ids.reshape(shape).contiguous(), values.reshape(shape).contiguous()


def _stable_desc(ids: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` (ascending in each row) and their ``values``, each row ordered by value, largest first, equal values
    keeping their order."""
    values, order = torch.sort(values, dim=-1, descending=True, stable=True)
    return ids.gather(-1, order), values


def _sorted_top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = torch.sort(logits, dim=-1, descending=True, stable=True)
    return ids[..., :k].contiguous(), values[..., :k].contiguous()


TILE = 64  # rows of the head's weight one exact re-computation reads (``JointHead``)
MAX_JOINT_CANDIDATES = 512  # more candidates than this in a row: that row's tail runs alone


class JointHead:
    """A plain ``Linear`` head over the rows of several sessions in one matrix product, each row answered with the
    best candidates, and their bits, that the head run on that row alone gives.

    The joint product's last bits differ from a row's own (a matrix-matrix kernel sums in another order than a
    matrix-vector one), by at most ``margin`` (twice the bound on a dot product's rounding error, whatever the
    order of its sums). So each row's candidates are the ids within twice that of its ``k``-th joint value, which
    holds every id that can be among its ``k`` best alone; their exact logits are computed again on the row alone,
    ``TILE`` rows of the weight at a time, which gives the bits the whole head gives on that row (checked once per
    head, on the first row it answers, over the whole vocabulary: where it does not hold, every row runs alone)."""

    def __init__(self, head: nn.Linear):
        self.weight = head.weight.detach()
        self.bias = head.bias.detach() if head.bias is not None else None
        width = self.weight.shape[1]
        unit = torch.finfo(self.weight.dtype).eps / 2
        gamma = (width + 2) * unit / (1 - (width + 2) * unit)
        largest_bias = float(self.bias.abs().max()) if self.bias is not None else 0.0
        # |sum - exact| <= gamma * (sum |w_i x_i| + |b|) <= gamma * (|w|_2 |x|_2 + |b|); two sums: twice that,
        # and twice again for the rounding of the norms themselves
        self._per_norm = 4 * gamma * float(self.weight.norm(dim=1).max())
        self._fixed = 4 * gamma * largest_bias
        self.checked: bool | None = None  # whether re-computing by tiles gives the whole head's bits (None: not yet)

    def _tile(self, x: torch.Tensor, start: int) -> torch.Tensor:
        bias = self.bias[start:start + TILE] if self.bias is not None else None
        return torch.nn.functional.linear(x, self.weight[start:start + TILE], bias)

    def agrees(self, head: nn.Module, x: torch.Tensor) -> bool:
        """Whether the head's logits on ``x`` (one row, as a lone pass hands it) come out bit for bit from its
        tiles; learnt once."""
        if self.checked is None:
            whole = head(x)
            tiles = torch.cat([self._tile(x, a) for a in range(0, self.weight.shape[0], TILE)], dim=-1)
            self.checked = whole.dtype == tiles.dtype and torch.equal(_bits(whole), _bits(tiles))
        return self.checked

    def top(self, rows: list[torch.Tensor], k: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """For each of ``rows`` (each ``1 x 1 x width``, as a lone pass hands it to the head): its ``k`` best ids
        and values, as ``top_candidates`` finds them in the head's logits of that row alone; None for a row that
        must run alone (a value that is not finite, too many candidates)."""
        joined = torch.cat([r.reshape(1, -1) for r in rows])
        approx = torch.nn.functional.linear(joined, self.weight, self.bias)
        kth = torch.topk(approx, k, dim=-1).values[:, -1]
        margins = self._per_norm * joined.norm(dim=-1) + self._fixed
        out: list = []
        for x, row, low in zip(rows, approx, kth - 2 * margins):
            if not bool(torch.isfinite(row).all()) or not bool(torch.isfinite(low)):
                out.append(None)
                continue
            ids = (row >= low).nonzero().flatten()  # ascending
            if len(ids) > MAX_JOINT_CANDIDATES:
                out.append(None)
                continue
            tiles, where = torch.unique_consecutive(ids // TILE, return_inverse=True)  # ids ascending: tiles too
            # every tile but the vocabulary's last is TILE long, and the last comes last: id's place is found so
            exact = torch.cat([self._tile(x, t * TILE).reshape(-1) for t in tiles.tolist()])
            values = exact[where * TILE + ids % TILE]
            best, order = torch.sort(values, descending=True, stable=True)
            out.append((ids[order[:k]].view(1, 1, k), best[:k].reshape(1, 1, k).contiguous()))
        return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def joint_head(head: nn.Module) -> JointHead | None:
    """The head's ``JointHead`` (kept on the head), or None where rows of several sessions cannot share its
    product: not one plain ``Linear``, not float32/float64 on the CPU."""
    if type(head) is not nn.Linear or head.weight.device.type != "cpu" \
            or head.weight.dtype not in (torch.float32, torch.float64):
        return None
    joint = head.__dict__.get("_diffuse_joint")
    if joint is None:
        joint = head.__dict__["_diffuse_joint"] = JointHead(head)
    return joint


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
