"""Weight-only quantization of what a node holds: the modes, the library that runs each, and what it costs.

A mode (``--quantize``) turns the weight of every ``nn.Linear`` inside a node's blocks
into the quantized tensor a maintained library makes of it, as the block loads; no
kernel here is Diffuse's own. Everything else (norms, embeddings, a language model's
output head, the client's ends) stays in the compute dtype, and so do the modules the
model keeps in float32 (``_keep_in_fp32_modules``), as the libraries' own quantizers
leave them. The result equals plain diffusers or transformers loading the same model
with ``TorchAoConfig(<the mode's config>, modules_to_not_convert=<everything outside
the blocks>)``, tensor for tensor: each weight is quantized on its own, from the same
values, by the same call. (The libraries match that list by substring, so a block layer
named like one outside the blocks, Flux's single blocks' ``proj_out``, would stay plain
there; Diffuse quantizes it, as torchao's ``quantize_`` on that layer does.)

=======  ===========================================  ======================================
mode     torchao config (CPU; CUDA)                   stored per weight of shape (out, in)
=======  ===========================================  ======================================
int8     ``Int8WeightOnlyConfig`` (per row)           out*in int8, a float32 scale and an
                                                      int8 zero point a row
int4     CPU: ``IntxWeightOnlyConfig(int4, groups of  CPU: out*in int8 (torchao has no packed
         32)``; CUDA in bfloat16:                     int4 CPU kernel on x86), a scale in the
         ``Int4WeightOnlyConfig`` (tile-packed)       compute dtype and an int8 zero point per
                                                      32; CUDA: out*in/2 bytes and per-128
                                                      scales and zero points
fp8      ``Float8WeightOnlyConfig`` (e4m3, per row)   out*in float8, a float32 scale a row
=======  ===========================================  ======================================

int4's groups need a layer's ``in_features`` to be a multiple of the group: a layer that
is not stays unquantized (``quantizable``).
"""

from __future__ import annotations

import math

from diffuse.errors import DiffuseError

MODES = ("int8", "int4", "fp8")
EXTRA = "pip install 'diffuse[quant]'"
INT4_GROUP_CPU, INT4_GROUP_CUDA = 32, 128


def check_mode(mode: str | None, device=None) -> str:
    """``mode`` as a node and a stage plan carry it ("" for none), refused in one line when unknown, when its
    library is not installed, or when ``device`` cannot run it."""
    if mode in (None, "", "none"):
        return ""
    if mode not in MODES:
        raise DiffuseError(f"--quantize {str(mode)[:32]}: unknown mode; choose {', '.join(MODES)} or none")
    try:
        import torchao  # noqa: F401
    except ImportError:
        raise DiffuseError(f"--quantize {mode} needs torchao, which is not installed: {EXTRA}") from None
    kind = getattr(device, "type", str(device or "cpu").split(":")[0])
    if kind not in ("cpu", "cuda"):
        raise DiffuseError(f"--quantize {mode}: torchao's weight-only kernels run on the CPU and CUDA, not on "
                           f"{kind}; run without --quantize there")
    if mode == "fp8" and kind == "cuda":
        import torch

        if torch.cuda.get_device_capability(device) < (8, 9):
            raise DiffuseError("--quantize fp8 needs a CUDA device of compute capability 8.9 or later (Ada, Hopper); "
                               "this one is older: use int8")
    return mode


def torchao_config(mode: str, device, dtype):
    """The torchao config ``mode`` names on ``device`` for weights computed in ``dtype``."""
    import torch
    import torchao.quantization as q

    if mode == "int8":
        return q.Int8WeightOnlyConfig()
    if mode == "fp8":
        return q.Float8WeightOnlyConfig()
    if _packed_int4(device, dtype):
        return q.Int4WeightOnlyConfig(group_size=INT4_GROUP_CUDA, int4_packing_format="tile_packed_to_4d")
    from torchao.quantization.granularity import PerGroup

    return q.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(INT4_GROUP_CPU))


def _packed_int4(device, dtype) -> bool:
    import torch

    return getattr(device, "type", str(device)) == "cuda" and dtype == torch.bfloat16


def group_of(mode: str, device, dtype) -> int:
    """The number of input features a scale covers (0: one scale a row)."""
    if mode != "int4":
        return 0
    return INT4_GROUP_CUDA if _packed_int4(device, dtype) else INT4_GROUP_CPU


def not_converted(model_class) -> tuple[str, ...]:
    """The module names the libraries' quantizers leave unquantized: the model's float32-kept modules."""
    return tuple(getattr(model_class, "_keep_in_fp32_modules", None) or ())


def skipped(full_name: str, skip: tuple[str, ...]) -> bool:
    """Whether the weight ``full_name`` (``blocks.0.attn.to_q.weight``) is left alone, by the rule diffusers'
    torchao quantizer applies to ``modules_to_not_convert``: a name that appears in it followed by a dot, or is it."""
    return any(k + "." in full_name or k == full_name for k in skip)


def quantizable(module, prefix: str, mode: str, group: int, skip=()) -> list[tuple[str, object]]:
    """(name, Linear) for each linear layer of ``module`` (at ``prefix`` in its model) ``mode`` quantizes.
    ``skip``: the weights left alone, as names (``skipped``) or as a rule (``library_rule``)."""
    import torch

    left_alone = skip if callable(skip) else (lambda full: skipped(full, skip))
    out = []
    for name, sub in module.named_modules():
        if not isinstance(sub, torch.nn.Linear) or left_alone(f"{prefix}{name}.weight"):
            continue
        if group and sub.in_features % group:
            continue
        out.append((name, sub))
    return out


def quantize(module, prefix: str, mode: str, device, dtype, skip=()) -> int:
    """Quantize ``module``'s linear layers in place with torchao, as its weights are (on their device, in
    ``dtype``); returns how many were quantized."""
    if not mode:
        return 0
    from torchao.quantization import quantize_

    config = torchao_config(mode, device, dtype)
    layers = quantizable(module, prefix, mode, group_of(mode, device, dtype), skip)
    for _, layer in layers:
        quantize_(layer, config)
    return len(layers)


def off_the_file(module) -> None:
    """Give ``module``'s plain tensors (norms, biases: what a mode left unquantized) storage of their own, equal
    to the bit and laid out alike. Read from a safetensors file, they are views of its mapping, and one such view
    keeps every page of the file read so far resident: after quantizing, that is the whole unquantized slice."""
    import torch

    with torch.no_grad():
        for sub in module.modules():
            for name, t in list(sub._parameters.items()) + list(sub._buffers.items()):
                if t is None or type(getattr(t, "data", t)) is not torch.Tensor or t.device.type != "cpu":
                    continue
                t.data = t.data.clone()


def large_from_system(nbytes: int) -> None:
    """Serve allocations of ``nbytes`` and up from the system page by page, returned when freed, in this
    process (glibc's ``M_MMAP_THRESHOLD``). A quantizing node sets 1 MiB while it loads: by default the threshold
    rises to 32 MiB as large blocks are freed, and the float32 working copies quantizing makes of each weight
    then stay as holes in the heap, the node's peak a fifth above what it holds. After loading it sets 32 MiB,
    where the default would have risen to, so that passes allocate as they would have."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, int(nbytes))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def release_freed() -> None:
    """Hand the memory freed while loading back to the system where the C library keeps it (glibc's
    ``malloc_trim``): quantizing block by block frees each block's unquantized weights, in pieces too
    small to be returned on their own."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def within(stacks, component: str, several: bool) -> list[str]:
    """The paths of ``stacks`` (``StackPlan``s) inside a pipeline's ``component``, as that module names them. With
    several denoisers a plan names each stack from its component (``transformer_2.blocks``); with one, from the
    denoiser itself (``blocks``); a language model's ``component`` is "" (the model)."""
    if not several:
        return [s.path for s in stacks]
    prefix = f"{component}."
    return [s.path[len(prefix):] for s in stacks if s.path.startswith(prefix)]


def quantize_blocks(model, paths: list[str], mode: str, skip=None) -> int:
    """Every block of the stacks at ``paths`` in ``model`` quantized as a node holding it quantizes it: a whole run
    in the mode a split run's nodes hold (``--whole --quantize``)."""
    if not mode:
        return 0
    skip = library_rule(model) if skip is None else skip
    done = 0
    for path in paths:
        for i, block in enumerate(model.get_submodule(path)):
            p = next(block.parameters(), None)
            if p is None or p.device.type == "meta":
                continue
            done += quantize(block, f"{path}.{i}.", mode, p.device, p.dtype, skip)
    return done


def weight_bytes(mode: str, shape, itemsize: int, group: int = INT4_GROUP_CPU, packed: bool = False) -> int:
    """What a linear weight of ``shape`` (out, in) takes stored under ``mode`` (its compute dtype's element
    size ``itemsize``), as the table above says; the plain size when ``mode`` is "" or it stays unquantized."""
    out, inp = (int(shape[0]), int(math.prod(shape[1:]))) if len(shape) >= 2 else (0, 0)
    if not mode or not out:
        return int(math.prod(shape)) * itemsize
    if mode == "int8":
        return out * inp + out * 5
    if mode == "fp8":
        return out * inp + out * 4
    if inp % group:
        return out * inp * itemsize
    if packed:
        return out * inp // 2 + (out * inp // group) * 4
    return out * inp + (out * inp // group) * (itemsize + 1)


def tensor_bytes(t) -> int:
    """Bytes ``t`` takes where it is, a quantized weight counted by the tensors it is made of."""
    inner = getattr(t, "__tensor_flatten__", None)
    if inner is not None and type(t).__name__ not in ("Parameter", "Tensor"):
        return sum(tensor_bytes(getattr(t, n)) for n in inner()[0] if getattr(t, n, None) is not None)
    data = getattr(t, "data", t)
    if data is not t and getattr(data, "__tensor_flatten__", None) is not None and type(data).__name__ != "Tensor":
        return tensor_bytes(data)
    return t.numel() * t.element_size()


def quantize_ends(pipe_or_model, stacks, mode: str, denoisers: tuple[str, ...] = (), several: bool = False) -> int:
    """``--quantize-client``: every linear layer the client holds quantized in ``mode``: a pipeline's text
    encoders and other components, and the denoisers' own ends (all but their block stacks, ``stacks``, which
    nodes hold; ``several``: the plan names them from their components, ``within``); a language model's media
    towers and projections, but not its output head, which the last node holds and reads from the files. What
    each module's library leaves alone stays as it is. Returns how many."""
    import torch

    if not mode:
        return 0
    parts = (list(pipe_or_model.components.items()) if hasattr(pipe_or_model, "components")
             else [("", pipe_or_model)])
    done = 0
    for name, part in parts:
        if not isinstance(part, torch.nn.Module):
            continue
        inside = tuple(f"{p}." for p in within(stacks, name, several)) if (not name or name in denoisers) else ()
        head = _head_of(part) if not name else None
        left_alone = library_rule(part)
        for sub_name, sub in list(part.named_modules()):
            if (not isinstance(sub, torch.nn.Linear) or sub is head or f"{sub_name}.".startswith(inside or ("\0",))
                    or left_alone(f"{sub_name}.weight") or sub.weight.device.type == "meta"
                    or not sub.weight.is_floating_point()):  # quantized already (a GGUF denoiser's layers)
                continue
            group = group_of(mode, sub.weight.device, sub.weight.dtype)
            if group and sub.in_features % group:
                continue
            done += quantize(sub, f"{sub_name}.", mode, sub.weight.device, sub.weight.dtype)
    return done


def library_rule(part):
    """Which weights of ``part`` its library's torchao quantizer leaves alone, by that library's own rule: for a
    transformers model, transformers' list (``get_modules_to_not_convert``: what it always skips, and the modules
    kept in float32) matched by transformers' ``should_convert_module``; for anything else, diffusers' (the
    modules kept in float32, matched as ``skipped`` matches)."""
    try:
        from transformers import PreTrainedModel
        from transformers.quantizers.base import HfQuantizer
        from transformers.quantizers.quantizers_utils import should_convert_module
    except ImportError:
        PreTrainedModel = None
    if PreTrainedModel is not None and isinstance(part, PreTrainedModel):
        keep = getattr(part, "_keep_in_fp32_modules", None)
        patterns = HfQuantizer.get_modules_to_not_convert(part, None, list(keep) if keep else None)
        return lambda name: not should_convert_module(name, patterns)
    skip = not_converted(type(part))
    return lambda name: skipped(name, skip)


def _head_of(model):
    try:
        return model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
