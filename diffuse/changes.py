"""What a split changes on a model, recorded so that it can be undone.

``Changes`` records each module replaced (``replace``), each hook registered
(``hook``) and each instance attribute set (``set``); ``undo`` puts them back,
last first. ``guard`` makes a module whose weights were handed to a node refuse
to run, in one line, until they are loaded again.

>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
>>> changes = Changes()
>>> original = changes.replace(model, "1", lambda old: nn.Identity())
>>> type(model[1]).__name__, changes.made(model[1])
('Identity', True)
>>> changes.hook(model.register_forward_hook(lambda *_: None))
>>> changes.undo()
>>> model[1] is original, len(model._forward_hooks)
(True, 0)
"""

from __future__ import annotations

from torch import nn

from diffuse.errors import DiffuseError


class Changes:
    """What a split changed on a model: modules replaced, hooks registered, instance attributes set. ``undo``
    puts everything back, last change first."""

    def __init__(self):
        self._undo: list = []
        self._made: set[int] = set()  # ids of the replacing modules and their children

    def replace(self, model: nn.Module, path: str, make) -> nn.Module:
        """The module at ``path`` replaced by ``make(original)``; returns the original."""
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        original = getattr(parent, name)
        new = make(original)
        setattr(parent, name, new)
        self._made.update(id(m) for m in new.modules())
        self._undo.append(lambda: setattr(parent, name, original))
        return original

    def hook(self, handle) -> None:
        self._undo.append(handle.remove)

    def set(self, obj, name: str, value) -> None:
        """``obj.name = value`` on the instance; undone by putting back what the instance had (or nothing)."""
        had, old = name in vars(obj), vars(obj).get(name)
        setattr(obj, name, value)
        self._undo.append(lambda: setattr(obj, name, old) if had else vars(obj).pop(name, None))

    def made(self, module: nn.Module) -> bool:
        return id(module) in self._made

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()
        self._made.clear()

    def __bool__(self) -> bool:
        return bool(self._undo)


def is_freed(module: nn.Module) -> bool:
    """Whether any of ``module``'s weights is on the meta device (handed to a node)."""
    return any(p.device.type == "meta" for p in module.parameters())


def guard(module: nn.Module, why: str):
    """A hook that refuses to run ``module`` while any of its weights is on the meta device (handed to a
    node), saying ``why``; it removes itself at the first call after the weights are loaded again."""
    def check(mod, _args):
        if any(p.device.type == "meta" for p in mod.parameters()):
            raise DiffuseError(why)
        handle.remove()

    handle = module.register_forward_pre_hook(check)
    return handle
