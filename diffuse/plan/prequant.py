"""Transformers checkpoints saved quantized (a ``quantization_config`` in config.json), read as they are.

A torchao-quantized model saved by ``save_pretrained`` keeps each quantized weight as the tensors it is made of
(``mlp.up_proj._weight_qdata``, ``_weight_scale``, ``_weight_zero_point``) and, in the safetensors metadata, how
to put them back together (torchao's own format: the tensor subclass, its settings, its parts). transformers
rebuilds each weight with torchao's ``unflatten_tensor_state_dict`` as it loads; a node does the same for the
weights of its own layers only, reading only their parts. The weight map names each quantized weight after its
``qdata`` part (its shape is the weight's, for the int8 and float8 layouts), so placement and the analyzers'
checks find it; the client loads its ends with transformers' ``from_pretrained``, which reads the config's
``quantization_config`` itself.

A checkpoint saved by bitsandbytes (4-bit nf4/fp4, 8-bit) keeps each quantized weight under its own name, packed,
beside its parts; ``diffuse.plan.bnbread`` swaps a node's linear layers for bitsandbytes' own and rebuilds them
(``saved_quantized`` given the block and the model's config, and ``rebuild_quantized``, call it). A checkpoint
quantized by another method (GPTQ, AWQ, ...) is refused in one line naming it.
"""

from __future__ import annotations

import json
import os

from diffuse.errors import DiffuseError

EXTRA = "pip install 'diffuse[quant]'"


def quant_method(folder: str) -> str:
    """The ``quant_method`` of the ``quantization_config`` in ``folder``'s config.json, "" where there is none."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return ""
    q = config.get("quantization_config") if isinstance(config, dict) else None
    return str(q.get("quant_method") or "unknown") if isinstance(q, dict) else ""


def with_quantized(wmap: dict, folder: str) -> dict:
    """``wmap`` (tensor name -> safetensors file) with each torchao-quantized weight of a saved-quantized
    checkpoint named after its ``qdata`` part (``sources``); refused in one line for other methods."""
    method = quant_method(folder)
    if not method:
        return wmap
    if method == "bitsandbytes":  # each weight under its own name (packed), its parts beside it
        from diffuse.plan.bnbread import needs_bnb

        needs_bnb(folder)
        return wmap
    if method != "torchao":
        raise DiffuseError(f"{folder} is a checkpoint quantized by {method[:32]} (its config.json's "
                           "quantization_config); Diffuse reads checkpoints quantized by torchao or bitsandbytes "
                           "as they are, no other")
    from diffuse.plan.modelfiles import WeightMap

    out = WeightMap(wmap)
    out.sources.update(getattr(wmap, "sources", {}))
    for name, parts in quantized_weights(sorted(set(wmap.values()))).items():
        qdata = next((p for p in parts if p.endswith("_qdata")), None)
        if qdata is None or qdata not in wmap:
            raise DiffuseError(f"{folder}: the quantized weight {name} has no qdata part in the files")
        out[name] = wmap[qdata]
        out.sources[name] = qdata
    return out


def metadata(files) -> dict:
    """The safetensors metadata of ``files``, merged (torchao's: each weight's subclass and its parts)."""
    from safetensors import safe_open

    merged = {}
    for file in files:
        with safe_open(file, "pt") as f:
            merged.update(f.metadata() or {})
    return merged


def quantized_weights(files) -> dict[str, list[str]]:
    """Weight name -> the names of the tensors it is saved as, for every weight torchao's metadata says is a
    tensor subclass (the others are ``{"_type": "Tensor"}``)."""
    out = {}
    for name, value in metadata(files).items():
        try:
            info = json.loads(value)
        except (TypeError, ValueError):
            continue
        if not isinstance(info, dict) or info.get("_type") in (None, "Tensor") or "_tensor_data_names" not in info:
            continue
        layer, _, param = name.rpartition(".")
        out[name] = [f"{layer}._{param}_{part}" for part in info["_tensor_data_names"]]
    return out


def saved_quantized(wmap, prefix: str, block=None, config: dict | None = None):
    """For ``load_into``'s ``skip``: the weights under ``prefix`` saved quantized (rebuilt by ``rebuild_quantized``
    instead), or None where there are none. A checkpoint saved by bitsandbytes (``config``, the model's config,
    says so) has ``block``'s linear layers that it holds quantized swapped for bitsandbytes' own first."""
    q = (config or {}).get("quantization_config")
    if isinstance(q, dict) and q.get("quant_method") == "bitsandbytes" and block is not None:
        from diffuse.plan.bnbread import swapped

        return swapped(block, prefix, wmap, q)
    sources = getattr(wmap, "sources", {})
    if not any(str(v).endswith("_qdata") and k.startswith(prefix) for k, v in sources.items()):
        return None
    return lambda name: str(sources.get(prefix + name, "")).endswith("_qdata")


def rebuild_quantized(module, prefix: str, wmap, files: dict | None = None) -> int:
    """Each torchao-quantized weight of ``module`` (at ``prefix`` in its model) rebuilt from its saved parts by
    torchao's ``unflatten_tensor_state_dict``, as transformers rebuilds it at load, reading those parts only;
    how many. (``load_into`` read each one's ``qdata`` alone in its place.) Layers of bitsandbytes' that
    ``saved_quantized`` swapped in are rebuilt by ``diffuse.plan.bnbread.rebuild``."""
    import torch
    from safetensors import safe_open

    from diffuse.plan.bnbread import rebuild

    sources = getattr(wmap, "sources", {})
    mine = [n for n in module.state_dict() if str(sources.get(prefix + n, "")).endswith("_qdata")]
    if not mine:
        return rebuild(module, prefix, wmap, files)
    try:
        from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict
    except ImportError:
        raise DiffuseError(f"this checkpoint is quantized by torchao, which is not installed: {EXTRA}") from None
    files = {} if files is None else files
    meta = metadata(sorted({wmap[prefix + n] for n in mine}))
    for name in mine:
        full = prefix + name
        layer, _, param = full.rpartition(".")
        info = json.loads(meta[full])
        parts = {f"{layer}._{param}_{p}": None for p in info["_tensor_data_names"]}
        for key in parts:
            if ("prequant", wmap[full]) not in files:
                files[("prequant", wmap[full])] = safe_open(wmap[full], "pt")
            parts[key] = files[("prequant", wmap[full])].get_tensor(key)
        rebuilt, left = unflatten_tensor_state_dict(parts, meta)
        if left or full not in rebuilt:
            raise DiffuseError(f"torchao could not rebuild {full} from its saved parts")
        owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
        owner._parameters[param] = torch.nn.Parameter(rebuilt[full], requires_grad=False)
    return len(mine)


def quantize_modes(subject) -> tuple[str, ...]:
    """The ``--quantize`` modes ("" for none) a node may hold ``subject``'s blocks in: none for a GGUF denoiser
    or a checkpoint saved quantized (held as the files hold them), else every mode."""
    from diffuse.plan.ggufread import gguf_parts
    from diffuse.plan.quantize import MODES

    done = gguf_parts(subject) or any(map(quant_method, subject.component_dirs().values()))  # quantized already
    return ("",) if done else ("", *MODES)


def no_quantize_over_quantized(subject, mode: str) -> None:
    """A GGUF denoiser (``diffuse.plan.ggufread``), or a checkpoint saved quantized, is quantized already:
    ``--quantize`` on top of it is refused in one line."""
    from diffuse.plan.ggufread import gguf_in

    if not mode:
        return
    if any(gguf_in(d) for d in subject.component_dirs().values()):
        raise DiffuseError(f"--quantize {mode}: this model's denoiser is a GGUF file, quantized already; its "
                           "blocks are held as the file holds them: run without --quantize")
    method = next((m for m in map(quant_method, subject.component_dirs().values()) if m), "")
    if method:
        raise DiffuseError(f"--quantize {mode}: this checkpoint is saved quantized already ({method[:32]}); its "
                           "layers are held as it holds them: run without --quantize")
