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
layer's get their own tree.
"""

from __future__ import annotations

import gc
import logging
import time

import torch

from diffuse.analysis import ModelSubject, build_meta
from diffuse.callplan import SlotCache, encode_value, thread_outputs, unflatten
from diffuse.errors import DiffuseError
from diffuse.kvcache import NodeCaches
from diffuse.modelfiles import content_hash, load_into, renamed_for, weight_map
from diffuse.pipefusion import StaleStack, why_uncut
from diffuse.plan import PATCHABLE, Patch, ReturnMap, Slice, SlotRef, StackPlan, StagePlan

log = logging.getLogger("diffuse.node")


class BlockStore:
    """The blocks one node holds, and nothing else of the model."""

    def __init__(self, model_path: str, subject: ModelSubject, stacks: list[StackPlan]):
        self.model_path = model_path
        self.subject = subject
        self.stacks = {s.path: s for s in stacks}
        self.component_dir = f"{model_path}/{subject.denoiser}"
        self.model_hash = content_hash(self.component_dir)
        self.blocks: dict[tuple[str, int], torch.nn.Module] = {}
        self.fixed: list[Slice] | None = None  # set by --blocks: the node holds exactly these
        self.dtypes: dict[tuple[str, int], torch.dtype] = {}  # what each held block computes in
        self._tails: dict[str, tuple] = {}  # a language model's (final norm, output head), by norm path

    def covers(self, sl: Slice) -> bool:
        return all((sl.stack, i) in self.blocks for i in range(sl.start, sl.stop))

    def load(self, slices: list[Slice], dtype: torch.dtype | None = None) -> None:
        """Hold what ``slices`` name, in ``dtype`` (None: as ``from_pretrained`` would load it),
        reading the safetensors files only; a block held in another dtype is read again."""
        wanted = [(sl.stack, i) for sl in slices for i in range(sl.start, sl.stop)
                  if (sl.stack, i) not in self.blocks or (dtype is not None and self.dtypes[(sl.stack, i)] != dtype)]
        if not wanted:
            return
        t0 = time.perf_counter()
        skeleton = build_meta(self.subject.denoiser_class(), self.subject.denoiser_config)
        wmap = renamed_for(weight_map(self.component_dir), skeleton)
        files: dict[str, object] = {}
        try:
            for stack, i in wanted:
                block = skeleton.get_submodule(stack)[i]
                load_into(block, f"{stack}.{i}.", wmap, dtype, files=files)
                block.eval()
                self.blocks[(stack, i)] = block
                p = next(block.parameters(), None)
                self.dtypes[(stack, i)] = p.dtype if p is not None else dtype
        finally:
            files.clear()
        del skeleton
        gc.collect()
        log.info("loaded %d blocks in %.2f s", len(wanted), time.perf_counter() - t0)

    def tail(self, norm: str | None):
        """(final norm or None, output head) of a language model, loaded on first use from the safetensors
        files; ``norm`` is the path the client saw, accepted only if it names a norm (a leaf of vectors)."""
        from diffuse.tail import head_path, is_norm

        key = norm or ""
        if key in self._tails:
            return self._tails[key]
        skeleton = build_meta(self.subject.denoiser_class(), self.subject.denoiser_config)
        head = head_path(skeleton)
        if head is None:
            raise DiffuseError("this model has no output head to run here")
        wmap = renamed_for(weight_map(self.component_dir), skeleton)
        dtype = next(iter(self.dtypes.values()), None)  # what the held blocks compute in
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
            load_into(module, f"{path}.", wmap, dtype)
            module.eval()
            modules.append(module)
        del skeleton
        self._tails[key] = tuple(modules)
        return self._tails[key]

    def blocks_of(self, sl: Slice) -> list[tuple[int, torch.nn.Module]]:
        """(index, block) for each block of ``sl``, in order."""
        return [(i, self.blocks[(sl.stack, i)]) for i in range(sl.start, sl.stop)]

    def held_parameters(self) -> int:
        """Elements of every real (non-meta) parameter alive in this process."""
        return sum(
            o.numel() for o in gc.get_objects()
            if isinstance(o, torch.nn.Parameter) and o.device.type != "meta"
        )


class StageSession:
    """One client's session on this node."""

    def __init__(self, sid: bytes, store: BlockStore, stage: StagePlan, in_hop, out_hop):
        self.sid = sid
        self.stage = stage
        self.stale: dict[str, StaleStack] = {}  # per stack, made by the first call that carries a patch
        self.hop_log: list[list[int]] = []  # [seq, bytes] of every message that arrived on this hop
        self.busy_s = 0.0  # seconds spent running blocks (handle), for the benchmark's utilisation
        self.store = store
        self.in_hop, self.out_hop = in_hop, out_hop
        self.trees: dict[str, dict] = {}
        self.rmaps: dict[str, ReturnMap] = {}
        self.caches: dict[str, SlotCache] = {}
        self.kv = NodeCaches(store.subject.config_object)
        self.last_used = time.monotonic()
        self.bytes_in = self.bytes_out = self.messages = 0

    def handle(self, header: dict, tensors: list[torch.Tensor]) -> tuple[dict, list[torch.Tensor]]:
        """Process one message; return the message for the next hop."""
        self.last_used = time.monotonic()
        if header.get("op") != "call":
            return header, tensors  # results and errors pass through to the client
        stack = header.get("stack")
        sl = self.stage.slice_of(stack) if isinstance(stack, str) else None
        if sl is None:
            raise DiffuseError(f"this session gave the node no slice of stack {str(stack)[:64]!r}")
        if "tree" in header:
            if not isinstance(header["tree"], dict) or set(header["tree"]) != {"args", "kwargs"}:
                raise DiffuseError("malformed call plan")
            self.trees[stack] = header["tree"]
        if "rmap" in header:
            self.rmaps[stack] = ReturnMap.from_dict(header["rmap"])
        if stack not in self.trees or stack not in self.rmaps:
            raise DiffuseError(f"first call into {stack!r} arrived without its call plan")
        if not isinstance(header.get("slots"), list):
            raise DiffuseError("a call must list its slots")
        refs = [SlotRef.from_wire(w, len(tensors)) for w in header["slots"]]
        rmap = self.rmaps[stack]
        if any(i >= len(refs) for i in rmap.streams):
            raise DiffuseError("the return map threads slots this call does not have")
        layer_trees = header.get("layer_trees") or {}
        if not isinstance(layer_trees, dict) or not all(
                isinstance(t, dict) and set(t) == {"args", "kwargs"} for t in layer_trees.values()):
            raise DiffuseError("malformed per-layer call plans")
        state = header.get("state")
        if state is not None and not (isinstance(state, dict) and isinstance(state.get("kind"), str)):
            raise DiffuseError("malformed cache state")
        values, forward = self._resolve(stack, refs, tensors)
        if sl.empty:
            return header, tensors
        blocks = self.store.blocks_of(sl)
        tree = self.trees[stack]
        cache = self.kv.get(stack, state["kind"], bool(state.get("fresh"))) if state is not None else None
        with torch.no_grad():
            if header.get("patch") is not None:
                patch = Patch.from_wire(header["patch"])
                why = why_uncut(rmap, PATCHABLE, False)
                if why:
                    raise DiffuseError(f"{stack!r}: {why}, so its steps are never cut into patches")
                stale = self.stale.get(stack)
                if stale is None:
                    stale = self.stale[stack] = StaleStack(stack, self.stage.attention)
                out = stale.run(blocks, tree, values, rmap, patch)
            else:
                for i, block in blocks:
                    args, kwargs = unflatten(layer_trees.get(str(i), tree), values, cache)
                    out = block(*args, **kwargs)
                    thread_outputs(values, out, rmap)
        if sl.stop == self.store.stacks[stack].length:
            if header.get("tail") is not None:
                out = self._tail(out, header["tail"])
            tree, out_tensors = encode_value(out)
            return {"op": "result", "stack": stack, "seq": header.get("seq"), "out": tree}, out_tensors
        # hand on: stream slots carry this node's output; new cached tensors travel on once
        streams = set(rmap.streams)
        slots, sent = [], []
        for i, ref in enumerate(refs):
            if i in streams:
                slots.append(SlotRef(frame=len(sent)).to_wire())
                sent.append(values[i])
            elif not ref.held:
                slots.append(SlotRef(frame=len(sent), digest=ref.digest).to_wire())
                sent.append(forward[i])
            else:
                slots.append(ref.to_wire())
        return dict(header, slots=slots), sent

    def _tail(self, hidden: torch.Tensor, tail) -> dict:
        """Final norm, the rows decoding needs, output head; the best candidates or the whole rows; with a
        ``draw``, also the token generate's processors and sampling pick from the whole last row."""
        from diffuse.tail import top_candidates

        if not isinstance(tail, dict) or not isinstance(tail.get("rows"), list) or len(tail["rows"]) != 2 \
                or not all(isinstance(r, int) for r in tail["rows"]) or not isinstance(tail.get("top"), int):
            raise DiffuseError("malformed tail")
        norm, head = self.store.tail(tail.get("norm"))
        start, stop = tail["rows"]
        if not 0 <= start < stop <= hidden.shape[1]:
            raise DiffuseError("tail rows out of range")
        with torch.no_grad():
            h = norm(hidden) if norm is not None else hidden
            logits = head(h[:, start:stop])
        if 0 < tail["top"] < logits.shape[-1]:
            ids, values = top_candidates(logits, tail["top"])
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
        return answer

    def report(self) -> dict:
        """What the session did, for the client's summary (sent at close, before the buffers go)."""
        return {"bytes_in": self.bytes_in, "bytes_out": self.bytes_out, "messages": self.messages,
                "cache_bytes": self.kv.nbytes(),
                "hop_bytes": self.hop_log, "busy_s": self.busy_s, "stale": {k: v.report() for k, v in self.stale.items()}}

    def _resolve(self, stack: str, refs: list[SlotRef], tensors: list) -> tuple[list, dict]:
        cache = self.caches.setdefault(stack, SlotCache())
        values, forward = [], {}
        for i, ref in enumerate(refs):
            if ref.held:
                t = cache.get(i, ref.digest)
                if t is None:
                    raise DiffuseError(f"slot {i} of {stack!r} refers to a tensor this node no longer holds")
            else:
                t = tensors[ref.frame]
                forward[i] = t
                if ref.digest is not None:
                    cache.put(i, ref.digest, t)
            values.append(t)
        return values, forward
