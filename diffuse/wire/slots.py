"""What a node remembers of a session's non-stream tensors (by slot and content hash), and the client's mirror
of it: each value travels once, then only its hash does."""

from __future__ import annotations

import os
from collections import OrderedDict

SLOT_CACHE_BYTES = int(os.environ.get("DIFFUSE_SLOT_CACHE_BYTES", 256 << 20))  # one session's slot caches, at most


class SlotCache:
    """What a node remembers of one session's non-stream tensors, by slot and content hash.

    The client keeps a mirror (hashes and sizes only) updated by the same rule, so it knows exactly
    what every node on the ring still holds and sends a tensor's bytes only when it is new. A slot is
    any key (the channel and the node use ``(stack, index)``). Two bounds, both least recently used
    first: 4 tensors per slot (alternating guidance branches with room to spare) and ``max_bytes`` in
    all; a tensor larger than ``max_bytes`` is not kept at all (it travels every time).
    """

    CAPACITY = 4

    def __init__(self, max_bytes: int = SLOT_CACHE_BYTES):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._slots: dict = {}
        self._order: OrderedDict = OrderedDict()  # (slot, hash) -> size, least recently used first

    def get(self, slot, h: bytes):
        od = self._slots.get(slot)
        if od is None or h not in od:
            return None
        od.move_to_end(h)
        self._order.move_to_end((slot, h))
        return od[h]

    def __contains__(self, key) -> bool:
        slot, h = key
        return h in self._slots.get(slot, ())

    def __len__(self) -> int:
        return len(self._order)

    def put(self, slot, h: bytes, value=True, nbytes: int = 0) -> None:
        od = self._slots.get(slot)
        if od is None:
            od = self._slots[slot] = OrderedDict()
        if h in od:
            self._drop(slot, h)
            od = self._slots.setdefault(slot, OrderedDict())
        od[h] = value
        self._order[(slot, h)] = nbytes
        self.nbytes += nbytes
        while len(od) > self.CAPACITY:
            self._drop(slot, next(iter(od)))
        while self.nbytes > self.max_bytes and self._order:
            self._drop(*next(iter(self._order)))

    def _drop(self, slot, h: bytes) -> None:
        self.nbytes -= self._order.pop((slot, h))
        od = self._slots[slot]
        del od[h]
        if not od:
            del self._slots[slot]
