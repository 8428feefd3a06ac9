"""A language model's ends on a split client: the embedding and head stand-ins, generate's processors, the cache.

A language model's stack is called with its key/value cache; the stand-in
(``diffuse.client.standin``) collects every layer's call and hands the pass here
(``LanguageEnds.run_layers``). The client's cache gets its shadow
(``diffuse.plan.kvcache``). Inside ``generate``, which always calls the output head,
the pass is held back until the head is called, so that the last node runs the
final norm and the head too and sends back only the candidates decoding reads
(``diffuse.lm.heads``); the head's side is ``diffuse.lm.client_head`` (``HeadEnd``, and
``diffuse.lm.client_generate.GenerateCapture``, which captures generate's own logits processors and token
history so that, when it samples, the last node applies them and draws,
``diffuse.lm.sampling``). When asked (``embedding_on_node``) and where the model's
forward allows, the input embedding is a stand-in too and the pass carries token
ids for the first node to embed (``diffuse.lm.client_embedding``). Every module replaced and
every hook registered here is recorded in the splitter's ``Changes``, and undone
on release.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from torch import nn

from diffuse.plan.calltree import flatten_layers
from diffuse.changes import is_freed
from diffuse.errors import DiffuseError
from diffuse.lm.client_cache import ClientCaches
from diffuse.lm.client_embedding import EmbeddingEnd
from diffuse.lm.client_generate import GenerateCapture
from diffuse.lm.client_head import FREED_FROM, HeadEnd
from diffuse.wire.passes import Embed, Tail
from diffuse.plan.contracts import ReturnMap, StackPlan
from diffuse.plan.planner import learn_call


@dataclass
class _Pending:
    """A language model's pass held back until its output head is called (see ``diffuse.lm.heads``)."""

    stack: StackPlan
    calls: list
    cache: object
    rmap: ReturnMap
    fresh: bool
    placeholder: torch.Tensor  # what the last layer answered meanwhile: its input, untouched
    ids: torch.Tensor | None = None  # the token ids the first node embeds, when the pass carries them
    norm: str | None = None  # the final norm's path, once it has run on the placeholder
    normed: torch.Tensor | None = None


@dataclass
class SideOutput(torch.Tensor):
    """What stands in, before the last layer, for a tensor a layer returns besides its hidden state and that
    replaces none of its inputs (BLOOM's attention weights, T5's position biases): empty, and ``output`` says
    which returned position it stands for. A model may hand it to the next layer as it is (T5 gives block 0's
    biases to every later block): the pass then threads that output into the slot it takes there
    (``threaded_sides``); anything else done with it is refused (``diffuse.client.standin.StandIn``)."""

    output: int


def _side(position: int) -> SideOutput:
    t = torch.empty(0).as_subclass(SideOutput)
    t.output = position
    return t


def shaped(rmap: ReturnMap, hidden):
    """``hidden`` in the structure a layer with one stream returns: itself, or a tuple with it where the stream
    is, None where the layer returned None and an empty ``SideOutput`` where it returned a side output."""
    if rmap.single:
        return hidden
    return tuple(hidden if slot is not None else None if name is None else _side(j)
                 for j, (slot, name) in enumerate(zip(rmap.outputs, rmap.names)))


def threaded_sides(calls: list[tuple[tuple, dict]], rmap: ReturnMap) -> ReturnMap:
    """The pass's return map: ``rmap`` with each side output the model handed on to later layers threaded into
    the slot it sits in in their calls (so the node computing it hands it to the next layer, and the next node,
    as the model would have)."""
    if rmap.single:
        return rmap
    _, _, tensors = flatten_layers(calls)
    sides = {}
    for slot, t in enumerate(tensors):
        if isinstance(t, SideOutput):
            if getattr(t, "output", None) is None or t.output in sides or rmap.outputs[t.output] is not None:
                raise DiffuseError("a layer was handed a side output no layer of this pass returned as it is")
            sides[t.output] = slot
    return rmap.with_sides(sides)


class LanguageEnds:
    """The ends of a language model split by ``splitter`` (``diffuse.client.standin.Splitter``): its passes, its
    output head answered by the last node, and its input embedding answered by the first where allowed."""

    def __init__(self, splitter):
        self.splitter = splitter
        self.caches = ClientCaches()
        self.head_end = HeadEnd(self)  # the output head (diffuse.lm.client_head)
        self.embedding = EmbeddingEnd(self)  # the input embedding (diffuse.lm.client_embedding)
        self.pending: _Pending | None = None
        self.generation = GenerateCapture(self)

    @property
    def model(self) -> nn.Module:
        return self.splitter.denoiser

    # -- installing ------------------------------------------------------------------------------------
    @property
    def embed(self) -> tuple[str, nn.Module] | None:
        """The input embedding, (path, the original), when the first node holds the table."""
        return self.embedding.table

    def decide(self) -> None:
        """What is decided on the model as loaded, before any stand-in is in place (once)."""
        self.embedding.decide()

    def install(self, changes) -> None:
        """The head's and the embedding's stand-ins, and the hooks that watch the model around them."""
        self.head_end.install(changes)
        self.embedding.install(changes)

    def attach(self, changes) -> None:
        if self.head_end.head is not None and callable(getattr(type(self.model), "generate", None)):
            self.generation.wrap(changes)

    def detach(self) -> None:
        self.pending = None
        self.embedding.embedded = None
        self.head_end.forget_answer()

    def freed(self) -> list[tuple[nn.Module, str]]:
        """The ends whose weights a node holds now, each with what calling it says."""
        out = []
        for end, where in ((self.embed, "first"), (self.head_end.head, "last")):
            if end is not None and is_freed(end[1]):
                out.append((end[1], f"this model's {'embedding table' if where == 'first' else 'output head'} "
                                    f"({end[0]}) is held by the {where} node: call the model inside "
                                    "`with diffuse.split(...)`, or load its weights again"))
        return out

    def free_remote_weights(self) -> None:
        """The client frees the embedding table once a pass carried token ids, the head once the last node ran
        it; a head tied to the table goes when both have happened."""
        e, h = self.embedding, self.head_end
        if e.table is not None and not e.freed and e.passes:
            if not h.head_tied:
                to_meta(e.table[1])
                e.freed = True
            elif h.tail_passes and not h.head_freed:
                to_meta(e.table[1])
                to_meta(h.head[1])  # each module's own parameter goes (moving one leaves the other)
                e.freed = h.head_freed = True
        if h.head is not None and not h.head_freed and not h.head_tied and h.tail_passes:
            to_meta(h.head[1])  # the last node holds it now
            h.head_freed = True

    # -- passes ----------------------------------------------------------------------------------------
    def run_layers(self, stack: StackPlan, calls: list[tuple[tuple, dict]], cache):
        """A language model's pass: every layer's call through the ring at once; the client's cache gets
        its shadow (see ``diffuse.plan.kvcache``)."""
        h = self.head_end
        if h.replay is not None:  # the forward runs again on a pass the nodes already answered
            answer, h.replay = h.replay, None
            return answer
        placeholder = calls[0][0][0] if calls[0][0] else calls[0][1].get("hidden_states")
        h.forget_answer()  # a new pass: the heads' last answer is for another hidden state
        ids = self.embedding.take_ids(placeholder)
        first = self.splitter.first_block(stack.path)
        if first is not None:
            self._learn(stack, first, calls[0], cache, placeholder, ids)
        rmap = self.splitter.plan.return_maps[stack.path]
        fresh = self.caches.fresh(stack.path, cache)
        if self.pending is not None:  # a pass held back that nothing read: send it first
            self.send_pending(None)
        if h.head is not None and self.generation.active and len(rmap.streams) == 1 \
                and isinstance(placeholder, torch.Tensor) and h.tail_follows is not False:
            self.pending = _Pending(stack, calls, cache, rmap, fresh, placeholder, ids)
            return shaped(rmap, placeholder)
        return self._send(stack, calls, cache, rmap, fresh, None, ids)

    def layer_answer(self, stack: StackPlan, hidden, call: tuple, cache):
        """What a language model's layers answer before the last one is called: ``hidden``, untouched, in the
        structure the first layer returns (learned here on the stack's first pass, as ``run_layers`` would)."""
        first = self.splitter.first_block(stack.path)
        if self.splitter.ring is not None and first is not None:
            e = self.embedding.embedded
            self._learn(stack, first, call, cache, hidden, e.ids if e is not None and e.placeholder is hidden else None)
        rmap = self.splitter.plan.return_maps.get(stack.path)
        return hidden if rmap is None or len(rmap.streams) != 1 else shaped(rmap, hidden)

    def _learn(self, stack: StackPlan, block: nn.Module, call: tuple, cache, placeholder, ids) -> None:
        """The first layer runs once here to learn its return map, on a copy of the cache it would write (and on
        the real embeddings, not the placeholder, while the table is still here)."""
        args, kwargs = call
        scratch = copy.deepcopy(cache)
        real = None
        if ids is not None:
            real = self.embed[1](ids) if self.embed[1].weight.device.type != "meta" else \
                torch.randn(placeholder.shape, generator=torch.Generator().manual_seed(0)).to(placeholder.dtype)
        swap = {id(cache): scratch, **({id(placeholder): real} if real is not None else {})}
        args = tuple(swap.get(id(a), a) for a in args)
        kwargs = {k: swap.get(id(v), v) for k, v in kwargs.items()}
        self.splitter.learned(stack, *learn_call(stack, args, kwargs, block))

    def _send(self, stack: StackPlan, calls, cache, rmap: ReturnMap, fresh: bool, tail: Tail | None,
              ids: torch.Tensor | None = None):
        t0 = time.perf_counter()
        try:
            return self._pass(stack, calls, cache, rmap, fresh, tail, ids)
        finally:
            self.splitter.stand_in_s += time.perf_counter() - t0

    def _pass(self, stack: StackPlan, calls, cache, rmap: ReturnMap, fresh: bool, tail: Tail | None,
              ids: torch.Tensor | None = None):
        rows = calls[0][0][0] if calls[0][0] else calls[0][1].get("hidden_states")
        embed = None
        if ids is not None:  # the token ids travel in the hidden state's slot; the first node embeds them
            calls = [(tuple(ids if a is rows else a for a in args), {k: ids if v is rows else v for k, v in kw.items()})
                     for args, kw in calls]
            _, _, tensors = flatten_layers(calls)
            slot = next(i for i, t in enumerate(tensors) if t is ids)
            if slot not in rmap.streams:
                raise DiffuseError(f"{stack.path}: the first layer's input is not the slot its output threads into, "
                                   "so the first node cannot put the token embeddings there")
            embed = Embed(slot, str(rows.dtype).removeprefix("torch."))
        record, crops = self.caches.edits(cache)
        out = self.splitter.ring.call_layers(stack.path, calls, threaded_sides(calls, rmap), cache, fresh, tail,
                                             embed=embed, edits=(record, () if fresh else crops))
        self.caches.shadow(cache, range(stack.length), rows)
        if ids is not None:
            self.embedding.passes += 1
            self.free_remote_weights()
        return out

    def send_pending(self, tail: Tail | None):
        p, self.pending = self.pending, None
        return self._send(p.stack, p.calls, p.cache, p.rmap, p.fresh, tail, p.ids)


def to_meta(module: nn.Module) -> None:
    """``module``'s weights freed (a node holds them); the device they were on is kept (``FREED_FROM``, beside
    the module, not on it), so that a later split's stand-in for it answers ``generate``'s ``model.device`` with
    that device, not meta."""
    first = next(module.parameters(), None)
    if first is not None and first.device.type != "meta":
        FREED_FROM[module] = first.device
    module.to("meta")
