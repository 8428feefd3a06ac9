"""Greedy decoding from the best candidates only, checked against what the model does after its head.

Where ``generate`` decodes greedily, the last node can send home the best few
raw logits of each row instead of the whole row (``diffuse.lm.heads``). That is
exact only if nothing changes the logits between the head and the argmax: a
model that caps or scales them (Gemma 2's soft cap) may make the last candidate
that travelled tie with the best, and then an id that never travelled could
win. ``ShortlistCheck``, the first logits processor of such a ``generate``,
learns on the first pass (which brings the whole row) whether the model changes
its logits, and refuses a tie in one line rather than answer wrong.
"""

from __future__ import annotations

import torch

from diffuse.errors import DiffuseError


class ShortlistCheck:
    """The first logits processor of a greedy ``generate`` whose head may answer from the best candidates only.

    On the model's first such pass the whole last row came home: comparing it with what ``generate`` is about to
    pick from tells whether the model changes its logits after the head (a soft cap, a scale). If it does not,
    the best ``top`` candidates decide every later pass; if it does, whole rows keep coming, since a cap that
    saturates makes the last candidate tie with the best and an id that never travelled would win the argmax.
    A pass answered from the best candidates is checked all the same: such a tie is refused in one line rather
    than answered wrong. ``capture`` is the ``diffuse.lm.client_ends.GenerateCapture`` whose rows it reads."""

    def __init__(self, capture, top: int):
        self.capture, self.top = capture, top

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        gen = self.capture
        row, whole = self._row(gen.shortlist, input_ids), self._row(gen.whole_row, input_ids)
        if whole is not None:
            if gen.logits_changed is None and whole.shape == scores.shape:
                gen.logits_changed = not torch.equal(scores.detach().cpu().to(whole.dtype), whole)
                if not gen.logits_changed:
                    gen.top = self.top  # the best few decide from the next pass on
            return scores
        if row is None or row.shape != scores.shape:
            return scores
        seen = scores.detach().cpu().to(row.dtype)
        if torch.equal(seen, row):
            return scores  # nothing changed after the head: the best candidates decide
        for r in range(row.shape[0]):
            listed = torch.isfinite(row[r]).nonzero().flatten()
            if not len(listed):
                continue
            last = listed[torch.argmin(row[r, listed])]  # the lowest raw value that travelled
            if seen[r, last] >= seen[r, listed].max():
                raise DiffuseError("the model changes its logits after the output head (a soft cap or a scale) and "
                                   f"its best {len(listed)} candidates tie after it, so tokens that stayed on the last "
                                   "node could win greedy decoding; Diffuse refuses rather than guess")
        return scores

    def _row(self, answered: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The row of the last pass's answer (batch x rows x vocabulary) that ``generate`` processes now: the one at
        the position of the history's last token (a verifying pass answers one row per drafted token, and one)."""
        if answered is None or answered.dim() != 3:
            return None
        r = input_ids.shape[-1] - 1 - self.capture.rows_at
        return answered[:, r] if 0 <= r < answered.shape[1] else None
