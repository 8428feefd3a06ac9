"""The last node's part of a language model's tail: its heads run, the top candidates picked exactly."""

from __future__ import annotations

import torch
from torch import nn


def stack_heads(heads: nn.ModuleList, h: torch.Tensor) -> torch.Tensor:
    """Every head on ``h`` (batch x rows x hidden), laid out as ``generate`` reads a list of heads' logits: stacked
    per head after the batch, then (batch * heads) x rows x vocab. The client checks that the model itself reads
    them so (``diffuse.lm.sampling.DrawnToken``) before a token picked from this layout is taken."""
    logits = torch.stack([head(h) for head in heads], dim=1)
    return logits.reshape(-1, *logits.shape[2:])


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
