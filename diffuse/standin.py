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
Where the model's forward allows, its input embedding is a stand-in too and the
pass carries token ids for the first node to embed (``diffuse.embedding``).

With ``patches > 1`` a stack that carries one stream goes through a
``diffuse.pipefusion.Patcher`` (cut into token patches, pipelined through the
ring); a stack with two streams runs uncut steps, and ``uncut`` says why.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch
from torch import nn

from diffuse.callplan import flatten, flatten_layers
from diffuse.embedding import EmbedStandIn, embedding_path, embedding_stays, placeholder
from diffuse.errors import DiffuseError
from diffuse.kvcache import ClientCaches, is_cache
from diffuse.memo import RepeatMemo
from diffuse.pipefusion import Patcher, why_uncut
from diffuse.plan import PATCHABLE, ReturnMap, SlicingPlan, StackPlan
from diffuse.planner import learn_call
from diffuse.tail import (HeadListStandIn, HeadStandIn, _HeadProxy, head_path, head_vocab, is_head_list, is_norm,
                          logits_from, rows_of, unsupported_view)


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
        self.memo: RepeatMemo | None = None  # projections of repeated inputs, while a ring is attached
        self.reused = 0  # projections answered from the memo by rings already detached
        self.tagger = None  # the first-block cache's (diffuse.firstblock), when a threshold is set
        self.uncut: dict[str, str] = {}  # stack -> why its steps run uncut although patches > 1
        self.caches = ClientCaches()
        self.head: tuple[str, nn.Module] | None = None  # a language model's output head: (path, the original)
        self.head_freed = False
        self.head_tied = False
        self.head_list = False  # the head is a list of heads side by side (diffuse.tail.HeadListStandIn)
        self._heads_answer: tuple | None = None  # (the hidden state, every head's logits) while the heads are called
        self.embed: tuple[str, nn.Module] | None = None  # the input embedding, when the first node holds the table
        self.embed_kept: str | None = None  # else why the client keeps it (diffuse.embedding.embedding_stays)
        self.embed_freed = False
        self.embed_passes = 0  # passes that carried token ids for the first node to embed
        self._embedded: _Embedded | None = None
        self._forwards = 0  # the model's own forward calls under way (the placeholder is answered only inside one)
        self._plain_pass = True  # whether the forward under way got token ids only (no media to merge)
        self.top: int | None = None  # candidates per row the head's answer needs (None: the whole row)
        self.pending: _Pending | None = None
        self.in_generate = False  # passes are held back for the head only inside generate, which always calls it
        self.tail_passes = 0  # passes whose norm and head ran on the last node
        self.tail_bytes = self.tail_bytes_max = 0  # what their answers' tensors held (in all, the most in one)
        self.draw = None  # a generate call's draws on the last node (diffuse.sampling.Draw), while it runs
        self.last_draw = None  # the last generate call's (None when it drew nothing on the node), for its report
        self._node_tail = None  # what the open ring's last node holds for draws (diffuse.sampling.NodeTail)

    embedding_on_node = False  # a language model's embedding table may go to the first node (opt-in)

    @classmethod
    def on(cls, denoiser: nn.Module, plan: SlicingPlan, embedding_on_node: bool = False) -> "Splitter":
        """The denoiser's splitter, installed on first use; the blocks it hands out are freed. ``embedding_on_node``:
        a language model's embedding table goes to the first node where its forward allows (else it stays here,
        and passes carry hidden states, never token ids)."""
        splitter = getattr(denoiser, "_diffuse_splitter", None)
        if splitter is None:
            splitter = cls(denoiser, plan)
            splitter.embedding_on_node = embedding_on_node
            splitter.install()
            denoiser._diffuse_splitter = splitter
        elif splitter.plan.model.content_hash != plan.model.content_hash:
            raise DiffuseError("this denoiser was split for another model")
        elif splitter.embedding_on_node != embedding_on_node and splitter.head is not None:
            where = "the first node" if splitter.embedding_on_node else "the client"
            raise DiffuseError(f"this model was split before with its embedding table on {where}; load it again "
                               "to change that")
        return splitter

    def install(self) -> None:
        embed_path = self._embedding_decision()
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
        self._install_head()
        if embed_path is not None:
            self._install_embedding(embed_path)

    def _embedding_decision(self) -> str | None:
        """A language model's embedding table goes to the first node where its forward allows (decided here,
        once, on the model's own forward: ``diffuse.embedding``); returns its path then, else None and the reason
        is kept in ``embed_kept``."""
        if len(self.plan.stacks) != 1 or head_path(self.denoiser) is None:
            return None
        path = embedding_path(self.denoiser)
        stack = self.plan.stacks[0].path
        if path is not None and (path == stack or path.startswith(stack + ".")):
            path = None
        if not self.embedding_on_node:
            self.embed_kept = "the default: passes carry hidden states, not token ids (--embedding-on-node)"
            return None
        first = self.denoiser.get_submodule(stack)[0]
        self.embed_kept = embedding_stays(self.denoiser, path, first)
        return path if self.embed_kept is None else None

    def _install_embedding(self, path: str) -> None:
        parent_path, _, name = path.rpartition(".")
        parent = self.denoiser.get_submodule(parent_path) if parent_path else self.denoiser
        original = getattr(parent, name)
        self.embed = (path, original)
        setattr(parent, name, EmbedStandIn(self, original))
        self.denoiser.register_forward_pre_hook(self._forward_starts, with_kwargs=True)
        self.denoiser.register_forward_hook(self._forward_ends, always_call=True)

    def _forward_starts(self, _module, args: tuple, kwargs: dict):
        from diffuse.embedding import TEXT_INPUTS

        if self._forwards == 0:
            self._embedded = None
            # media or anything else beside token ids: its values may be merged into the embeddings
            self._plain_pass = len(args) <= 1 and not any(
                isinstance(v, torch.Tensor) for k, v in kwargs.items() if k not in TEXT_INPUTS)
        self._forwards += 1

    def _forward_ends(self, _module, _args, output):
        self._forwards -= 1
        if self._forwards == 0 and self._embedded is not None:
            self._embedded = None
            if output is not None:  # a forward that ended normally without handing them to the first layer
                raise DiffuseError("the model's forward made token embeddings and never handed them to its first "
                                   "decoder layer; the embedding table is held by the first node, so Diffuse cannot "
                                   "answer this call")

    def run_embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embedding's answer: inside the split model's forward, a placeholder whose token ids the pass
        takes to the first node; else the table here while it is held here."""
        path, original = self.embed
        if self.ring is not None and self._forwards > 0 and self._plain_pass and isinstance(ids, torch.Tensor) \
                and ids.dim() == 2 and not ids.is_floating_point():
            out = placeholder(ids, original.weight.shape[1], original.weight.dtype)
            self._embedded = _Embedded(out, ids.detach().clone(), out._version)
            return out
        if original.weight.device.type != "meta":
            return original(ids)
        if self._forwards > 0 and not self._plain_pass:
            raise DiffuseError(f"this call gives the model more than token ids, which it may merge into the "
                               f"embeddings; its embedding table ({path}) is held by the first node")
        raise DiffuseError(f"this model's embedding table ({path}) is held by the first node: call the model "
                           "inside `with diffuse.split(...)`")

    def _take_ids(self, hidden) -> torch.Tensor | None:
        """The token ids of this pass when its first layer got the embedding's placeholder unchanged (the first
        node embeds them); None when the embedding made nothing in this forward."""
        e, self._embedded = self._embedded, None
        if e is None:
            return None
        if hidden is not e.placeholder or e.placeholder._version != e.version:
            raise DiffuseError("the model changed the token embeddings before its first decoder layer in this pass; "
                               "its embedding table is held by the first node, so Diffuse refuses the pass rather "
                               "than give a wrong answer")
        return e.ids

    def _free_remote_weights(self) -> None:
        """The client frees the embedding table once a pass carried token ids, the head once the last node ran
        it; a head tied to the table goes when both have happened."""
        if self.embed is not None and not self.embed_freed and self.embed_passes:
            if not self.head_tied:
                self.embed[1].to("meta")
                self.embed_freed = True
            elif self.tail_passes and not self.head_freed:
                self.embed[1].to("meta")
                self.head[1].to("meta")  # each module's own parameter goes (moving one leaves the other)
                self.embed_freed = self.head_freed = True
        if self.head is not None and not self.head_freed and not self.head_tied and self.tail_passes:
            self.head[1].to("meta")  # the last node holds it now
            self.head_freed = True

    def _install_head(self) -> None:
        """A language model's output head becomes a stand-in answered by the last node (``diffuse.tail``);
        every other module is watched, so that one reading the stack's held-back answer gets the real one."""
        path = head_path(self.denoiser) if self.plan.stacks else None
        if path is None:
            return
        parent_path, _, name = path.rpartition(".")
        parent = self.denoiser.get_submodule(parent_path) if parent_path else self.denoiser
        original = getattr(parent, name)
        if is_head_list(original):
            weights = [h.weight for h in original]
            self.head_list = True
        else:
            weight = getattr(original, "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
                return
            weights = [weight]
        self.head = (path, original)
        # tied to the input embedding, which the client needs for the first layer's input: never freed here
        self.head_tied = any(p is w for name, p in self.denoiser.named_parameters(remove_duplicate=False)
                             if not name.startswith(path + ".") for w in weights)
        setattr(parent, name, HeadListStandIn(self, original) if self.head_list
                else HeadStandIn(self, head_vocab(original), original))
        for mpath, module in self.denoiser.named_modules():
            if isinstance(module, (StandIn, BlockProxy, HeadStandIn, HeadListStandIn, _HeadProxy, EmbedStandIn)):
                continue
            module.register_forward_pre_hook(functools.partial(self._before_module, mpath))
            module.register_forward_hook(functools.partial(self._after_module, mpath))

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

    def attach(self, ring, patches: int = 1, cache_threshold: float = 0.0, ahead: bool = True) -> None:
        """Calls go through ``ring``; ``patches > 1``: PipeFusion (``ahead``: the next guidance branch's call
        sent while this one finishes); ``cache_threshold > 0``: the first-block cache (``diffuse.firstblock``)
        on every stack called whole."""
        from diffuse.firstblock import CacheTagger

        self.ring = ring
        if self.head is None:  # a denoiser, stepped with the same conditioning (a language model's inputs all change)
            self.memo = RepeatMemo(self.denoiser, skip=tuple(st.path for st in self.plan.stacks))
            self.memo.install()
        self.patcher = Patcher(ring, patches, ahead) if patches > 1 else None
        self.tagger = CacheTagger(cache_threshold, ring) if cache_threshold > 0 else None
        self.uncut = {}
        if self.head is not None and callable(getattr(type(self.denoiser), "generate", None)):
            self._wrap_generate()

    def detach(self) -> None:
        if self.memo is not None:
            self.memo.remove()
            self.reused += self.memo.hits
            self.memo = None
        self.ring = self.patcher = self.tagger = None
        self.pending = None
        self._embedded = None
        self._heads_answer = None
        self.denoiser.__dict__.pop("generate", None)

    def _wrap_generate(self) -> None:
        """While split, ``generate`` first says how many candidates its decoding reads (``diffuse.tail``); with
        sampling, the last node applies generate's own processors and draws (``diffuse.sampling``)."""
        from diffuse.tail import candidates_needed

        model, bound = self.denoiser, type(self.denoiser).generate.__get__(self.denoiser)

        @functools.wraps(bound)
        def generate(*args, **kwargs):
            self.top = candidates_needed(model, kwargs)
            self.in_generate = True
            self.draw = None
            restore = self._capture_draws(model)
            try:
                return bound(*args, **kwargs)
            finally:
                restore()
                self.top, self.in_generate = None, False
                self.last_draw, self.draw = self.draw, None
                if self.pending is not None:  # a pass nothing read (cannot happen in generate): not left behind
                    self.pending = None

        model.generate = generate

    def _capture_draws(self, model):
        """For the length of one ``generate`` call: the logits processors it builds are captured (with sampling,
        described for the last node and replaced by ``DrawnToken``), and so is the token history it runs each
        forward with. Returns what undoes both."""
        from transformers import LogitsProcessorList

        from diffuse.sampling import Draw, DrawnToken
        from diffuse.tail import GREEDY_TOP, LISTED_TOP

        get_processors, prepare = model._get_logits_processor, model.prepare_inputs_for_generation

        @functools.wraps(get_processors)
        def get_logits_processor(*args, **kwargs):
            built = get_processors(*args, **kwargs)
            config = kwargs["generation_config"] if "generation_config" in kwargs else args[0]
            if getattr(config, "output_scores", False) or (getattr(config, "num_beams", 1) or 1) > 1:
                return built  # output_scores asks for whole rows
            if not getattr(config, "do_sample", False):
                if not self.head_list or self.top is not None:
                    return built  # greedy reads the best few (or the whole row)
                # a list of heads under processors (guidance): the last node applies them and takes the argmax
                try:
                    self.draw = Draw(built, sample=False)
                except DiffuseError:
                    return built  # a processor the node cannot rebuild: whole rows come home, processed here
            else:
                self.draw = Draw(built, sample=True)
            # the raw best candidates still come home, for output_logits and the report
            self.top = LISTED_TOP if self.head_list else GREEDY_TOP
            # each generate call's first draw carries everything (processors, whole history, generator state), so
            # the passes of one call, replayed in order on a new node, rebuild its state exactly
            self._node_tail = None
            return LogitsProcessorList([DrawnToken(self.draw)])

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
        if self.tagger is not None:
            tree, tensors = flatten(args, kwargs)
            extra, digests = self.tagger.tag(stack.path, tensors, rmap.streams[0])
            return self.ring.receive(self.ring.send(stack.path, tree, tensors, rmap, None, digests, extra))
        if self.patcher is not None:  # a pass sent ahead for a patched stack is answered before this one
            self.patcher.settle()
        return self.ring.call(stack.path, args, kwargs, rmap)

    def run_layers(self, stack: StackPlan, calls: list[tuple[tuple, dict]], cache):
        """A language model's pass: every layer's call through the ring at once; the client's cache gets
        its shadow (see ``diffuse.kvcache``)."""
        if self.ring is None:
            raise DiffuseError("this model's layers are held by nodes: call it inside `with diffuse.split(...)`")
        if self.tagger is not None:
            from diffuse.firstblock import NOT_FOR_LANGUAGE_MODELS

            raise DiffuseError(NOT_FOR_LANGUAGE_MODELS)
        placeholder = calls[0][0][0] if calls[0][0] else calls[0][1].get("hidden_states")
        self._heads_answer = None  # a new pass: the heads' last answer is for another hidden state
        ids = self._take_ids(placeholder)
        if stack.path in self._first_blocks:
            block = self._first_blocks.pop(stack.path)
            args, kwargs = calls[0]
            # the first layer runs once here to learn its return map, on a copy of the cache it would write (and
            # on the real embeddings, not the placeholder, while the table is still here)
            scratch = copy.deepcopy(cache)
            real = None
            if ids is not None:
                real = self.embed[1](ids) if self.embed[1].weight.device.type != "meta" else \
                    torch.randn(placeholder.shape, generator=torch.Generator().manual_seed(0)).to(placeholder.dtype)
            swap = {id(cache): scratch, **({id(placeholder): real} if real is not None else {})}
            args = tuple(swap.get(id(a), a) for a in args)
            kwargs = {k: swap.get(id(v), v) for k, v in kwargs.items()}
            call_plan, rmap = learn_call(stack, args, kwargs, block)
            self.plan = self.plan.with_call(stack.path, call_plan, rmap)
            block.to("meta")
        rmap = self.plan.return_maps[stack.path]
        fresh = self.caches.fresh(stack.path, cache)
        if self.pending is not None:  # a pass held back that nothing read: send it first
            self._send_pending(None)
        if self.head is not None and self.in_generate and rmap.single and isinstance(placeholder, torch.Tensor):
            self.pending = _Pending(stack, calls, cache, rmap, fresh, placeholder, ids)
            return placeholder
        return self._send(stack, calls, cache, rmap, fresh, None, ids)

    def _send(self, stack: StackPlan, calls, cache, rmap: ReturnMap, fresh: bool, tail: dict | None,
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
            embed = {"slot": slot, "dtype": str(rows.dtype).removeprefix("torch.")}
        out = self.ring.call_layers(stack.path, calls, rmap, cache, fresh, tail, embed=embed)
        self.caches.shadow(cache, range(stack.length), rows)
        if ids is not None:
            self.embed_passes += 1
            self._free_remote_weights()
        return out

    def _send_pending(self, tail: dict | None):
        p, self.pending = self.pending, None
        return self._send(p.stack, p.calls, p.cache, p.rmap, p.fresh, tail, p.ids)

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
            self._send_pending(None)
            raise unsupported_view(path)
        tail = {"norm": p.norm, "rows": list(rows), "top": self.top or 0}
        if self.draw is not None:
            tail["draw"] = self.draw.wire(self.node_tail())
        answer = self._send_pending(tail)
        self.tail_passes += 1
        held = sum(t.numel() * t.element_size() for t in (answer.values() if isinstance(answer, dict) else ())
                   if isinstance(t, torch.Tensor))
        self.tail_bytes += held
        self.tail_bytes_max = max(self.tail_bytes_max, held)
        vocab = head_vocab(original)
        self._free_remote_weights()
        if "logits" in answer:
            logits = answer["logits"]
        else:
            logits = logits_from(answer["ids"], answer["values"], vocab)
        if self.draw is not None:  # the row generate will read, as it reads it
            self.draw.took(answer, self.node_tail(), logits[:, -1].to(dtype=torch.float32, copy=True))
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

    def node_tail(self):
        """What the open ring's last node holds for draws; a new session starts with nothing."""
        from diffuse.sampling import NodeTail

        channel = self.ring.channel
        if self._node_tail is None or self._node_tail.channel is not channel:
            self._node_tail = NodeTail(channel)
        return self._node_tail

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
