"""What the model reads of a block outside its stack's loop, where the stand-in holds a ``BlockProxy``
(``diffuse.client.proxies``): served from the block's weightless copy where that answers exactly, else
refused in one line that names what was read.

A model may read a block's attributes to size or condition something (``self.blocks[0].num_heads``,
``self.blocks[0].norm.weight.shape``). The block's copy on the client has its structure and its plain
attributes but no weights (they are on the nodes), so ``served`` answers:

- plain values (numbers, strings, None, ``torch.dtype``, ``torch.Size``, enums, and tuples, lists and dicts of
  them) as the block holds them: what the whole model answers;
- a tensor (a parameter or buffer) as a ``TensorView``: its shape, dtype, dimensions and element count; anything
  that would read its values (an operation, an index, a number) raises ``ReadsBlocks``;
- anything else (a submodule, an attention processor, a config) as a ``View``, whose attributes, items and
  length are served by the same rules; calling it (a submodule's forward, a method) raises ``ReadsBlocks``.

The weightless dry call (``diffuse.client.weightless``) runs the model's forward with the same proxies, so a
read that cannot be served is refused there, before any node starts.
"""

from __future__ import annotations

import enum

import torch

from diffuse.errors import ReadsBlocks

PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.Size, enum.Enum)


def plain(value) -> bool:
    """Whether ``value`` is a plain value a block's weightless copy holds as the block does."""
    if isinstance(value, PLAIN):
        return True
    if isinstance(value, (tuple, list, frozenset, set)):
        return all(plain(v) for v in value)
    if isinstance(value, dict):
        return all(plain(k) and plain(v) for k, v in value.items())
    return False


def served(value, where: str):
    """What reading ``where`` (e.g. ``blocks[0].norm.weight``) answers, ``value`` being what the weightless
    copy holds there: see the module's docstring."""
    if plain(value):
        return type(value)(value) if isinstance(value, (list, dict, set)) else value  # a copy: a read changes nothing
    if isinstance(value, torch.Tensor):
        return TensorView(value, where)
    return View(value, where)


def _refused(where: str, what: str) -> ReadsBlocks:
    stack = where.split("[", 1)[0]
    return ReadsBlocks(f"the model {what} {where} outside the loop over {stack}: the blocks' weights are on the "
                       "nodes, not here, so it cannot be split")


class View:
    """An object of a block read outside the stack (a submodule, a processor, a config): its attributes, items
    and length served by the same rules; calling it is refused."""

    def __init__(self, target, where: str):
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_where", where)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return served(getattr(self._target, name), f"{self._where}.{name}")

    def __getitem__(self, key):
        return served(self._target[key], f"{self._where}[{key!r}]")

    def __len__(self) -> int:
        return len(self._target)

    def __iter__(self):
        for i, item in enumerate(self._target):
            yield served(item, f"{self._where}[{i}]")

    def __call__(self, *args, **kwargs):
        raise _refused(self._where, "calls")

    def __setattr__(self, name: str, value) -> None:
        raise _refused(f"{self._where}.{name}", "sets")

    def __repr__(self) -> str:
        return f"<{self._where}, held by nodes: {type(self._target).__name__}>"


class TensorView:
    """A block's tensor read outside the stack: its shape, dtype, dimensions and element count; its values are
    on the nodes, so any operation on it, index or conversion raises ``ReadsBlocks`` naming it."""

    def __init__(self, tensor: torch.Tensor, where: str):
        self.shape, self.dtype, self.ndim, self._where = tensor.shape, tensor.dtype, tensor.ndim, where

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return self.ndim

    def numel(self) -> int:
        return self.shape.numel()

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """Any torch operation handed it (``x + w``, ``F.linear(x, w)``, ``torch.cat``): refused, naming it."""
        given = [*args, *(kwargs or {}).values()]
        given += [a for arg in given if isinstance(arg, (list, tuple)) for a in arg]  # torch.cat([x, w])
        for arg in given:
            if isinstance(arg, TensorView):
                raise _refused(arg._where, "reads the values of")
        raise ReadsBlocks("the model reads the values of a block's tensor outside its stack's loop: the blocks' "
                          "weights are on the nodes, not here, so it cannot be split")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise _refused(f"{self._where}.{name}", "reads")

    def _values(self, *_):
        raise _refused(self._where, "reads the values of")

    __getitem__ = __float__ = __int__ = __bool__ = __index__ = __array__ = __iter__ = __len__ = _values
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _values
    __matmul__ = __rmatmul__ = __pow__ = __neg__ = __eq__ = __lt__ = __gt__ = __le__ = __ge__ = _values
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"<{self._where}: {tuple(self.shape)} {self.dtype}, held by nodes>"
