"""Stand-ins: what the denoiser sees where its block stacks used to be.

A ``StandIn`` (``diffuse.client.proxies``) is an ordinary ``nn.ModuleList`` of
parameterless ``BlockProxy`` modules, one per block, so the denoiser's own loop
runs unchanged; its first proxy ships the call through the ring (``run_stack``
here), and a language model's stack hands every layer's call to the language
model's ends at its last layer (``run_layers``, ``diffuse.lm.client_ends``). The
pipeline's ``__call__`` is never modified.

With ``patches > 1`` a stack that carries one stream goes through a
``diffuse.pipefusion.client.Patcher`` (cut into token patches, pipelined through the
ring); a stack with two streams runs uncut steps, and ``uncut`` says why. The
memo of repeated projections is ``diffuse.client.memo``'s.

A ``Splitter`` installs the stand-ins when a ring is attached and takes them
away when it is detached: every module it replaced, every hook it registered
and every attribute it set is recorded in its ``Changes`` and undone, so after
``with diffuse.split(pipe): ...`` the pipeline holds its own modules again. The
blocks handed to nodes stay freed (on the meta device) until their weights are
loaded again; until then calling one says so.
"""

from __future__ import annotations

import time

from torch import nn

from diffuse.plan.bnbread import release_to_meta
from diffuse.plan.calltree import flatten
from diffuse.changes import Changes, guard
from diffuse.errors import DiffuseError
from diffuse.lm.client_ends import LanguageEnds
from diffuse.client.encoders import EncoderPasses
from diffuse.client.memo import RepeatMemo
from diffuse.pipefusion.client import Patcher
from diffuse.pipefusion.policy import why_uncut
from diffuse.plan.components import coder_class
from diffuse.plan.contracts import PATCHABLE, CallPlan, ReturnMap, SlicingPlan, StackPlan
from diffuse.plan.planner import learn_call
from diffuse.client.proxies import StandIn


class Splitter:
    """Installs stand-ins on a loaded denoiser while a ring is attached and runs their calls through it. What a
    stack's first call teaches (call plan, return map) is kept across rings."""

    def __init__(self, denoiser: nn.Module, plan: SlicingPlan):
        self.denoiser = denoiser
        self.plan = plan
        self.originals: dict[str, nn.ModuleList] = {}
        self._first_blocks: dict[str, nn.Module] = {}  # per stack, until its first call has taught its return map
        self.changes = Changes()
        self._guards: list = []  # hooks that refuse freed modules between splits
        self.ring = None
        self.patcher = None
        self.memo: RepeatMemo | None = None  # projections of repeated inputs, while a ring is attached
        self.reused = 0  # projections answered from the memo by rings already detached
        self.stand_in_s = 0.0  # wall seconds spent in stand-ins' stack calls, ring included (python -m diffuse.bench)
        self.tagger = None  # the first-block cache's (diffuse.firstblock), when a threshold is set
        self.uncut: dict[str, str] = {}  # stack -> why its steps run uncut although patches > 1
        self.lm = LanguageEnds(self)
        self.encoders = EncoderPasses(self, ())  # a pipeline's encoder stacks, when they are on the ring

    embedding_on_node = False  # a language model's embedding table may go to the first node (opt-in)
    drafting = None  # a language model's drafts verified by the ring (diffuse.lm.client_drafts.Drafting), when asked

    @classmethod
    def on(cls, denoiser: nn.Module, plan: SlicingPlan, embedding_on_node: bool = False) -> "Splitter":
        """The denoiser's splitter (one per denoiser, kept on it, so what it learned outlives a ring).
        ``embedding_on_node``: a language model's embedding table goes to the first node where its forward
        allows (else it stays here, and passes carry hidden states, never token ids)."""
        splitter = getattr(denoiser, "_diffuse_splitter", None)
        if splitter is None:
            splitter = cls(denoiser, plan)
            splitter.embedding_on_node = embedding_on_node
            denoiser._diffuse_splitter = splitter
        elif splitter.plan.model.content_hash != plan.model.content_hash:
            raise DiffuseError("this denoiser was split for another model")
        elif splitter.embedding_on_node != embedding_on_node and splitter.head is not None:
            where = "the first node" if splitter.embedding_on_node else "the client"
            raise DiffuseError(f"this model was split before with its embedding table on {where}; load it again "
                               "to change that")
        return splitter

    # what the language model's ends hold, as earlier readers of the splitter find it
    head = property(lambda self: self.lm.head_end.head, doc="the output head, (path, the original), or None")
    head_tied = property(lambda self: self.lm.head_end.head_tied, doc="the head shares its weights with the embedding")
    head_list = property(lambda self: self.lm.head_end.head_list, doc="the head is a list of heads side by side")
    head_freed = property(lambda self: self.lm.head_end.head_freed, doc="the last node holds the head's weights")
    tail_bytes_max = property(lambda self: self.lm.head_end.tail_bytes_max, doc="the most one tail's answer held")
    embed = property(lambda self: self.lm.embedding.table, doc="the input embedding, when the first node holds it")
    embed_kept = property(lambda self: self.lm.embedding.kept, doc="else why the client keeps it")
    embed_passes = property(lambda self: self.lm.embedding.passes, doc="passes that carried token ids")
    tail_passes = property(lambda self: self.lm.head_end.tail_passes, doc="passes whose norm and head ran on the last node")
    last_draw = property(lambda self: self.lm.generation.last_draw, doc="the last generate call's draws, or None")

    def install(self) -> None:
        """Stand-ins in place of the stacks (and of a language model's ends); the blocks handed out are freed."""
        for h in self._guards:
            h.remove()
        self._guards = []
        self.lm.decide()  # on the model's own forward, its blocks still in place
        for st in self.plan.stacks:
            original = self.changes.replace(self.denoiser, st.path, lambda blocks: StandIn(st, self, blocks))
            self.originals[st.path] = original
            if st.path not in self.plan.return_maps and st.path not in self._first_blocks:
                self._first_blocks[st.path] = original[0]  # kept until the first call has taught its return map
            for block in original:
                if block is not self._first_blocks.get(st.path):
                    release_to_meta(block)
        self.lm.install(self.changes)

    def release(self) -> None:
        """Everything ``install`` and ``attach`` changed, put back; modules whose weights a node holds refuse to
        run, saying so, until their weights are loaded again."""
        self.changes.undo()
        why = "this model's blocks are held by nodes: call it inside `with diffuse.split(...)`, or load their " \
              "weights again"
        freed = [(b, why) for ml in self.originals.values() for b in ml
                 if any(p.device.type == "meta" for p in b.parameters())]
        # a VAE a node holds (diffuse.plan.decoders) runs through its own decode, not its block's forward: its parts
        freed += [(part, why) for b, _ in freed if isinstance(b, coder_class()) for part in b.children()
                  if any(p.device.type == "meta" for p in part.parameters())]
        self._guards = [guard(m, w) for m, w in freed + self.lm.freed()]

    def attach(self, ring, patches: int = 1, cache_threshold: float = 0.0, ahead: bool = True) -> None:
        """Calls go through ``ring``; ``patches > 1``: PipeFusion (``ahead``: the next guidance branch's call
        sent while this one finishes); ``cache_threshold > 0``: the first-block cache (``diffuse.firstblock``)
        on every stack called whole."""
        from diffuse.firstblock.client import CacheTagger

        if not self.changes:
            self.install()
        self.ring = ring
        if self.head is None:  # a denoiser, stepped with the same conditioning (a language model's inputs all change)
            self.memo = RepeatMemo(self.denoiser, skip=tuple(st.path for st in self.plan.stacks))
            self.memo.install()
        self.patcher = Patcher(ring, patches, ahead) if patches > 1 else None
        self.tagger = CacheTagger(cache_threshold, ring) if cache_threshold > 0 else None
        self.uncut = {}
        self.lm.attach(self.changes)

    def detach(self) -> None:
        if self.memo is not None:
            self.memo.remove()
            self.reused += self.memo.hits
            self.memo = None
        self.ring = self.patcher = self.tagger = None
        self.lm.detach()
        self.release()

    def first_block(self, path: str) -> nn.Module | None:
        """The stack's first block while its first call has not taught its return map yet, else None."""
        return self._first_blocks.get(path)

    def learned(self, stack: StackPlan, call_plan: CallPlan, rmap: ReturnMap) -> None:
        """What the stack's first call taught: kept in the plan; the first block is freed too."""
        self.plan = self.plan.with_call(stack.path, call_plan, rmap)
        release_to_meta(self._first_blocks.pop(stack.path))

    def run_stack(self, stack: StackPlan, args: tuple, kwargs: dict):
        t0 = time.perf_counter()
        try:
            return self._run_stack(stack, args, kwargs)
        finally:
            self.stand_in_s += time.perf_counter() - t0

    def _run_stack(self, stack: StackPlan, args: tuple, kwargs: dict):
        if self.ring is None:
            raise DiffuseError("this pipeline's blocks are held by nodes: call it inside `with diffuse.split(...)`")
        block = self.first_block(stack.path)
        if block is not None:
            self.learned(stack, *learn_call(stack, args, kwargs, block))
        rmap = self.plan.return_maps[stack.path]
        if self.patcher is not None and self._patchable(stack.path, rmap):
            tree, tensors = flatten(args, kwargs)
            return self.patcher.run(stack.path, tree, tensors, rmap)
        if self.tagger is not None:
            tree, tensors = flatten(args, kwargs)
            part, digests = self.tagger.tag(stack.path, tensors, rmap.streams[0])
            return self.ring.receive(self.ring.send(stack.path, tree, tensors, rmap, None, digests, part))
        if self.patcher is not None:  # a pass sent ahead for a patched stack is answered before this one
            self.patcher.settle()
        return self.ring.call(stack.path, args, kwargs, rmap)

    def run_layers(self, stack: StackPlan, calls: list[tuple[tuple, dict]], cache):
        """A language model's pass (``diffuse.lm.client_ends``, which counts its time in ``stand_in_s``), or an
        encoder's (``diffuse.client.encoders``)."""
        if stack.path in self.encoders.paths:
            return self.encoders.run(stack, calls, cache)
        if self.ring is None:
            raise DiffuseError("this model's layers are held by nodes: call it inside `with diffuse.split(...)`")
        if self.tagger is not None:
            from diffuse.client.request import NOT_FOR_LANGUAGE_MODELS

            raise DiffuseError(NOT_FOR_LANGUAGE_MODELS)
        return self.lm.run_layers(stack, calls, cache)

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
