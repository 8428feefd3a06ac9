"""A node's share of the model and the loop that threads hidden states through it.

``BlockStore`` loads single blocks straight from the safetensors files into a
weightless skeleton, leaving each tensor where the loader puts it (the same
placement ``from_pretrained`` gives, which keeps results bit-identical).
``StageSession`` is one client's session: its hop keys, its remembered call
plans and return maps, and its slot caches. A call that carries ``patch`` (PipeFusion)
runs through the session's ``diffuse.stale.StaleStack`` for that stack instead.
"""

from __future__ import annotations

import gc
import logging
import time

import torch

from diffuse.analysis import ModelSubject, build_meta
from diffuse.callplan import SlotCache, encode_value, thread_outputs, unflatten
from diffuse.errors import DiffuseError
from diffuse.modelfiles import content_hash, load_into, weight_map
from diffuse.plan import Slice, StackPlan, split_evenly
from diffuse.stale import StaleStack

log = logging.getLogger("diffuse.node")


def parse_blocks(spec: str | None, stacks: list[StackPlan]) -> list[Slice] | None:
    """``"2/3"`` (the 2nd of 3 even shares of every stack), ``"all"``, or ``"blocks[0:4],x[2:3]"``."""
    if spec is None:
        return None
    spec = spec.strip()
    if spec == "all":
        return [Slice(s.path, 0, s.length) for s in stacks]
    if "/" in spec and "[" not in spec:
        try:
            i, n = (int(x) for x in spec.split("/"))
        except ValueError:
            raise DiffuseError(f"--blocks {spec}: a share is I/N with whole numbers, e.g. 2/3") from None
        if not 1 <= i <= n:
            raise DiffuseError(f"--blocks {spec}: share must be between 1/{n} and {n}/{n}")
        return [Slice(s.path, *split_evenly(s.length, n)[i - 1]) for s in stacks]
    out = []
    for part in spec.split(","):
        try:
            path, rng = part.strip().rstrip("]").split("[")
            a, b = (int(x) for x in rng.split(":"))
        except ValueError:
            raise DiffuseError(f"--blocks {part!r}: expected STACK[START:STOP], e.g. blocks[0:20]") from None
        st = next((s for s in stacks if s.path == path), None)
        if st is None:
            raise DiffuseError(f"--blocks {part!r}: the model has no stack {path!r} (stacks: {[s.path for s in stacks]})")
        if not 0 <= a <= b <= st.length:
            raise DiffuseError(f"--blocks {part!r}: {path} has {st.length} blocks")
        out.append(Slice(path, a, b))
    return out


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
        wmap = weight_map(self.component_dir)
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

    def run(self, stack: str, start: int, stop: int):
        return [self.blocks[(stack, i)] for i in range(start, stop)]

    def held_parameters(self) -> int:
        """Elements of every real (non-meta) parameter alive in this process."""
        return sum(
            o.numel() for o in gc.get_objects()
            if isinstance(o, torch.nn.Parameter) and o.device.type != "meta"
        )


class StageSession:
    """One client's session on this node."""

    def __init__(self, sid: bytes, store: BlockStore, slices: list[Slice], in_hop, out_hop, next_address: str,
                 attention: str = "auto"):
        self.sid = sid
        self.attention = attention  # PipeFusion attention path: "auto" (quick where verified) or "plain"
        self.stale: dict[str, StaleStack] = {}  # per stack, made by the first call that carries a patch
        self.hop_log: list[list[int]] = []  # [seq, bytes] of every message that arrived on this hop
        self.busy_s = 0.0  # seconds spent running blocks (handle), for the benchmark's utilisation
        self.store = store
        self.slices = {s.stack: s for s in slices}
        self.in_hop, self.out_hop = in_hop, out_hop
        self.next_address = next_address
        self.trees: dict[str, dict] = {}
        self.rmaps: dict[str, dict] = {}
        self.caches: dict[str, SlotCache] = {}
        self.last_used = time.monotonic()
        self.bytes_in = self.bytes_out = self.messages = 0

    def handle(self, header: dict, tensors: list[torch.Tensor]) -> tuple[dict, list[torch.Tensor]]:
        """Process one message; return the message for the next hop."""
        self.last_used = time.monotonic()
        if header.get("op") != "call":
            return header, tensors  # results and errors pass through to the client
        stack = header["stack"]
        sl = self.slices.get(stack)
        if sl is None:
            raise DiffuseError(f"this session gave the node no slice of stack {stack!r}")
        if "tree" in header:
            self.trees[stack] = header["tree"]
        if "rmap" in header:
            self.rmaps[stack] = header["rmap"]
        if stack not in self.trees or stack not in self.rmaps:
            raise DiffuseError(f"first call into {stack!r} arrived without its call plan")
        values, forward = self._resolve(stack, header["slots"], tensors)
        if sl.start == sl.stop:
            return header, tensors
        rmap = self.rmaps[stack]
        out = None
        patch = header.get("patch")
        if patch is not None:
            if len(rmap["streams"]) != 1:
                raise DiffuseError(f"{stack!r} carries {len(rmap['streams'])} streams: it runs whole steps, not patches")
            stale = self.stale.get(stack)
            if stale is None:
                stale = self.stale[stack] = StaleStack(stack, self.attention)
            blocks = list(zip(range(sl.start, sl.stop), self.store.run(stack, sl.start, sl.stop)))
            stream = rmap["streams"][0]
            with torch.no_grad():
                if patch.get("whole"):
                    out = stale.run_whole(blocks, self.trees[stack], values, rmap, stream, patch["branch"],
                                          patch["tokens"])
                else:
                    out = stale.run_patch(blocks, self.trees[stack], values, rmap, stream, patch["branch"],
                                          patch["axis"], patch["lo"], patch["count"], patch["tokens"])
        else:
            with torch.no_grad():
                for block in self.store.run(stack, sl.start, sl.stop):
                    args, kwargs = unflatten(self.trees[stack], values)
                    out = block(*args, **kwargs)
                    thread_outputs(values, out, rmap)
        if sl.stop == self.store.stacks[stack].length:
            tree, out_tensors = encode_value(out)
            return {"op": "result", "stack": stack, "seq": header["seq"], "out": tree}, out_tensors
        # hand on: stream slots carry this node's output; new cached tensors travel on once
        streams = set(rmap["streams"])
        slots, sent = [], []
        for i, desc in enumerate(header["slots"]):
            if i in streams:
                slots.append(["f", len(sent)])
                sent.append(values[i])
            elif desc[0] == "f":
                slots.append(["f", len(sent), *desc[2:]])
                sent.append(forward[i])
            else:
                slots.append(desc)
        return dict(header, slots=slots), sent

    def report(self) -> dict:
        """What the session did, for the client's summary (sent at close, before the buffers go)."""
        return {"bytes_in": self.bytes_in, "bytes_out": self.bytes_out, "messages": self.messages,
                "hop_bytes": self.hop_log, "busy_s": self.busy_s, "stale": {k: v.report() for k, v in self.stale.items()}}

    def _resolve(self, stack: str, slots: list, tensors: list) -> tuple[list, dict]:
        cache = self.caches.setdefault(stack, SlotCache())
        values, forward = [], {}
        for i, desc in enumerate(slots):
            if desc[0] == "f":
                t = tensors[desc[1]]
                forward[i] = t
                if len(desc) > 2:
                    cache.put(i, desc[2], t)
            elif desc[0] == "h":
                t = cache.get(i, desc[1])
                if t is None:
                    raise DiffuseError(f"slot {i} of {stack!r} refers to a tensor this node no longer holds")
            else:
                raise DiffuseError(f"malformed slot descriptor {desc!r}")
            values.append(t)
        return values, forward
