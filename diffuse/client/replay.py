"""A language model's passes since its cache was last started anew, kept so that a repaired route can
rebuild the new nodes' caches exactly as they were built (``diffuse.client.ring.Ring``).

Each pass is kept as its tensors' raw bytes, in one buffer, with their dtypes and shapes; what one pass
shares with the one before (its call tree, return map and part, almost always equal from one decoding
step to the next) is kept once. A decoding step then costs its own tensor bytes and a few hundred bytes
more, and a session holds at most as many passes as the model's ``max_position_embeddings`` allow (each
pass adds at least one position, and nodes refuse a cache beyond that: ``diffuse.plan.kvcache``). Replayed
tensors are rebuilt bit for bit.
"""

from __future__ import annotations

import torch


def _shared(previous, value):
    """``previous`` when equal to ``value`` (kept once), else ``value``."""
    try:
        return previous if previous is not None and previous == value else value
    except Exception:  # a value that does not compare (a tensor inside): kept as it is
        return value


class Replay:
    """Passes as ``Ring.send`` took them: ``(stack, tree, tensors, rmap, patch, digests, part)``."""

    def __init__(self):
        self._kept: list[tuple] = []

    def __len__(self) -> int:
        return len(self._kept)

    def __bool__(self) -> bool:
        return bool(self._kept)

    def clear(self) -> None:
        self._kept = []

    def append(self, sent: tuple) -> None:
        stack, tree, tensors, rmap, patch, digests, part = sent
        metas = tuple((t.dtype, tuple(t.shape)) for t in tensors)
        blob = b"".join(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors)
        last = self._kept[-1] if self._kept else (None,) * 8
        self._kept.append((stack, _shared(last[1], tree), _shared(last[2], metas), blob, _shared(last[4], rmap),
                           patch, digests, _shared(last[7], part)))

    def __iter__(self):
        for stack, tree, metas, blob, rmap, patch, digests, part in self._kept:
            tensors, at = [], 0
            for dtype, shape in metas:
                n = dtype.itemsize
                for d in shape:
                    n *= d
                raw = torch.frombuffer(bytearray(blob[at:at + n]), dtype=torch.uint8) if n else \
                    torch.empty(0, dtype=torch.uint8)
                tensors.append(raw.view(dtype).reshape(shape))
                at += n
            yield stack, tree, tensors, rmap, patch, digests, part
