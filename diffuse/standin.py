"""Stand-ins: what the denoiser sees where its block stacks used to be.

A ``StandIn`` is an ordinary ``nn.ModuleList`` of parameterless ``BlockProxy``
modules, one per block, so the denoiser's own loop (``for block in
self.blocks``, ``enumerate``, ``len``) runs unchanged. The first proxy ships
the call through the ring and answers with what the stack's last block
returned; the others, called in order with that answer threaded back in, hand
the same answer on. The pipeline's ``__call__`` is never modified.

A language model's stack is called with its key/value cache (``diffuse.kvcache``)
and may hand each layer its own arguments (a mask per attention kind). Such a
stack's calls are collected instead: each proxy but the last hands back its
input untouched, and the last ships every layer's call in one pass and answers
with what the last layer returned. The model's code between layers does nothing
with what a layer returns but pass it to the next (checked), so nothing is lost.

With ``patches > 1`` a stack that carries one stream goes through a
``diffuse.pipefusion.Patcher`` (cut into token patches, pipelined through the
ring); a stack with two streams runs uncut steps, and ``uncut`` says why.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from diffuse.callplan import flatten
from diffuse.errors import DiffuseError
from diffuse.kvcache import ClientCaches, is_cache
from diffuse.pipefusion import Patcher, why_uncut
from diffuse.plan import PATCHABLE, ReturnMap, SlicingPlan, StackPlan
from diffuse.planner import learn_call


class BlockProxy(nn.Module):
    def __init__(self, owner: "StandIn", index: int):
        super().__init__()
        self._owner = (owner,)  # a tuple, so the owner is not registered as a child (no cycle)
        self.index = index

    def forward(self, *args, **kwargs):
        return self._owner[0].block_called(self.index, args, kwargs)

    def extra_repr(self) -> str:
        return f"index={self.index}, remote"


class StandIn(nn.ModuleList):
    def __init__(self, stack: StackPlan, splitter: "Splitter"):
        super().__init__([BlockProxy(self, i) for i in range(stack.length)])
        self.stack = stack
        self._splitter = (splitter,)
        self._next = 0
        self._answer = None
        self._calls: list | None = None  # a language model's layer calls, collected until the last layer
        self._cache = None

    def __getitem__(self, idx):
        """``self.layers[:n]`` (as language models loop) gives the same proxies in a plain ModuleList."""
        if isinstance(idx, slice):
            return nn.ModuleList(list(self._modules.values())[idx])
        return super().__getitem__(idx)

    def block_called(self, index: int, args: tuple, kwargs: dict):
        if index == 0:
            self._cache = _find_cache(args, kwargs)
            self._next = 1
            if self._cache is not None:
                self._calls = [(args, kwargs)]
                # handed on untouched until the last layer
                self._answer = args[0] if args else kwargs.get("hidden_states")
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
        answers for all blocks at once, so work the denoiser does between blocks would be lost."""
        _, given = flatten(args, kwargs)
        given_ids = {id(t) for t in given}
        answer = self._answer if isinstance(self._answer, (tuple, list)) else (self._answer,)
        for out in answer:
            if isinstance(out, torch.Tensor) and id(out) not in given_ids:
                raise DiffuseError(
                    f"the denoiser changes what {self.stack.path}[{index - 1}] returned before it calls "
                    f"{self.stack.path}[{index}] (e.g. adds a residual between blocks): this stack is not a plain "
                    "chain, so it cannot be split")


def _find_cache(args: tuple, kwargs: dict):
    for x in (*args, *kwargs.values()):
        if is_cache(x):
            return x
    return None


class Splitter:
    """Installs stand-ins on a loaded denoiser (once) and runs their calls through the ring attached
    to it. What a stack's first call teaches (call plan, return map) is kept across rings."""

    def __init__(self, denoiser: nn.Module, plan: SlicingPlan):
        self.denoiser = denoiser
        self.plan = plan
        self.originals: dict[str, nn.ModuleList] = {}
        self._first_blocks: dict[str, nn.Module] = {}
        self.ring = None
        self.patcher = None
        self.uncut: dict[str, str] = {}  # stack -> why its steps run uncut although patches > 1
        self.caches = ClientCaches()

    @classmethod
    def on(cls, denoiser: nn.Module, plan: SlicingPlan) -> "Splitter":
        """The denoiser's splitter, installed on first use; the blocks it hands out are freed."""
        splitter = getattr(denoiser, "_diffuse_splitter", None)
        if splitter is None:
            splitter = cls(denoiser, plan)
            splitter.install()
            denoiser._diffuse_splitter = splitter
        elif splitter.plan.model.content_hash != plan.model.content_hash:
            raise DiffuseError("this denoiser was split for another model")
        return splitter

    def install(self) -> None:
        for st in self.plan.stacks:
            parent_path, _, name = st.path.rpartition(".")
            parent = self.denoiser.get_submodule(parent_path) if parent_path else self.denoiser
            original = getattr(parent, name)
            self.originals[st.path] = original
            # keep the first block until the first call has taught us its return map
            self._first_blocks[st.path] = original[0]
            for block in list(original)[1:]:
                block.to("meta")
            setattr(parent, name, StandIn(st, self))

    def attach(self, ring, patches: int = 1) -> None:
        self.ring = ring
        self.patcher = Patcher(ring, patches) if patches > 1 else None
        self.uncut = {}

    def detach(self) -> None:
        self.ring = self.patcher = None

    def run_stack(self, stack: StackPlan, args: tuple, kwargs: dict):
        if self.ring is None:
            raise DiffuseError("this pipeline's blocks are held by nodes: call it inside `with diffuse.split(...)`")
        if stack.path in self._first_blocks:
            block = self._first_blocks.pop(stack.path)
            call_plan, rmap = learn_call(stack, args, kwargs, block)
            self.plan = self.plan.with_call(stack.path, call_plan, rmap)
            block.to("meta")
        rmap = self.plan.return_maps[stack.path]
        if self.patcher is not None and self._patchable(stack.path, rmap):
            tree, tensors = flatten(args, kwargs)
            return self.patcher.run(stack.path, tree, tensors, rmap)
        return self.ring.call(stack.path, args, kwargs, rmap)

    def run_layers(self, stack: StackPlan, calls: list[tuple[tuple, dict]], cache):
        """A language model's pass: every layer's call through the ring at once; the client's cache gets
        its shadow (see ``diffuse.kvcache``)."""
        if self.ring is None:
            raise DiffuseError("this model's layers are held by nodes: call it inside `with diffuse.split(...)`")
        if stack.path in self._first_blocks:
            block = self._first_blocks.pop(stack.path)
            args, kwargs = calls[0]
            # the first layer runs once here to learn its return map, on a copy of the cache it would write
            scratch = copy.deepcopy(cache)
            args = tuple(scratch if a is cache else a for a in args)
            kwargs = {k: scratch if v is cache else v for k, v in kwargs.items()}
            call_plan, rmap = learn_call(stack, args, kwargs, block)
            self.plan = self.plan.with_call(stack.path, call_plan, rmap)
            block.to("meta")
        rmap = self.plan.return_maps[stack.path]
        fresh = self.caches.fresh(stack.path, cache)
        out = self.ring.call_layers(stack.path, calls, rmap, cache, fresh)
        first = out if isinstance(out, torch.Tensor) else next(t for t in out if isinstance(t, torch.Tensor))
        self.caches.shadow(cache, range(stack.length), first)
        return out

    def _patchable(self, path: str, rmap: ReturnMap) -> bool:
        if path in self.uncut:
            return False
        why = why_uncut(rmap, self.plan.patch_policy.get(path, PATCHABLE), path in self.ring.uncut)
        if why:
            self.uncut[path] = why
        return not why

    def held_block_parameters(self) -> int:
        """Elements of the handed-out blocks' parameters still held here (0 once all are freed)."""
        return sum(p.numel() for ml in self.originals.values() for p in ml.parameters() if p.device.type != "meta")
