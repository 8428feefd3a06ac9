"""A language model's ends on a split client: the embedding and head stand-ins, generate's processors, the cache.

A language model's stack is called with its key/value cache; the stand-in
(``diffuse.standin``) collects every layer's call and hands the pass here
(``LanguageEnds.run_layers``). The client's cache gets its shadow
(``diffuse.kvcache``). Inside ``generate``, which always calls the output head,
the pass is held back until the head is called, so that the last node runs the
final norm and the head too and sends back only the candidates decoding reads
(``diffuse.tail``); ``GenerateCapture`` captures generate's own logits
processors and token history so that, when it samples, the last node applies
them and draws (``diffuse.sampling``). When asked (``embedding_on_node``) and
where the model's forward allows, the input embedding is a stand-in too and the
pass carries token ids for the first node to embed (``diffuse.embedding``). Every module replaced and every hook
registered here is recorded in the splitter's ``Changes``, and undone on release.
"""

from __future__ import annotations

import copy
import functools
import time
from dataclasses import dataclass

import torch
from torch import nn

from diffuse.callplan import flatten_layers
from diffuse.embedding import TEXT_INPUTS, EmbedStandIn, embedding_path, embedding_stays, placeholder
from diffuse.errors import DiffuseError
from diffuse.kvcache import ClientCaches
from diffuse.passes import Embed, Tail
from diffuse.plan import ReturnMap, StackPlan
from diffuse.planner import learn_call
from diffuse.shortlist import ShortlistCheck
from diffuse.tail import (HeadListStandIn, HeadStandIn, head_path, head_vocab, is_head_list, is_norm, logits_from,
                          rows_of, unsupported_view)


@dataclass
class _Pending:
    """A language model's pass held back until its output head is called (see ``diffuse.tail``)."""

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
class _Embedded:
    """The placeholder the embedding answered in this forward, until the first decoder layer takes it."""

    placeholder: torch.Tensor
    ids: torch.Tensor
    version: int  # its in-place version counter then: a write to it after shows


class SideOutput(torch.Tensor):
    """What stands in, before the last layer, for a tensor a layer returns besides its hidden state and that
    replaces none of its inputs (BLOOM's attention weights, T5's position biases): empty, and ``output`` says
    which returned position it stands for. A model may hand it to the next layer as it is (T5 gives block 0's
    biases to every later block): the pass then threads that output into the slot it takes there
    (``threaded_sides``); anything else done with it is refused (``diffuse.standin.StandIn``)."""

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


def _is_freed(module: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in module.parameters())


class LanguageEnds:
    """The ends of a language model split by ``splitter`` (``diffuse.standin.Splitter``): its passes, its
    output head answered by the last node, and its input embedding answered by the first where allowed."""

    def __init__(self, splitter):
        self.splitter = splitter
        self.caches = ClientCaches()
        self.head: tuple[str, nn.Module] | None = None  # the output head: (path, the original)
        self.head_freed = self.head_tied = False
        self.head_list = False  # the head is a list of heads side by side (diffuse.tail.HeadListStandIn)
        self._heads_answer: tuple | None = None  # (the hidden state, every head's logits) while the heads are called
        self.embedding = EmbeddingEnd(self)
        self.pending: _Pending | None = None
        # whether the head reads rows of the final norm's output as it is (None: not known yet); a model that
        # works on them in between (T5 scales them) gets its passes sent at once and its head run here
        self.tail_follows: bool | None = None
        self._forward_call: tuple | None = None  # the model's outermost forward call under way: (args, kwargs)
        self._forwards = 0
        self._replay = None  # while the forward runs again on a pass already answered: that answer
        self.tail_passes = 0  # passes whose norm and head ran on the last node
        self.tail_bytes = self.tail_bytes_max = 0  # what their answers' tensors held (in all, the most in one)
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
        self._install_head(changes)
        self.embedding.install(changes)

    def _install_head(self, changes) -> None:
        """The output head becomes a stand-in answered by the last node (``diffuse.tail``); every other module is
        watched, so that one reading the stack's held-back answer gets the real one."""
        path = head_path(self.model) if self.splitter.plan.stacks else None
        if path is None:
            return
        original = self.model.get_submodule(path)
        if is_head_list(original):
            weights = [h.weight for h in original]
            self.head_list = True
        else:
            weight = getattr(original, "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
                return
            weights = [weight]
        self.head = (path, original)
        self.head_freed = _is_freed(original)
        # tied to the input embedding, which the client needs for the first layer's input: never freed here
        self.head_tied = any(p is w for name, p in self.model.named_parameters(remove_duplicate=False)
                             if not name.startswith(path + ".") for w in weights)
        changes.replace(self.model, path, lambda m: HeadListStandIn(self, m) if self.head_list
                        else HeadStandIn(self, head_vocab(m), m))
        changes.hook(self.model.register_forward_pre_hook(self._forward_starts, with_kwargs=True))
        changes.hook(self.model.register_forward_hook(self._forward_ends, always_call=True))
        for mpath, module in self.model.named_modules():
            if changes.made(module):
                continue
            changes.hook(module.register_forward_pre_hook(functools.partial(self._before_module, mpath)))
            changes.hook(module.register_forward_hook(functools.partial(self._after_module, mpath)))

    def attach(self, changes) -> None:
        if self.head is not None and callable(getattr(type(self.model), "generate", None)):
            self.generation.wrap(changes)

    def detach(self) -> None:
        self.pending = None
        self.embedding.embedded = None
        self._heads_answer = None

    def freed(self) -> list[tuple[nn.Module, str]]:
        """The ends whose weights a node holds now, each with what calling it says."""
        out = []
        for end, where in ((self.embed, "first"), (self.head, "last")):
            if end is not None and _is_freed(end[1]):
                out.append((end[1], f"this model's {'embedding table' if where == 'first' else 'output head'} "
                                    f"({end[0]}) is held by the {where} node: call the model inside "
                                    "`with diffuse.split(...)`, or load its weights again"))
        return out

    def _free_remote_weights(self) -> None:
        """The client frees the embedding table once a pass carried token ids, the head once the last node ran
        it; a head tied to the table goes when both have happened."""
        e = self.embedding
        if e.table is not None and not e.freed and e.passes:
            if not self.head_tied:
                e.table[1].to("meta")
                e.freed = True
            elif self.tail_passes and not self.head_freed:
                e.table[1].to("meta")
                self.head[1].to("meta")  # each module's own parameter goes (moving one leaves the other)
                e.freed = self.head_freed = True
        if self.head is not None and not self.head_freed and not self.head_tied and self.tail_passes:
            self.head[1].to("meta")  # the last node holds it now
            self.head_freed = True

    def _forward_starts(self, _module, args: tuple, kwargs: dict):
        if self._forwards == 0:
            self._forward_call = (args, kwargs)
        self._forwards += 1

    def _forward_ends(self, _module, _args, _output):
        self._forwards -= 1
        if self._forwards == 0:
            self._forward_call = None

    # -- passes ----------------------------------------------------------------------------------------
    def _before_module(self, path: str, module: nn.Module, args: tuple):
        p = self.pending
        if p is None or not args or args[0] is not p.placeholder:
            return None
        if p.norm is None and p.normed is None and is_norm(module):
            p.norm = path  # runs on the placeholder here; only its output's shape and view matter
            return None
        return (self._send_pending(None), *args[1:])  # anything else reading the answer gets the real one now

    def _after_module(self, path: str, module: nn.Module, args: tuple, output):
        p = self.pending
        if p is not None and p.norm == path and args and args[0] is p.placeholder:
            p.normed = output

    def run_layers(self, stack: StackPlan, calls: list[tuple[tuple, dict]], cache):
        """A language model's pass: every layer's call through the ring at once; the client's cache gets
        its shadow (see ``diffuse.kvcache``)."""
        if self._replay is not None:  # the forward runs again on a pass the nodes already answered
            answer, self._replay = self._replay, None
            return answer
        placeholder = calls[0][0][0] if calls[0][0] else calls[0][1].get("hidden_states")
        self._heads_answer = None  # a new pass: the heads' last answer is for another hidden state
        ids = self.embedding.take_ids(placeholder)
        first = self.splitter.first_block(stack.path)
        if first is not None:
            self._learn(stack, first, calls[0], cache, placeholder, ids)
        rmap = self.splitter.plan.return_maps[stack.path]
        fresh = self.caches.fresh(stack.path, cache)
        if self.pending is not None:  # a pass held back that nothing read: send it first
            self._send_pending(None)
        if self.head is not None and self.generation.active and len(rmap.streams) == 1 \
                and isinstance(placeholder, torch.Tensor) and self.tail_follows is not False:
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
        out = self.splitter.ring.call_layers(stack.path, calls, threaded_sides(calls, rmap), cache, fresh, tail,
                                             embed=embed)
        self.caches.shadow(cache, range(stack.length), rows)
        if ids is not None:
            self.embedding.passes += 1
            self._free_remote_weights()
        return out

    def _send_pending(self, tail: Tail | None):
        p, self.pending = self.pending, None
        return self._send(p.stack, p.calls, p.cache, p.rmap, p.fresh, tail, p.ids)

    # -- the head --------------------------------------------------------------------------------------
    def run_head(self, x: torch.Tensor) -> torch.Tensor:
        """The output head's answer for ``x``: from the last node when the pass is held back (norm, the rows
        ``x`` takes, head, the candidates decoding needs), else from the head here."""
        path, original = self.head
        p = self.pending
        if p is None:
            if self.head_freed:
                raise DiffuseError(f"{path} was called on a hidden state the last node did not make, and its "
                                   "weights are held by the nodes")
            return original(x)
        rows = rows_of(x, p.normed if p.normed is not None else p.placeholder)
        if rows is None:
            return self._head_here(path, original, x)
        self.tail_follows = True
        gen = self.generation
        draw = gen.draw.wire(gen.node_tail()) if gen.draw is not None else None
        answer = self._send_pending(Tail(p.norm, tuple(rows), gen.top or 0, draw))
        self.tail_passes += 1
        held = sum(t.numel() * t.element_size() for t in (answer.values() if isinstance(answer, dict) else ())
                   if isinstance(t, torch.Tensor))
        self.tail_bytes += held
        self.tail_bytes_max = max(self.tail_bytes_max, held)
        vocab = head_vocab(original)
        self._free_remote_weights()
        if "logits" in answer:
            logits = answer["logits"]
            gen.shortlist, gen.whole_row = None, logits[:, -1]
        else:
            logits = logits_from(answer["ids"], answer["values"], vocab)
            gen.shortlist = logits[:, -1]
        if gen.draw is not None:  # the row generate will read, as it reads it
            gen.draw.took(answer, gen.node_tail(), logits[:, -1].to(dtype=torch.float32, copy=True))
        return logits

    def _head_here(self, path: str, original: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The head's answer where the model works on the final norm's output before its head (T5 scales it): the
        pass held back goes without its tail, the model's forward runs again on that answer, here, up to the
        head, which runs here on what the forward hands it; later passes go at once (``tail_follows``)."""
        answer = self._send_pending(None)
        if self.tail_follows or self._forward_call is None or self._forwards != 1 or self.head_freed \
                or self.embed is not None or self.head_list:
            raise unsupported_view(path)
        self.tail_follows = False
        args, kwargs = self._forward_call
        self._replay = answer
        try:
            out = type(self.model).forward(self.model, *args, **kwargs)
        finally:
            self._replay = None
        logits = getattr(out, "logits", None)
        if logits is None and isinstance(out, tuple):
            logits = out[0]
        if not isinstance(logits, torch.Tensor):
            raise unsupported_view(path)
        return logits

    def run_head_of(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Head ``index`` of a list of heads, on ``x``: the first head called in a held-back pass sends it (every
        head runs on the last node, ``diffuse.tail.stack_heads``), every head then answers its part of that answer;
        each must read the same hidden state."""
        path, original = self.head
        heads = len(original)
        if self.pending is not None:
            logits = self.run_head(x)  # (batch * heads) x rows x vocab
            if logits.shape[0] % heads:
                raise DiffuseError(f"the last node answered {logits.shape[0]} rows for {heads} heads")
            self._heads_answer = (x, logits.reshape(-1, heads, *logits.shape[1:]))
        if self._heads_answer is not None:
            seen, logits = self._heads_answer
            if x is not seen:
                raise DiffuseError(f"{path}[{index}] reads another hidden state than the head called first; the "
                                   "heads run side by side on the last node, so Diffuse cannot answer this call")
            return logits[:, index]
        if self.head_freed:
            raise DiffuseError(f"{path}[{index}] was called on a hidden state the last node did not make, and its "
                               "weights are held by the nodes")
        return original[index](x)


class EmbeddingEnd:
    """A language model's input embedding, when the first node holds its table: inside the split model's
    forward its stand-in answers a placeholder, and the pass carries the token ids instead (``run_layers``)."""

    def __init__(self, ends: LanguageEnds):
        self.ends = ends
        self.table: tuple[str, nn.Module] | None = None  # (path, the original), when the first node holds it
        self.kept: str | None = None  # else why the client keeps it (diffuse.embedding.embedding_stays)
        self._path: str | None = None
        self._decided = False
        self.freed = False
        self.passes = 0  # passes that carried token ids for the first node to embed
        self.embedded: _Embedded | None = None
        self.forwards = 0  # the model's own forward calls under way (the placeholder is answered only inside one)
        self.plain_pass = True  # whether the forward under way got token ids only (no media to merge)

    def decide(self) -> None:
        """Where the embedding table goes, decided once on the model's own forward, before any stand-in is in
        place: to the first node when asked (``embedding_on_node``) and the forward allows (``diffuse.embedding``),
        else ``kept`` says why."""
        if self._decided:
            return
        self._decided = True
        plan = self.ends.splitter.plan
        if len(plan.stacks) != 1 or head_path(self.ends.model) is None:
            return
        path = embedding_path(self.ends.model)
        stack = plan.stacks[0].path
        if path is not None and (path == stack or path.startswith(stack + ".")):
            path = None
        if not self.ends.splitter.embedding_on_node:
            self.kept = "the default: passes carry hidden states, not token ids (--embedding-on-node)"
            return
        self.kept = embedding_stays(self.ends.model, path, self.ends.model.get_submodule(stack)[0])
        self._path = path if self.kept is None else None

    def install(self, changes) -> None:
        if self._path is None:
            return
        model = self.ends.model
        original = changes.replace(model, self._path, lambda m: EmbedStandIn(self, m))
        self.table = (self._path, original)
        self.freed = _is_freed(original)
        changes.hook(model.register_forward_pre_hook(self._forward_starts, with_kwargs=True))
        changes.hook(model.register_forward_hook(self._forward_ends, always_call=True))

    def _forward_starts(self, _module, args: tuple, kwargs: dict):
        if self.forwards == 0:
            self.embedded = None
            # media or anything else beside token ids: its values may be merged into the embeddings
            self.plain_pass = len(args) <= 1 and not any(
                isinstance(v, torch.Tensor) for k, v in kwargs.items() if k not in TEXT_INPUTS)
        self.forwards += 1

    def _forward_ends(self, _module, _args, output):
        self.forwards -= 1
        if self.forwards == 0 and self.embedded is not None:
            self.embedded = None
            if output is not None:  # a forward that ended normally without handing them to the first layer
                raise DiffuseError("the model's forward made token embeddings and never handed them to its first "
                                   "decoder layer; the embedding table is held by the first node, so Diffuse cannot "
                                   "answer this call")

    def run_embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embedding's answer: inside the split model's forward, a placeholder whose token ids the pass
        takes to the first node; else the table here while it is held here."""
        path, original = self.table
        if self.ends.splitter.ring is not None and self.forwards > 0 and self.plain_pass \
                and isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point():
            out = placeholder(ids, original.weight.shape[1], original.weight.dtype)
            self.embedded = _Embedded(out, ids.detach().clone(), out._version)
            return out
        if original.weight.device.type != "meta":
            return original(ids)
        if self.forwards > 0 and not self.plain_pass:
            raise DiffuseError(f"this call gives the model more than token ids, which it may merge into the "
                               f"embeddings; its embedding table ({path}) is held by the first node")
        raise DiffuseError(f"this model's embedding table ({path}) is held by the first node: call the model "
                           "inside `with diffuse.split(...)`")

    def take_ids(self, hidden) -> torch.Tensor | None:
        """The token ids of this pass when its first layer got the embedding's placeholder unchanged (the first
        node embeds them); None when the embedding made nothing in this forward."""
        e, self.embedded = self.embedded, None
        if e is None:
            return None
        if hidden is not e.placeholder or e.placeholder._version != e.version:
            raise DiffuseError("the model changed the token embeddings before its first decoder layer in this pass; "
                               "its embedding table is held by the first node, so Diffuse refuses the pass rather "
                               "than give a wrong answer")
        return e.ids


class GenerateCapture:
    """While split, ``generate`` first says how many candidates its decoding reads (``diffuse.tail``); with
    sampling, the last node applies generate's own processors and draws (``diffuse.sampling``)."""

    def __init__(self, ends: LanguageEnds):
        self.ends = ends
        self.top: int | None = None  # candidates per row the head's answer needs (None: the whole row)
        self.shortlist: torch.Tensor | None = None  # the last row the head answered from the best candidates only
        self.whole_row: torch.Tensor | None = None  # ... or whole
        self.greedy_top: int | None = None  # in a greedy generate call, the candidates a shortlist holds
        self.logits_changed: bool | None = None  # whether the model changes its logits after the head (None: unknown)
        self.active = False  # passes are held back for the head only inside generate, which always calls it
        self.draw = None  # a generate call's draws on the last node (diffuse.sampling.Draw), while it runs
        self.last_draw = None  # the last generate call's (None when it drew nothing on the node), for its report
        self._node_tail = None  # what the open ring's last node holds for draws (diffuse.sampling.NodeTail)

    def wrap(self, changes) -> None:
        from diffuse.kvcache import check_prompt
        from diffuse.tail import candidates_needed

        model = self.ends.model
        bound = type(model).generate.__get__(model)

        @functools.wraps(bound)
        def generate(*args, **kwargs):
            check_prompt(model.config, kwargs.get("input_ids", args[0] if args else None))  # before any pass
            self.top = candidates_needed(model, kwargs)
            # greedy from the best few: until this model is known not to change its logits after the head, its
            # first pass brings the whole last row (diffuse.shortlist.ShortlistCheck learns it there)
            self.greedy_top = self.top if not self.ends.head_list else None
            if self.greedy_top is not None and self.logits_changed is not False:
                self.top = None
            self.active = True
            self.draw = None
            restore = self._capture(model)
            try:
                return bound(*args, **kwargs)
            finally:
                restore()
                self.top, self.greedy_top, self.active = None, None, False
                self.shortlist = self.whole_row = None
                self.last_draw, self.draw = self.draw, None
                self.ends.pending = None  # a pass nothing read (cannot happen in generate): not left behind

        changes.set(model, "generate", generate)

    def node_tail(self):
        """What the open ring's last node holds for draws; a new session starts with nothing."""
        from diffuse.sampling import NodeTail

        channel = self.ends.splitter.ring.channel
        if self._node_tail is None or self._node_tail.channel is not channel:
            self._node_tail = NodeTail(channel)
        return self._node_tail

    def _capture(self, model):
        """For the length of one ``generate`` call: the logits processors it builds are captured (with sampling,
        described for the last node and replaced by ``DrawnToken``), and so is the token history it runs each
        forward with. Returns what undoes both."""
        get_processors, prepare = model._get_logits_processor, model.prepare_inputs_for_generation

        @functools.wraps(get_processors)
        def get_logits_processor(*args, **kwargs):
            built = get_processors(*args, **kwargs)
            config = kwargs["generation_config"] if "generation_config" in kwargs else args[0]
            return self._processors(built, config)

        @functools.wraps(prepare)
        def prepare_inputs_for_generation(input_ids, *args, **kwargs):
            if self.draw is not None:
                self.draw.ids = input_ids
            return prepare(input_ids, *args, **kwargs)

        model._get_logits_processor = get_logits_processor
        model.prepare_inputs_for_generation = prepare_inputs_for_generation

        def restore():
            model.__dict__.pop("_get_logits_processor", None)
            model.__dict__.pop("prepare_inputs_for_generation", None)

        return restore

    def _processors(self, built, config):
        """What generate runs in place of the processors it ``built``: its own, or ``DrawnToken`` when the last
        node applies them and draws."""
        from transformers import LogitsProcessorList

        from diffuse.sampling import Draw, DrawnToken
        from diffuse.tail import GREEDY_TOP, LISTED_TOP

        if getattr(config, "output_scores", False) or (getattr(config, "num_beams", 1) or 1) > 1:
            return built  # output_scores asks for whole rows
        if not getattr(config, "do_sample", False):
            if self.greedy_top is not None:  # greedy reads the best few: checked first
                return LogitsProcessorList([ShortlistCheck(self, self.greedy_top), *built])
            if not self.ends.head_list or self.top is not None:
                return built  # greedy reads the whole row
            # a list of heads under processors (guidance): the last node applies them and takes the argmax
            try:
                self.draw = Draw(built, sample=False)
            except DiffuseError:
                return built  # a processor the node cannot rebuild: whole rows come home, processed here
        else:
            self.draw = Draw(built, sample=True)
        # the raw best candidates still come home, for output_logits and the report
        self.top = LISTED_TOP if self.ends.head_list else GREEDY_TOP
        # each generate call's first draw carries everything (processors, whole history, generator state), so
        # the passes of one call, replayed in order on a new node, rebuild its state exactly
        self._node_tail = None
        return LogitsProcessorList([DrawnToken(self.draw)])
