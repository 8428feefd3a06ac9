"""The stand-in of one block stack: what the model's code calls where the stack's blocks used to be.

A ``StandIn`` is an ordinary ``nn.ModuleList`` of parameterless ``BlockProxy``
modules, one per block, so the denoiser's own loop (``for block in
self.blocks``, ``enumerate``, ``len``) runs unchanged. The first proxy ships
the call through the ring (``diffuse.client.standin.Splitter.run_stack``) and answers
with what the stack's last block returned; the others, called in order with
that answer threaded back in, hand the same answer on.

A language model's stack is called with its key/value cache (``diffuse.plan.kvcache``)
and may hand each layer its own arguments (a mask per attention kind). Such a
stack's calls are collected instead: each proxy but the last hands back its
input untouched (in the structure the first layer returns, a tuple for some),
and the last hands every layer's call to the language model's ends
(``diffuse.lm.client_ends``), which ship them in one pass. The model's code between
layers does nothing with what a layer returns but pass it on to the next
(checked): its hidden state, and side outputs handed on as they were returned
(T5's position biases, threaded by the pass from the node that computes them,
``diffuse.lm.client_ends.threaded_sides``), so nothing is lost.

What the model reads of a proxy outside the loop (``self.blocks[0].num_heads``,
``self.blocks[0].norm.weight.shape``) is answered from the block's weightless copy
where that is exact, and refused naming what was read where it is not (its
weights' values, a call into it): ``diffuse.client.blockreads``. The weightless dry
call puts a ``WeightlessStack`` of the same proxies in place of each stack, so such
a refusal comes before any node starts.
"""

from __future__ import annotations


import torch
from torch import nn

from diffuse.client.blockreads import served
from diffuse.plan.calltree import flatten, same_objects
from diffuse.errors import DiffuseError
from diffuse.plan.kvcache import is_cache
from diffuse.lm.client_ends import SideOutput
from diffuse.plan.contracts import StackPlan


class BlockProxy(nn.Module):
    def __init__(self, owner: "StandIn", index: int):
        super().__init__()
        self._owner = (owner,)  # a tuple, so the owner is not registered as a child (no cycle)
        self.index = index

    def forward(self, *args, **kwargs):
        return self._owner[0].block_called(self.index, args, kwargs)

    def __getattr__(self, name: str):
        """An attribute of the block, read outside the loop: from its weightless copy, where that answers
        exactly (``diffuse.client.blockreads.served``)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            block = None if name.startswith("_") else self._owner[0].weightless(self.index)
            if block is None:
                raise
        return served(getattr(block, name), f"{self._owner[0].path}[{self.index}].{name}")

    def extra_repr(self) -> str:
        return f"index={self.index}, remote"


class StandIn(nn.ModuleList):
    """A stack's stand-in: see the module's docstring. ``blocks``: the stack's own blocks (weightless once
    handed out), which answer what the model reads of a block outside the loop."""

    def __init__(self, stack: StackPlan, splitter, blocks: nn.ModuleList | None = None):  # splitter: its Splitter
        super().__init__([BlockProxy(self, i) for i in range(stack.length)])
        self.stack = stack
        self.path = stack.path
        self._splitter = (splitter,)
        self._blocks = (blocks,)  # a tuple, so they are not registered as children
        self._next = 0
        self._answer = None
        self._calls: list | None = None  # a language model's layer calls, collected until the last layer
        self._cache = None

    def __getitem__(self, idx):
        """``self.layers[:n]`` (as language models loop) gives the same proxies in a plain ModuleList."""
        if isinstance(idx, slice):
            return nn.ModuleList(list(self._modules.values())[idx])
        return super().__getitem__(idx)

    def weightless(self, index: int) -> nn.Module | None:
        """Block ``index`` as the client holds it (its weights on the meta device once handed out), or None."""
        return None if self._blocks[0] is None else self._blocks[0][index]

    def block_called(self, index: int, args: tuple, kwargs: dict):
        if index == 0:
            self._cache = _find_cache(args, kwargs)
            self._next = 1
            encoders = getattr(self._splitter[0], "encoders", None)  # diffuse.client.encoders.EncoderPasses
            encoder = encoders is not None and self.path in encoders.paths  # an encoder's layers: collected too
            if self._cache is not None or encoder:
                self._calls = [(args, kwargs)]
                # handed on untouched until the last layer, in the structure the layer returns (a tuple, for a
                # model that reads ``outputs[0]`` before it calls the next layer)
                hidden = args[0] if args else kwargs.get("hidden_states")
                self._answer = encoders.answer(self.stack, hidden, (args, kwargs)) if encoder else \
                    self._splitter[0].lm.layer_answer(self.stack, hidden, (args, kwargs), self._cache)
                if self.stack.length == 1:
                    return self._finish()
                return self._answer
            self._calls = None
            self._answer = self._splitter[0].run_stack(self.stack, args, kwargs)
        elif index != self._next:
            raise DiffuseError(
                f"{self.stack.path}[{index}] was called after {self.stack.path}[{self._next - 1}]: "
                "the denoiser does not run this stack as a chain in list order, so it cannot be split")
        else:
            self._check_threaded(index, args, kwargs)
            self._next += 1
            if self._calls is not None:
                self._calls.append((args, kwargs))
                if index == self.stack.length - 1:
                    return self._finish()
        return self._answer

    def _finish(self):
        calls, cache = self._calls, self._cache
        self._calls = self._cache = None
        self._answer = self._splitter[0].run_layers(self.stack, calls, cache)
        return self._answer

    def _check_threaded(self, index: int, args: tuple, kwargs: dict) -> None:
        """Block ``index`` must receive what the stack answered, untouched: the stand-in
        answers for all blocks at once, so work the denoiser does between blocks would be lost. A language
        model's layer called with the very objects the one before it was (a decoder's layers are), the same
        answer standing for both, passes as that one did (``callplan.same_objects``: not taken apart again)."""
        if index >= 2 and self._calls is not None and same_objects((args, kwargs), self._calls[-1]):
            return
        _, given = flatten(args, kwargs)
        given_ids = {id(t) for t in given}
        answer = self._answer if isinstance(self._answer, (tuple, list)) else (self._answer,)
        sides = {id(o) for o in answer if isinstance(o, SideOutput)}
        if any(isinstance(t, SideOutput) and id(t) not in sides for t in given):
            raise DiffuseError(f"the model changes what {self.stack.path}[{index - 1}] returned besides its hidden "
                               f"state before it hands it to {self.stack.path}[{index}]; Diffuse threads a layer's "
                               "outputs on only as the layer returned them, so it cannot split this stack")
        for out in answer:
            if isinstance(out, torch.Tensor) and id(out) not in given_ids and not isinstance(out, SideOutput):
                raise DiffuseError(
                    f"the denoiser changes what {self.stack.path}[{index - 1}] returned before it calls "
                    f"{self.stack.path}[{index}] (e.g. adds a residual between blocks): this stack is not a plain "
                    "chain, so it cannot be split")
        plan = getattr(self._splitter[0], "plan", None)
        rmap = plan.return_maps.get(self.stack.path) if plan is not None else None
        if self._calls is None and rmap is not None and not rmap.single:  # a whole call: one call plan for all blocks
            for out, slot in zip(answer, rmap.outputs):
                if slot is None and isinstance(out, torch.Tensor) and id(out) in given_ids:
                    raise DiffuseError(
                        f"the denoiser hands what {self.stack.path}[{index - 1}] returned besides its hidden "
                        f"state to {self.stack.path}[{index}], where {self.stack.path}[0] took nothing: the nodes "
                        "call every block as the first was called, so this stack cannot be split")


class WeightlessStack(nn.ModuleList):
    """A stack of the weightless dry call's denoiser (``diffuse.client.weightless``) as a split run shows it to
    the model: the same proxies, each calling its own weightless block here, so what the model reads of a block
    outside the loop is answered, or refused, as in the split run."""

    def __init__(self, path: str, blocks: nn.ModuleList):
        super().__init__([BlockProxy(self, i) for i in range(len(blocks))])
        self.path = path
        self._blocks = (blocks,)

    def weightless(self, index: int) -> nn.Module:
        return self._blocks[0][index]

    def block_called(self, index: int, args: tuple, kwargs: dict):
        return self._blocks[0][index](*args, **kwargs)


def _find_cache(args: tuple, kwargs: dict):
    for x in (*args, *kwargs.values()):
        if is_cache(x):
            return x
    return None
