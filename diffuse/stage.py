"""A node's slices of the model and the loop that threads hidden states through them.

``BlockStore`` loads single blocks straight from the safetensors files into a
weightless skeleton, leaving each tensor where the loader puts it (the same
placement ``from_pretrained`` gives, which keeps results bit-identical).
``StageSession`` is one client's session: its stage plan, hop keys, remembered
call plans and return maps, and slot caches. A call that carries a ``Patch``
(PipeFusion) runs through the session's ``diffuse.pipefusion.StaleStack`` for
that stack instead. A language model's call carries its cache state: the
session keeps each stack's key/value cache for the layers held here
(``diffuse.kvcache.NodeCaches``), and layers whose call differs from the first
layer's get their own tree. A pass that carries token ids in its first layer's
input slot is embedded by the node holding the first layer, with the table it
loads on first use (``diffuse.embedding``).

Blocks are held per dtype: a session keeps the blocks of its own compute dtype
from its open to its close, so another session asking for another dtype never
changes them under it (a node started with ``--blocks`` serves its own dtype
only). What a session may keep is bounded: its slot caches (the client mirrors
the rule), its stale buffers, and all sessions' together on this node. A
malformed call is answered with one line; nothing a header holds is used before
its structure is checked.
"""

from __future__ import annotations

import gc
import logging
import os
import time
import weakref
from dataclasses import dataclass

import torch

from diffuse.analysis import ModelSubject, build_meta
from diffuse.callplan import DICT, SLOT_CACHE_BYTES, TENSOR, TUPLE, SlotCache, encode_value, thread_outputs, unflatten
from diffuse.kvcache import STATE
from diffuse.errors import DiffuseError
from diffuse.firstblock import NodeResiduals, Reuse
from diffuse.kvcache import NodeCaches
from diffuse.modelfiles import load_into, located, renamed_for, weight_map
from diffuse.pipefusion import StaleStack, why_uncut
from diffuse.plan import PATCHABLE, Patch, ReturnMap, Slice, SlotRef, StackPlan, StagePlan

log = logging.getLogger("diffuse.node")


def _env_bytes(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


STALE_BYTES = _env_bytes("DIFFUSE_STALE_BYTES", 16 << 30)  # one session's PipeFusion stale buffers, at most
NODE_BUFFER_BYTES = _env_bytes("DIFFUSE_NODE_BUFFER_BYTES", 32 << 30)  # all sessions' slot caches and stale buffers
MAX_BRANCHES = 4  # PipeFusion branches one stack keeps stale buffers for (guidance needs two)
MAX_DTYPES = 2  # compute dtypes a node without --blocks keeps copies of its blocks in (sessions keep their own)
MAX_TREE_DEPTH = 16
MAX_TREE_NODES = 4096


class BlockStore:
    """The blocks one node holds, and nothing else of the model."""

    def __init__(self, model_path: str, subject: ModelSubject, stacks: list[StackPlan]):
        self.model_path = model_path
        self.subject = subject
        self.stacks = {s.path: s for s in stacks}
        self.component_dir = f"{model_path}/{subject.denoiser}"
        self.model_hash = subject.content_hash()  # of every denoiser component, when a pipeline has several
        self.blocks: dict[tuple[str, int], torch.nn.Module] = {}
        self.fixed: list[Slice] | None = None  # set by --blocks: the node holds exactly these
        self.native: dict[tuple[str, int], torch.dtype] = {}  # what each block loads as, asked for no dtype
        self._recent: list[torch.dtype] = []  # dtypes asked for, most recent last
        self._tails: dict[tuple, tuple] = {}  # a language model's (final norm, output head), by norm path and dtype
        self._embeds: dict[torch.dtype, torch.nn.Module] = {}  # a language model's input embedding, by dtype
        self._loaded: weakref.WeakSet = weakref.WeakSet()  # every parameter read from the files, while alive

    def _dtype(self, stack: str, i: int, dtype: torch.dtype | None) -> torch.dtype | None:
        return dtype if dtype is not None else self.native.get((stack, i))

    def covers(self, sl: Slice, dtype: torch.dtype | None = None) -> bool:
        return all((sl.stack, i, self._dtype(sl.stack, i, dtype)) in self.blocks for i in range(sl.start, sl.stop))

    def _served_dtypes(self) -> set:
        return {self.native[(sl.stack, i)] for sl in self.fixed or () for i in range(sl.start, sl.stop)
                if (sl.stack, i) in self.native}

    def load(self, slices: list[Slice], dtype: torch.dtype | None = None) -> None:
        """Hold what ``slices`` name, in ``dtype`` (None: as ``from_pretrained`` would load it),
        reading the safetensors files only. A block held in another dtype is read again into a copy of
        its own: sessions computing in the other dtype keep theirs. A node started with ``--blocks``
        serves the dtype it loaded only, and refuses others."""
        if self.fixed is not None and dtype is not None and self.native:
            served = self._served_dtypes()
            if dtype not in served:
                have = " and ".join(sorted(str(d).removeprefix("torch.") for d in served))
                raise DiffuseError(f"this node holds its blocks in {have} (started with --blocks) and serves that "
                                   f"dtype only; the client asks {str(dtype).removeprefix('torch.')}: run the "
                                   f"client in {have}, or use a node started without --blocks")
        if dtype is not None:
            self._recent = [d for d in self._recent if d != dtype] + [dtype]
        wanted = [(sl.stack, i) for sl in slices for i in range(sl.start, sl.stop)
                  if (sl.stack, i, self._dtype(sl.stack, i, dtype)) not in self.blocks]
        if not wanted:
            return
        self._forget_old_dtypes(dtype)
        t0 = time.perf_counter()
        skeleton = build_meta(self.subject.denoiser_class(), self.subject.denoiser_config)
        wmap = located(renamed_for(self.subject.weight_map(), skeleton), skeleton, {s for s, _ in wanted})
        files: dict[str, object] = {}
        try:
            for stack, i in wanted:
                block = skeleton.get_submodule(stack)[i]
                load_into(block, f"{stack}.{i}.", wmap, dtype, files=files)
                self._loaded.update(block.parameters())
                block.eval()
                p = next(block.parameters(), None)
                actual = p.dtype if p is not None else (dtype or torch.float32)
                if dtype is None:
                    self.native[(stack, i)] = actual
                self.blocks[(stack, i, dtype or actual)] = block
        finally:
            files.clear()
        del skeleton
        gc.collect()
        log.info("loaded %d blocks in %.2f s", len(wanted), time.perf_counter() - t0)

    def _forget_old_dtypes(self, keep: torch.dtype | None) -> None:
        """Without --blocks, copies in more than ``MAX_DTYPES`` dtypes are not all kept: the least recently
        asked go from the store (sessions using them hold their own references until they close)."""
        if self.fixed is not None:
            return
        held = {k[2] for k in self.blocks}
        native = set(self.native.values())
        for old in list(self._recent[:-1]):
            if len(held) < MAX_DTYPES:
                break
            if old == keep or old in native or old not in held:
                continue
            for k in [k for k in self.blocks if k[2] == old]:
                del self.blocks[k]
            held.discard(old)

    def tail(self, norm: str | None, dtype: torch.dtype | None = None):
        """(final norm or None, output head) of a language model, loaded on first use from the safetensors
        files in ``dtype`` (what the session's blocks compute in); ``norm`` is the path the client saw,
        accepted only if it names a norm (a leaf of vectors). The head is the model's own: one projection, or a
        list of ``Linear`` heads of one shape side by side (``diffuse.tail.is_head_list``)."""
        from diffuse.tail import head_path, is_head_list, is_norm

        key = (norm or "", dtype)
        if key in self._tails:
            return self._tails[key]
        skeleton = build_meta(self.subject.denoiser_class(), self.subject.denoiser_config)
        head = head_path(skeleton)
        if head is None:
            raise DiffuseError("this model has no output head to run here")
        wmap = renamed_for(weight_map(self.component_dir), skeleton)
        modules = []
        for path in (norm, head):
            if path is None:
                modules.append(None)
                continue
            if not isinstance(path, str) or len(path) > 200:
                raise DiffuseError("malformed tail")
            try:
                module = skeleton.get_submodule(path)
            except AttributeError:
                raise DiffuseError(f"the model has no module {path[:64]!r}") from None
            if path == norm and not is_norm(module):
                raise DiffuseError(f"{path[:64]!r} is not a norm; only the final norm and the head run after the stack")
            if path == head and isinstance(module, torch.nn.ModuleList) and not is_head_list(module):
                raise DiffuseError(f"the output head {path[:64]!r} is a list of modules that are not Linear heads "
                                   "of one shape; Diffuse runs such a head on the client")
            modules.append(self._load_part(module, path, wmap, dtype))
        del skeleton
        self._tails[key] = tuple(modules)
        return self._tails[key]

    def _load_part(self, module: torch.nn.Module, path: str, wmap, dtype: torch.dtype | None) -> torch.nn.Module:
        """``module`` (at ``path`` in a weightless skeleton) read from the files in ``dtype``, counted as held."""
        load_into(module, f"{path}.", wmap, dtype)
        self._loaded.update(module.parameters())
        return module.eval()

    def embedding(self, dtype: torch.dtype):
        """A language model's input embedding (its own ``get_input_embeddings()``, found here, not named by the
        client), loaded on first use from the safetensors files in ``dtype``."""
        from diffuse.embedding import embedding_path

        if dtype in self._embeds:
            return self._embeds[dtype]
        skeleton = build_meta(self.subject.denoiser_class(), self.subject.denoiser_config)
        path = embedding_path(skeleton)
        if path is None:
            raise DiffuseError("this model has no input embedding table to run here")
        module = self._load_part(skeleton.get_submodule(path), path,
                                 renamed_for(weight_map(self.component_dir), skeleton), dtype)
        del skeleton
        self._embeds[dtype] = module
        return module

    def blocks_of(self, sl: Slice, dtype: torch.dtype | None = None) -> list[tuple[int, torch.nn.Module]]:
        """(index, block) for each block of ``sl`` held in ``dtype`` (None: as loaded), in order."""
        return [(i, self.blocks[(sl.stack, i, self._dtype(sl.stack, i, dtype))]) for i in range(sl.start, sl.stop)]

    def held_parameters(self) -> int:
        """Elements of every parameter this node has read from the model's files and still holds (in the
        store, or in a session that keeps an older dtype's copy): counted without walking the heap, so a
        close costs nothing."""
        return sum(p.numel() for p in list(self._loaded) if p.device.type != "meta")


@dataclass
class Pass:
    """One call, checked and taken apart (``StageSession.prepare``): what running it through this node's layers
    needs, and what its outgoing message is made from. ``values`` holds the tensor slots, the stream slots
    replaced by each layer's output as it runs."""

    header: dict
    stack: str
    sl: Slice
    refs: list[SlotRef]
    values: list
    forward: dict
    rmap: ReturnMap
    tree: dict
    layer_trees: dict
    cache: object | None  # the session's key/value cache of this stack (a language model's pass), or None
    blocks: list[tuple[int, torch.nn.Module]]
    reuse: object | None = None  # the first-block cache's tag (diffuse.firstblock.Reuse), or None


class StageSession:
    """One client's session on this node."""

    def __init__(self, sid: bytes, store: BlockStore, stage: StagePlan, in_hop, out_hop):
        self.sid = sid
        self.stage = stage
        self.stale: dict[str, StaleStack] = {}  # per stack, made by the first call that carries a patch
        self.hop_log: list[list[int]] = []  # [seq, bytes] of every message that arrived on this hop
        self.busy_s = 0.0  # CPU seconds spent preparing and running calls, for the benchmark's utilisation
        self.busy_log: list[list] = []  # [seq, seconds] of every call this node worked on, for the same
        self.batched_passes = 0  # passes of this session that ran in a batch with other sessions' (diffuse.batching)
        self.store = store
        self.in_hop, self.out_hop = in_hop, out_hop
        self.trees: dict[str, dict] = {}
        self.rmaps: dict[str, ReturnMap] = {}
        self.slots = SlotCache(SLOT_CACHE_BYTES)  # (stack, slot) -> tensor; the client's mirror keeps the same
        self.kv = NodeCaches(store.subject.config_object)
        self.residuals = NodeResiduals()  # the first-block cache's (diffuse.firstblock)
        self.last_used = time.monotonic()
        self.bytes_in = self.bytes_out = self.messages = 0
        self.last_seq = 0  # the highest sequence number a message of this session carried here
        self.buffer_bytes = 0  # slot caches and stale buffers held now
        self._stale_bytes = 0
        self.room: int | None = None  # what this session may hold now, all sessions' buffers on this node counted
        # this session's own blocks, in its own dtype, for its whole life
        self.dtype = getattr(torch, stage.dtype, None) if stage.dtype else None
        if not isinstance(self.dtype, torch.dtype):
            self.dtype = None
        self.blocks = {sl.stack: store.blocks_of(sl, self.dtype) for sl in stage.slices if not sl.empty}
        first = next((p for bl in self.blocks.values() for _, b in bl for p in b.parameters()), None)
        self.tail_dtype = first.dtype if first is not None else self.dtype

    def handle(self, header: dict, tensors: list[torch.Tensor]) -> tuple[dict, list[torch.Tensor]]:
        """Process one message; return the message for the next hop."""
        p = self.prepare(header, tensors)
        if not isinstance(p, Pass):
            return p
        with torch.no_grad():
            out = self.run(p)
        return self.finish(p, out)

    def prepare(self, header: dict, tensors: list[torch.Tensor]) -> "Pass | tuple[dict, list[torch.Tensor]]":
        """A message checked and taken apart, ready to run through this node's layers (``run``), or the message
        to pass on as it is (results and errors on their way to the client; a call for a slice this node holds
        none of)."""
        self.last_used = time.monotonic()
        seq = header.get("seq")
        if type(seq) is int and seq > self.last_seq:
            self.last_seq = seq
        if header.get("op") != "call":
            return header, tensors  # results and errors pass through to the client
        if type(seq) is not int:
            raise DiffuseError("a call must carry an integer seq")
        if "slot_bytes" in header:  # the first call: what the client's mirror assumes this session may keep
            asked = header["slot_bytes"]
            if type(asked) is not int or not 0 <= asked <= SLOT_CACHE_BYTES:
                raise DiffuseError(f"the client asks to keep {str(asked)[:24]} bytes of tensors for its session; this "
                                   f"node keeps {SLOT_CACHE_BYTES >> 20} MiB at most (DIFFUSE_SLOT_CACHE_BYTES)")
            self.slots.max_bytes = asked
        stack = header.get("stack")
        sl = self.stage.slice_of(stack) if isinstance(stack, str) else None
        if sl is None:
            raise DiffuseError(f"this session gave the node no slice of stack {str(stack)[:64]!r}")
        if not isinstance(header.get("slots"), list) or len(header["slots"]) > MAX_TREE_NODES:
            raise DiffuseError("a call must list its slots")
        refs = [SlotRef.from_wire(w, len(tensors)) for w in header["slots"]]
        if "tree" in header:
            self.trees[stack] = _checked_tree(header["tree"], "call plan")
        if "rmap" in header:
            self.rmaps[stack] = ReturnMap.from_dict(header["rmap"])
        if stack not in self.trees or stack not in self.rmaps:
            raise DiffuseError(f"first call into {stack!r} arrived without its call plan")
        rmap = self.rmaps[stack]
        if any(i >= len(refs) for i in rmap.streams):
            raise DiffuseError("the return map threads slots this call does not have")
        layer_trees = header.get("layer_trees") or {}
        if not isinstance(layer_trees, dict) or len(layer_trees) > MAX_TREE_NODES \
                or not all(isinstance(k, str) for k in layer_trees):
            raise DiffuseError("malformed per-layer call plans")
        for t in (self.trees[stack], *layer_trees.values()):
            _checked_tree(t, "call plan", len(refs))
        state = header.get("state")
        if state is not None and not (isinstance(state, dict) and isinstance(state.get("kind"), str)):
            raise DiffuseError("malformed cache state")
        embed = header.get("embed")
        if embed is not None:
            embed = self._embed_spec(embed, rmap, len(refs))
        reuse = None
        if header.get("reuse") is not None:
            reuse = Reuse.from_wire(header["reuse"])
            if state is not None or layer_trees or header.get("patch") is not None:
                raise DiffuseError("the first-block cache applies to whole steps of a diffusion stack, not to "
                                   "patches or a language model's passes")
            if not isinstance(header.get("skip", False), bool):
                raise DiffuseError("malformed skip: true or false")
        values, forward = self._resolve(stack, refs, tensors)
        if sl.empty:
            return header, tensors
        if embed is not None and sl.start == 0:  # token ids in the first layer's input slot: embedded here
            values[embed[0]] = self._embed(values[embed[0]], embed[1])
            header = {k: v for k, v in header.items() if k != "embed"}
        cache = self.kv.get(stack, state["kind"], bool(state.get("fresh"))) if state is not None else None
        return Pass(header, stack, sl, refs, values, forward, rmap, self.trees[stack], layer_trees, cache,
                    self.blocks[stack], reuse)

    def run(self, p: "Pass"):
        """The call through this node's layers (or its PipeFusion patch through its stale buffers): the last
        layer's output; ``p.values`` then holds the stream slots' new values."""
        stack, rmap, values = p.stack, p.rmap, p.values
        if p.header.get("patch") is not None:
            patch = Patch.from_wire(p.header["patch"])
            why = why_uncut(rmap, PATCHABLE, False)
            if why:
                raise DiffuseError(f"{stack!r}: {why}, so its steps are never cut into patches")
            stale = self.stale.get(stack)
            if stale is None:
                stale = self.stale[stack] = StaleStack(stack, self.stage.attention)
            if patch.branch not in stale.branches and len(stale.branches) >= MAX_BRANCHES:
                raise DiffuseError(f"{stack!r}: stale buffers are kept for {MAX_BRANCHES} branches at most")
            out = stale.run(p.blocks, p.tree, values, rmap, patch)
            self._count_buffers(stale_changed=True)
            return out
        if p.reuse is not None:  # the first-block cache (diffuse.firstblock): this step skipped, or run and kept
            sl = p.sl
            last = sl.stop == self.store.stacks[stack].length
            out, skipped = self.residuals.run(stack, p.blocks, p.tree, values, rmap, p.reuse, sl.start == 0,
                                              p.header.get("skip", False), last, str(sl))
            p.header = dict(p.header, skip=skipped)
            self._count_buffers(stale_changed=True)
            return out
        out = None
        for i, block in p.blocks:
            args, kwargs = unflatten(p.layer_trees.get(str(i), p.tree), values, p.cache)
            out = block(*args, **kwargs)
            thread_outputs(values, out, rmap)
        return out

    def finish(self, p: "Pass", out) -> tuple[dict, list[torch.Tensor]]:
        """The message a run makes: the result for the client (after the tail, on the stack's last node), or
        the call handed on to the next node."""
        header, stack, rmap, values = p.header, p.stack, p.rmap, p.values
        if p.sl.stop == self.store.stacks[stack].length:
            if header.get("tail") is not None:  # on the stream, where the layer returns a tuple (Falcon)
                out = self._tail(out if rmap.single else out[rmap.output_of(rmap.streams[0])], header["tail"])
            tree, out_tensors = encode_value(out)
            result = {"op": "result", "stack": stack, "seq": header.get("seq"), "out": tree}
            if p.reuse is not None:
                result["skipped"] = header["skip"]
            return result, out_tensors
        # hand on: stream slots carry this node's output; new cached tensors travel on once
        streams = set(rmap.streams)
        slots, sent = [], []
        for i, ref in enumerate(p.refs):
            if i in streams:
                slots.append(SlotRef(frame=len(sent)).to_wire())
                sent.append(values[i])
            elif not ref.held:
                slots.append(SlotRef(frame=len(sent), digest=ref.digest).to_wire())
                sent.append(p.forward[i])
            else:
                slots.append(ref.to_wire())
        return dict(header, slots=slots), sent

    @staticmethod
    def _embed_spec(embed, rmap: ReturnMap, slots: int) -> tuple[int, torch.dtype]:
        """(slot, dtype) of a pass whose first layer's input is token ids, checked: a stream slot, a float dtype."""
        if not isinstance(embed, dict) or type(embed.get("slot")) is not int or not isinstance(embed.get("dtype"), str):
            raise DiffuseError("malformed embed: a map of slot (an integer) and dtype (a name)")
        slot, dtype = embed["slot"], getattr(torch, embed["dtype"][:32], None)
        if not 0 <= slot < slots or slot not in rmap.streams:
            raise DiffuseError("embed names a slot that does not carry the stack's hidden state")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise DiffuseError(f"embed asks for dtype {embed['dtype'][:32]!r}, which is not a float dtype")
        return slot, dtype

    def _embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The first hidden states of a pass: its token ids looked up in this node's copy of the table."""
        from diffuse.embedding import checked_ids

        table = self.store.embedding(dtype)
        ids = checked_ids(ids, table.weight.shape[0])
        with torch.no_grad():
            return table(ids)

    def _tail(self, hidden: torch.Tensor, tail) -> dict:
        """Final norm, the rows decoding needs, output head; the best candidates or the whole rows; with a
        ``draw``, also the token generate's processors and sampling pick from the whole last row. A list of heads
        runs whole, laid out as generate reads it (``diffuse.tail.stack_heads``), its ids as int32."""
        from diffuse.tail import stack_heads, top_candidates

        if not isinstance(tail, dict) or not isinstance(tail.get("rows"), list) or len(tail["rows"]) != 2 \
                or not all(isinstance(r, int) for r in tail["rows"]) or not isinstance(tail.get("top"), int):
            raise DiffuseError("malformed tail")
        norm, head = self.store.tail(tail.get("norm"), self.tail_dtype)
        start, stop = tail["rows"]
        if not 0 <= start < stop <= hidden.shape[1]:
            raise DiffuseError("tail rows out of range")
        listed = isinstance(head, torch.nn.ModuleList)
        with torch.no_grad():
            h = norm(hidden) if norm is not None else hidden
            logits = stack_heads(head, h[:, start:stop]) if listed else head(h[:, start:stop])
        if 0 < tail["top"] < logits.shape[-1]:
            ids, values = top_candidates(logits, tail["top"])
            if listed and logits.shape[-1] <= torch.iinfo(torch.int32).max:
                ids = ids.to(torch.int32)
            answer = {"ids": ids, "values": values}
        else:
            answer = {"logits": logits}
        if tail.get("draw") is not None:  # generate's processors and its draw, here (diffuse.sampling)
            from diffuse.sampling import NodeSampler

            sampler = getattr(self, "sampler", None)
            if sampler is None:
                sampler = self.sampler = NodeSampler()
            with torch.no_grad():
                answer.update(sampler.draw(tail["draw"], logits[:, -1]))
            if listed:
                answer["drawn"] = answer["drawn"].to(torch.int32)
        return answer

    def report(self) -> dict:
        """What the session did, for the client's summary (sent at close, before the buffers go)."""
        return {"bytes_in": self.bytes_in, "bytes_out": self.bytes_out, "messages": self.messages,
                "cache_bytes": self.kv.nbytes(), "batched_passes": self.batched_passes,
                "hop_bytes": self.hop_log, "busy_s": self.busy_s, "busy_log": self.busy_log,
                "stale": {k: v.report() for k, v in self.stale.items()},
                "first_block_cache": self.residuals.report()}

    def _count_buffers(self, stale_changed: bool = False) -> None:
        """Recount what this session keeps; past its own bounds or the node's, the call fails (the client
        hears why, and its session is no use any more: its mirror no longer matches)."""
        if stale_changed:  # PipeFusion's stale buffers and the first-block cache's residuals: one bound
            self._stale_bytes = sum(v.report()["buffer_bytes"] for v in self.stale.values()) + self.residuals.nbytes
        stale = self._stale_bytes
        self.buffer_bytes = self.slots.nbytes + stale
        if stale > STALE_BYTES:
            what = "cached residuals" if not self.stale else "stale buffers"
            raise DiffuseError(f"this session's {what} hold {stale >> 20} MiB, more than the "
                               f"{STALE_BYTES >> 20} MiB a session may keep on this node (DIFFUSE_STALE_BYTES)")
        if self.room is not None and self.buffer_bytes > self.room:
            held, self.slots = self.buffer_bytes, SlotCache(self.slots.max_bytes)  # what it kept goes
            self.buffer_bytes = self._stale_bytes
            raise DiffuseError(f"this node keeps {NODE_BUFFER_BYTES >> 20} MiB of tensors for all its sessions at "
                               f"most and has no room for this one's {held / 2**20:.1f} MiB: try again "
                               "when other sessions end (DIFFUSE_NODE_BUFFER_BYTES)")

    def _resolve(self, stack: str, refs: list[SlotRef], tensors: list) -> tuple[list, dict]:
        cache = self.slots
        values, forward = [], {}
        for i, ref in enumerate(refs):
            if ref.held:
                t = cache.get((stack, i), ref.digest)
                if t is None:
                    raise DiffuseError(f"slot {i} of {stack!r} refers to a tensor this node no longer holds")
            else:
                t = tensors[ref.frame]
                forward[i] = t
                if ref.digest is not None:
                    cache.put((stack, i), ref.digest, t, t.numel() * t.element_size())
            values.append(t)
        self._count_buffers()
        return values, forward


def _checked_tree(tree, what: str, slots: int | None = None) -> dict:
    """A call plan from a peer, checked before any of it is used: a map of ``args`` (a list) and
    ``kwargs`` (a map of strings), nodes of known kinds, tensor numbers in range (``slots``), bounded
    in depth and size."""
    if not isinstance(tree, dict) or set(tree) != {"args", "kwargs"} or not isinstance(tree["args"], list) \
            or not isinstance(tree["kwargs"], dict) or not all(isinstance(k, str) for k in tree["kwargs"]):
        raise DiffuseError(f"malformed {what}: a map of args (a list) and kwargs (a map)")
    count = 0

    def walk(x, depth: int) -> None:
        nonlocal count
        count += 1
        if depth > MAX_TREE_DEPTH or count > MAX_TREE_NODES:
            raise DiffuseError(f"malformed {what}: nested deeper than {MAX_TREE_DEPTH} or larger than "
                               f"{MAX_TREE_NODES} entries")
        if x is None or isinstance(x, (bool, int, float, str)):
            return
        if isinstance(x, list):
            for v in x:
                walk(v, depth + 1)
            return
        if not isinstance(x, dict) or len(x) != 1:
            raise DiffuseError(f"malformed {what}: a {type(x).__name__} where a value or a one-key marker belongs")
        (k, v), = x.items()
        if k == TENSOR:
            if type(v) is not int or v < 0 or (slots is not None and v >= slots):
                raise DiffuseError(f"malformed {what}: tensor number {str(v)[:24]} is not one of its "
                                   f"{slots if slots is not None else 'slots'}")
        elif k == TUPLE and isinstance(v, list):
            for e in v:
                walk(e, depth + 1)
        elif k == DICT and isinstance(v, dict) and all(isinstance(n, str) for n in v):
            for e in v.values():
                walk(e, depth + 1)
        elif k == "$float" and v in ("nan", "inf", "-inf"):
            pass
        elif k == STATE and isinstance(v, str):
            pass
        else:
            raise DiffuseError(f"malformed {what}: unknown marker {str(k)[:24]!r}")

    for v in (*tree["args"], *tree["kwargs"].values()):
        walk(v, 1)
    return tree
