"""The blocks one node holds: read straight from the safetensors files into a weightless skeleton.

``BlockStore`` loads single blocks, leaving each tensor where the loader puts it
(the same placement ``from_pretrained`` gives, which keeps results
bit-identical), and on first use a language model's final norm and output head
(``tail``) and its input embedding (``embedding``). Blocks are held per dtype:
a node started with ``--blocks`` serves the dtype it loaded only; one started
without keeps copies in ``MAX_DTYPES`` dtypes at most, the least recently asked
going first (sessions keep their own references until they close).

Everything is read onto the node's device (``diffuse.plan.devices.Compute``) straight from the
files, one tensor at a time, in the compute dtype; a node whose dtype was named
(``--dtype``) holds and serves that dtype only. A node started with ``--quantize`` holds its
blocks' linear weights quantized (``diffuse.plan.quantize``), each block as it loads; its
output head and embedding stay in the compute dtype, as the libraries' quantizers leave them.
"""

from __future__ import annotations

import gc
import logging
import time
import weakref

import torch

from diffuse.plan.analysis import ModelSubject, build_meta
from diffuse.plan.devices import Compute, place
from diffuse.errors import DiffuseError
from diffuse.plan.modelfiles import fp32_kept, load_into, located, renamed_for, weight_map
from diffuse.plan.contracts import Slice, StackPlan
from diffuse.plan.fetching import hub_commit, hub_folder
from diffuse.plan.ggufread import gguf_parts, load_gguf_block, part_of
from diffuse.plan.prequant import rebuild_quantized, saved_quantized
from diffuse.plan.quantize import large_from_system, library_rule, off_the_file, quantize, release_freed

log = logging.getLogger("diffuse.node")

MAX_DTYPES = 2  # compute dtypes a node without --blocks keeps copies of its blocks in (sessions keep their own)


class BlockStore:
    """The blocks one node holds, and nothing else of the model."""

    def __init__(self, model_path: str, subject: ModelSubject, stacks: list[StackPlan], compute: Compute | None = None):
        self.model_path = model_path
        self.compute = compute or Compute()
        self.device = self.compute.device
        self.subject = subject
        self.stacks = {s.path: s for s in stacks}
        self.component_dir = f"{model_path}/{subject.denoiser}"
        self.model_hash = self.subject.content_hash()  # of every denoiser component, when a pipeline has several
        self.model_commit = hub_commit(model_path)  # a Hub model's commit, "" for a folder of one's own
        self.model_repo = (hub_folder(model_path) or {}).get("repo", model_path)
        self.blocks: dict[tuple[str, int], torch.nn.Module] = {}
        self.fixed: list[Slice] | None = None  # set by --blocks: the node holds exactly these
        self.native: dict[tuple[str, int], torch.dtype] = {}  # what each block loads as, asked for no dtype
        self._recent: list[torch.dtype] = []  # dtypes asked for, most recent last
        self._tails: dict[tuple, tuple] = {}  # a language model's (final norm, output head), by norm path and dtype
        self._embeds: dict[torch.dtype, torch.nn.Module] = {}  # a language model's input embedding, by dtype
        self._loaded: weakref.WeakSet = weakref.WeakSet()  # every parameter read from the files, while alive
        self.compiled = False  # --compile: blocks through torch.compile (inductor) as they load; not exact

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
        if self.compute.fixed and dtype is not None and dtype != self.compute.dtype:
            have = str(self.compute.dtype).removeprefix("torch.")
            raise DiffuseError(f"this node computes in {have} (--dtype {have}); the client asks "
                               f"{str(dtype).removeprefix('torch.')}: run the client with --dtype {have}, or use "
                               "another node")
        if self.fixed is not None and dtype is not None and self.native:
            served = self._served_dtypes()
            if dtype not in served:
                have = " and ".join(sorted(str(d).removeprefix("torch.") for d in served))
                raise DiffuseError(f"this node holds its blocks in {have} (started with --blocks) and serves that "
                                   f"dtype only; the client asks {str(dtype).removeprefix('torch.')}: run the "
                                   f"client in {have}, or use a node started without --blocks")
        if dtype is not None:
            self._recent = [d for d in self._recent if d != dtype] + [dtype]
        asked, dtype = dtype, dtype if dtype is not None else self.compute.dtype
        wanted = [(sl.stack, i) for sl in slices for i in range(sl.start, sl.stop)
                  if (sl.stack, i, self._dtype(sl.stack, i, asked)) not in self.blocks]
        if not wanted:
            return
        self._forget_old_dtypes(dtype)
        t0 = time.perf_counter()
        skeleton = build_meta(self.subject.denoiser_class(), self.subject.denoiser_config)
        ggufs = gguf_parts(self.subject)  # a GGUF denoiser: its blocks held as diffusers' GGUF quantizer holds them
        plain = {s for s, _ in wanted if not part_of(ggufs, f"{s}.")}
        wmap = located(renamed_for(self.subject.weight_map(), skeleton), skeleton, plain) if plain else {}
        files: dict[str, object] = {}
        keep = fp32_kept(skeleton, dtype)
        rule = library_rule(skeleton) if self.compute.quant else ()  # what the model's library leaves unquantized
        if self.compute.quant:
            large_from_system(1 << 20)
        try:
            for stack, i in wanted:
                block = skeleton.get_submodule(stack)[i]
                if stack in plain:  # a VAE (--decoder) keeps in float32 what its own class says, no other part's
                    own = fp32_kept(block, dtype) if stack in self.subject.decoders else keep
                    load_into(block, f"{stack}.{i}.", wmap, dtype, files=files, device=self.device, keep=own,
                              skip=saved_quantized(wmap, f"{stack}.{i}.", block, self.subject.denoiser_config))
                    rebuild_quantized(block, f"{stack}.{i}.", wmap, files)  # (saved quantized: torchao, bitsandbytes)
                else:
                    load_gguf_block(skeleton, ggufs, (stack, i), block, dtype, files, self.device)
                place(block, self.device)  # what the files do not hold (buffers made at construction)
                p = next((p for p in block.parameters() if p.is_floating_point()), None)
                actual = dtype or (p.dtype if p is not None and stack in plain else torch.float32)
                # a VAE (--decoder) is held as plain diffusers holds it beside a quantized denoiser: unquantized
                if stack not in self.subject.decoders and quantize(block, f"{stack}.{i}.", self.compute.quant,
                                                                   self.device, actual, rule):
                    # the file's pages read to quantize this block, and what quantizing it freed, go now: the
                    # node's peak is its quantized slice and one block, not the unquantized slice
                    off_the_file(block)
                    files.clear()
                    release_freed()
                self._loaded.update(block.parameters())
                block.eval()
                if self.compiled:
                    block.compile()  # traced at its first call of each shape; the same module object
                if asked is None:
                    self.native[(stack, i)] = actual
                self.blocks[(stack, i, dtype or actual)] = block
        finally:
            files.clear()
            if self.compute.quant:
                large_from_system(32 << 20)
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
        list of ``Linear`` heads of one shape side by side (``diffuse.lm.heads.is_head_list``)."""
        from diffuse.lm.heads import head_path, is_head_list, is_norm

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
        load_into(module, f"{path}.", wmap, dtype, device=self.device, keep=fp32_kept(self._model_of(module), dtype))
        place(module, self.device)
        self._loaded.update(module.parameters())
        return module.eval()

    def _model_of(self, module: torch.nn.Module):
        """The class whose float32-kept modules apply to a part of it (the part's own class says nothing)."""
        return self.subject.denoiser_class()

    def embedding(self, dtype: torch.dtype):
        """A language model's input embedding (its own ``get_input_embeddings()``, found here, not named by the
        client), loaded on first use from the safetensors files in ``dtype``."""
        from diffuse.lm.embedding import embedding_path

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
