"""What a model needs per block, read from its config and safetensors headers alone: weight bytes in the compute dtype, and a language model's cache at a context."""

from __future__ import annotations
from dataclasses import dataclass
from diffuse.errors import DiffuseError
from diffuse.plan.contracts import SlicingPlan
import dataclasses
import json
import math


DEFAULT_CONTEXT = 4096  # tokens of key/value cache planned per language-model session (capped by the model's own)


@dataclass(frozen=True)
class BlockCost:
    stack: str
    index: int
    weight_bytes: int  # its tensors in the compute dtype (integer tensors in their own)
    state_bytes: int = 0  # per-session state it keeps on its node (a language model's key/value cache)
    end_bytes: int = 0  # what the node holding it holds besides: a language model's output head (last block)
    end_compute: int = 0  # ... and computes, in weight bytes (the head, once a token)
    once: bool = False  # runs once per request, not in every pass (an encoder's layer, diffuse.plan.encoders)

    @property
    def compute_bytes(self) -> int:
        """What a pass costs its node, in weight bytes run through: none for a block that runs once a request."""
        return 0 if self.once else self.weight_bytes + self.end_compute

    @property
    def held_bytes(self) -> int:
        """Memory its node gives it beyond its weights."""
        return self.state_bytes + self.end_bytes


_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
          "I8": 1, "U8": 1, "U16": 2, "U32": 4, "U64": 8, "BOOL": 1}



def _header(path: str) -> dict:
    """A safetensors file's header: tensor name -> {dtype, shape, data_offsets} (no tensor data is read); a GGUF
    file's: name -> {dtype (its GGML type), shape, nbytes} (``diffuse.plan.ggufread.header_entries``)."""
    if path.endswith(".gguf"):
        from diffuse.plan.ggufread import header_entries

        return header_entries(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= 100 << 20:
            raise DiffuseError(f"{path}: not a safetensors file (header of {n} bytes)")
        return json.loads(f.read(n))


def _dtype_size(dtype: str) -> int:
    import torch

    d = getattr(torch, dtype, None)
    if not isinstance(d, torch.dtype):
        raise DiffuseError(f"unknown compute dtype {dtype!r}")
    return d.itemsize


def load_dtype(subject) -> str:
    """The dtype a plain load computes in: a transformers model's config dtype (its ``from_pretrained`` loads
    ``"auto"``), float32 for a diffusers pipeline."""
    if subject.autoregressive:
        cfg = subject.denoiser_config
        d = cfg.get("dtype") or cfg.get("torch_dtype") or (cfg.get("text_config") or {}).get("dtype")
        return d if isinstance(d, str) and d in ("float32", "float16", "bfloat16") else "float32"
    return "float32"


def cache_bytes_per_token(subject, itemsize: int) -> int:
    """A language model's key/value cache per layer per token (0 for other models, or where it cannot be told)."""
    if not subject.autoregressive:
        return 0
    cfg = subject.denoiser_config
    cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    heads = cfg.get("num_attention_heads")
    kv = cfg.get("num_key_value_heads") or heads
    dim = cfg.get("head_dim") or ((cfg.get("hidden_size") or 0) // heads if heads else 0)
    return 2 * int(kv or 0) * int(dim or 0) * itemsize


def context_tokens(subject, context: int | None = None) -> int:
    cfg = subject.denoiser_config
    cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    most = cfg.get("max_position_embeddings")
    want = context or DEFAULT_CONTEXT
    return min(want, most) if isinstance(most, int) and most > 0 else want


def block_costs(subject, stacks, dtype: str, context: int | None = None,
                cache: dict | None = None, quantize: str = "") -> list[BlockCost]:
    """Each block of ``stacks`` (in order) as a node holds it in ``dtype``: its weight bytes from the
    safetensors headers, and for a language model its cache at ``context`` tokens (default
    ``DEFAULT_CONTEXT``, at most the model's longest). ``cache``: where the caller keeps what was read, so
    that planning the same model again reads nothing (a client's ``Heard.costs``). ``quantize``: the mode the
    nodes hold the blocks in (``diffuse.plan.quantize``): each linear weight the mode quantizes is counted as
    it is stored then (int4 as a CPU node stores it, the larger of its two layouts)."""
    from diffuse.plan.encoders import encoder_stacks
    from diffuse.plan.modelfiles import located, renamed_for
    from diffuse.plan.quantize import INT4_GROUP_CPU, library_rule, quantizable, weight_bytes

    from diffuse.plan.bnbread import part_bytes
    from diffuse.plan.prequant import no_quantize_over_quantized

    no_quantize_over_quantized(subject, quantize)  # quantized already: counted as the files hold it
    key = (subject.path, subject.denoiser, dtype, context, tuple((s.path, s.length) for s in stacks), quantize)
    if cache is not None and key in cache:
        return cache[key]
    size = _dtype_size(dtype)
    skeleton = subject.meta_denoiser()
    # every component holding stacks, each name led by its component's where there are several
    wmap = located(renamed_for(subject.weight_map(), skeleton), skeleton, [s.path for s in stacks])
    headers: dict[str, dict] = {}
    per_token = cache_bytes_per_token(subject, size)
    state = per_token * context_tokens(subject, context)
    head = _head_bytes(subject, skeleton, size)
    group, skip = (INT4_GROUP_CPU if quantize == "int4" else 0), (library_rule(skeleton) if quantize else ())
    saved = subject.denoiser_config.get("quantization_config")
    bnb = isinstance(saved, dict) and saved.get("quant_method") == "bitsandbytes"

    def header_of(key: str):
        if wmap[key] not in headers:
            headers[wmap[key]] = _header(wmap[key])
        return headers[wmap[key]].get(wmap.source(key))
    out = []
    once = set(encoder_stacks(stacks, subject))  # an encoder's layers run once a request
    for st in stacks:
        blocks = skeleton.get_submodule(st.path)
        for i in range(st.length):
            total = 0
            squeezed = {f"{n}.weight" for n, _ in quantizable(blocks[i], f"{st.path}.{i}.", quantize, group, skip)} \
                if quantize else set()
            for name, t in blocks[i].state_dict().items():
                full = f"{st.path}.{i}.{name}"
                file = wmap.get(full)
                if file is None:
                    raise DiffuseError(f"the weights lack {full}, which the model declares")
                if file not in headers:
                    headers[file] = _header(file)
                h = headers[file].get(wmap.source(full))
                if not isinstance(h, dict):
                    raise DiffuseError(f"{file} has no tensor {wmap.source(full)}")
                numel = math.prod(h.get("shape") or [])
                own = _SIZES.get(h.get("dtype"), 4)
                floating = str(h.get("dtype", "")).startswith(("F", "BF")) and t.is_floating_point()
                if name in squeezed:
                    total += weight_bytes(quantize, h.get("shape") or [], size, group or INT4_GROUP_CPU)
                elif "nbytes" in h and h.get("dtype") not in ("F32", "F16"):  # GGUF-quantized: held as stored
                    total += int(h["nbytes"])
                else:
                    total += numel * (size if floating else own)
                if bnb and name.endswith(".weight"):  # saved by bitsandbytes: its scales and state beside it
                    total += part_bytes(full, wmap, header_of)
            out.append(BlockCost(st.path, i, total, state, once=st.path in once))
    if out and head:
        out[-1] = dataclasses.replace(out[-1], end_bytes=out[-1].end_bytes + head, end_compute=head)
    if cache is not None:
        cache[key] = out
    return out


def _head_bytes(subject, skeleton, size: int) -> int:
    """A language model's output head in bytes (the last node holds it); 0 for other models. Counted on the
    weightless skeleton. (The embedding table stays on the client unless a run puts it on the first node,
    which is not counted.)"""
    if not subject.autoregressive:
        return 0
    try:
        head = skeleton.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return 0
    if head is None:
        return 0
    return sum(p.numel() * (size if p.is_floating_point() else p.element_size()) for p in head.parameters())


def pass_bytes(plan: SlicingPlan, subject, dtype: str) -> int:
    """The bytes one pass hands from end to end: the first stack's streams as its first call carried them
    (where the plan has learnt it), a language model's hidden state of one token, else 0 (not known yet)."""
    first = plan.stacks[0].path if plan.stacks else None
    cp, rm = plan.call_plans.get(first), plan.return_maps.get(first)
    if cp is not None and rm is not None:
        total = 0
        for i in rm.streams:
            if i < len(cp.tensors):
                spec = cp.tensors[i]
                total += math.prod(spec.shape) * _dtype_size(spec.dtype.removeprefix("torch."))
        return total
    if subject.autoregressive:
        cfg = subject.denoiser_config
        cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
        hidden = cfg.get("hidden_size")
        return int(hidden) * _dtype_size(dtype) if isinstance(hidden, int) and hidden > 0 else 0
    return 0


def per_pass(subject) -> str:
    """The speed a route of ``subject`` is planned with: per decoding token, or per pass as they came."""
    return "single" if subject.autoregressive else "pass"


GIB = 1 << 30
