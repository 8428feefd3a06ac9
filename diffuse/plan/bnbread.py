"""Transformers checkpoints saved quantized by bitsandbytes, read as they are.

A model loaded with ``BitsAndBytesConfig`` and saved by ``save_pretrained`` keeps each quantized linear layer's
weight under the weight's own name, packed, beside the parts bitsandbytes rebuilds it from:

- 4-bit (nf4, fp4): ``weight`` holds two weights a byte, shaped ``((out * in + 1) // 2, 1)`` in the storage
  dtype (uint8 unless ``bnb_4bit_quant_storage`` names another); ``weight.absmax`` (a scale per block),
  ``weight.quant_map`` (the 16 levels), with double quantization ``weight.nested_absmax`` and
  ``weight.nested_quant_map``, and ``weight.quant_state.bitsandbytes__nf4`` (or ``__fp4``: the rest of the state,
  the weight's shape among it, as JSON in bytes);
- 8-bit (LLM.int8): ``weight`` in int8, shaped as the weight, and ``SCB`` (a scale a row) and ``weight_format``.

As it loads, transformers swaps every such ``nn.Linear`` for bitsandbytes' ``Linear4bit`` or ``Linear8bitLt``
(``replace_with_bnb_linear``, from the config's ``quantization_config``) and rebuilds each weight from its parts
(``Params4bit.from_prequantized``; ``Int8Params`` given its ``SCB``). A node does both, with those same functions,
for the layers of its own blocks only, reading only their parts (``swapped`` before ``load_into``, ``rebuild``
after); the client loads the model with ``from_pretrained``, which reads the ``quantization_config`` itself.

An LLM.int8 layer with an outlier threshold (8-bit's default, 6) takes every input column in which any row of
the call exceeds it out of the int8 product, so one row's output changes with the other rows' values: a node
never runs passes of several sessions through such layers as one batch (``rows_depend``). 4-bit layers keep
each row apart as plain layers do, and batch as they do.
"""

from __future__ import annotations

import importlib.util
import math
from contextlib import contextmanager

from diffuse.errors import DiffuseError

EXTRA = "pip install 'diffuse[bnb]'"


def needs_bnb(folder: str) -> None:
    """A checkpoint saved by bitsandbytes needs bitsandbytes here: refused in one line naming the extra where it
    is not installed; and one saved with ``llm_int8_has_fp16_weight`` (its weights kept in 16 bits, quantized
    at every call: a training setting) is refused, not read as plain."""
    import json
    import os

    if importlib.util.find_spec("bitsandbytes") is None:
        raise DiffuseError(f"{folder} is a checkpoint quantized by bitsandbytes, which is not installed: {EXTRA}")
    with open(os.path.join(folder, "config.json")) as f:
        q = json.load(f).get("quantization_config") or {}
    if q.get("load_in_8bit") and q.get("llm_int8_has_fp16_weight"):
        raise DiffuseError(f"{folder} is saved by bitsandbytes with llm_int8_has_fp16_weight (16-bit weights "
                           "quantized at every call, for training); Diffuse reads 8-bit checkpoints saved in int8")


def bnb_config(quantization_config: dict):
    """The config's ``quantization_config`` as transformers reads it (``AutoQuantizationConfig``)."""
    from transformers.quantizers.auto import AutoQuantizationConfig

    return AutoQuantizationConfig.from_dict(dict(quantization_config))


def weight_parts(four_bit: bool) -> tuple[str, ...]:
    """The parts a quantized layer is saved as besides its ``weight``, relative to the layer, as transformers'
    bitsandbytes quantizer names them (``serialized_names``)."""
    if four_bit:
        from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer as Quantizer
    else:
        from transformers.quantizers.quantizer_bnb_8bit import Bnb8BitHfQuantizer as Quantizer
    return tuple(p for p in Quantizer.serialized_names["weight"] if p != "weight")


def _state_key(config) -> tuple[str, ...]:
    """The parts whose presence says a layer was saved quantized: 4-bit its packed state, 8-bit its scales."""
    return ("weight.quant_state.bitsandbytes__nf4", "weight.quant_state.bitsandbytes__fp4") if config.load_in_4bit \
        else ("SCB",)


def _linears(block) -> dict:
    """{name: module} of ``block``'s layers transformers swaps for bitsandbytes' own: plain ``nn.Linear`` and
    GPT-2's ``Conv1D``."""
    import torch
    from transformers.pytorch_utils import Conv1D

    return {name: m for name, m in block.named_modules() if type(m) is torch.nn.Linear or isinstance(m, Conv1D)}


def saved_layers(block, prefix: str, wmap, config) -> list[str]:
    """The linear layers of ``block`` (at ``prefix`` in its model) whose parts the checkpoint holds."""
    marks = _state_key(config)
    return [name for name in _linears(block) if any(f"{prefix}{name}.{m}" in wmap for m in marks)]


def swapped(block, prefix: str, wmap, quantization_config: dict):
    """Before ``load_into``: each linear layer of ``block`` saved quantized swapped for bitsandbytes' own module,
    weightless, by transformers' ``replace_with_bnb_linear`` (as ``from_pretrained`` swaps it); the others
    left as they are. For ``load_into``'s ``skip``: the swapped layers' weights (``rebuild`` makes them), or None
    where the block holds none."""
    config = bnb_config(quantization_config)
    layers = saved_layers(block, prefix, wmap, config)
    if not layers:
        return None
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    others = [name for name in _linears(block) if name not in layers]
    replace_with_bnb_linear(block, modules_to_not_convert=others or None, quantization_config=config,
                            pre_quantized=True)
    weights = {f"{name}.weight" for name in layers}
    return lambda name: name in weights


def rebuild(block, prefix: str, wmap, files: dict | None = None) -> int:
    """After ``load_into``: each weight ``swapped`` left weightless rebuilt from its saved parts as transformers'
    bitsandbytes loader rebuilds it (``Params4bit.from_prequantized``; ``Int8Params`` given its ``SCB``),
    reading those parts only; how many."""
    todo = [(name, m) for name, m in block.named_modules()
            if type(m).__module__.startswith("bitsandbytes") and getattr(m, "weight", None) is not None
            and m.weight.device.type == "meta"]
    if not todo:
        return 0
    import bitsandbytes as bnb
    from safetensors import safe_open

    files = {} if files is None else files

    def read(key: str):
        if key not in wmap:
            raise DiffuseError(f"the checkpoint has no {key}, a part of a layer saved quantized by bitsandbytes")
        if ("bnb", wmap[key]) not in files:
            files[("bnb", wmap[key])] = safe_open(wmap[key], "pt")
        source = wmap.source(key) if hasattr(wmap, "source") else key
        return files[("bnb", wmap[key])].get_tensor(source)

    for name, module in todo:
        layer = f"{prefix}{name}."
        weight = read(layer + "weight")
        if isinstance(module, bnb.nn.Linear4bit):
            stats = {p: read(layer + p) for p in weight_parts(True) if layer + p in wmap}  # (nested: double)
            module.weight = bnb.nn.Params4bit.from_prequantized(data=weight, quantized_stats=stats,
                                                                requires_grad=False, device=weight.device,
                                                                module=module)
        else:
            kwargs = dict(module.weight.__dict__, SCB=read(layer + "SCB"))
            module.weight = bnb.nn.Int8Params(weight, requires_grad=False, **kwargs).to(weight.device)
    return len(todo)


def packed_shape(want: tuple, quantization_config: dict) -> tuple:
    """The shape a 4-bit checkpoint stores a linear weight of shape ``want`` in (bitsandbytes' packing: two
    weights a byte, in the storage dtype); ``want`` itself for 8-bit."""
    config = bnb_config(quantization_config)
    if not config.load_in_4bit:
        return tuple(want)
    import torch

    storage = config.bnb_4bit_quant_storage
    storage = getattr(torch, storage) if isinstance(storage, str) else storage
    per = 2 * torch.empty((), dtype=storage).element_size()
    return ((math.prod(want) + 1) // per, 1)


def stored_fits(block, name: str, full: str, wmap, quantization_config: dict | None):
    """For the weights check: the shape the checkpoint may hold ``block``'s tensor ``name`` (``full`` in the
    model) in, where it is a linear weight saved quantized by bitsandbytes; None otherwise."""
    if not quantization_config or quantization_config.get("quant_method") != "bitsandbytes" \
            or not name.endswith(".weight"):
        return None
    config = bnb_config(quantization_config)
    layer = name[: -len(".weight")]
    if layer not in _linears(block) or not any(f"{full[: -len('weight')]}{m}" in wmap for m in _state_key(config)):
        return None
    import torch

    module = block.get_submodule(layer)
    shape = tuple(module.weight.shape)  # bitsandbytes stores it as nn.Linear holds it; GPT-2's Conv1D, transposed
    return packed_shape(shape if isinstance(module, torch.nn.Linear) else shape[::-1], quantization_config)


def part_bytes(full: str, wmap, header_of) -> int:
    """Bytes of the parts saved beside the quantized weight ``full`` (its scales and state), from the headers
    (``header_of(key)``: the safetensors header entry of ``key``, or None); 0 for a weight saved plain."""
    layer = full[: -len("weight")]
    total = 0
    for part in {*weight_parts(True), *weight_parts(False)}:
        h = header_of(layer + part) if layer + part in wmap else None
        if isinstance(h, dict) and "data_offsets" in h:
            a, b = h["data_offsets"]
            total += int(b) - int(a)
    return total


def rows_depend_config(config) -> bool:
    """Does a model's config (its ``quantization_config``: a dict, or transformers' config object after a load)
    say its linear layers are bitsandbytes' LLM.int8 with an outlier threshold (``rows_depend``)?"""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return False
    get = q.get if isinstance(q, dict) else lambda key, default=None: getattr(q, key, default)
    threshold = get("llm_int8_threshold", 6.0)
    return get("quant_method") == "bitsandbytes" and bool(get("load_in_8bit")) and float(threshold or 0) > 0


def rows_depend(blocks) -> bool:
    """Do any of ``blocks`` (modules) hold an LLM.int8 layer of bitsandbytes' with an outlier threshold, whose
    output for one row changes with the other rows of its call?"""
    return any(type(m).__name__ == "Linear8bitLt" and type(m).__module__.startswith("bitsandbytes")
               and getattr(getattr(m, "state", None), "threshold", 0) > 0 for b in blocks for m in b.modules())


def release_to_meta(module) -> None:
    """``module`` moved to meta (a block the client hands to a node), bitsandbytes' quantized weights included:
    ``Module.to`` cannot rebuild those there, so each is first replaced by a plain weightless parameter of its
    shape and dtype (and a 4-bit layer's own reference to its state dropped)."""
    import torch

    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None and type(p).__module__.startswith("bitsandbytes"):
                sub._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                           requires_grad=False)
                if getattr(sub, "quant_state", None) is not None:
                    sub.quant_state = None
    module.to("meta")


@contextmanager
def plain_linears(module):
    """While inside: each linear layer of bitsandbytes' in ``module`` swapped for a weightless plain ``nn.Linear``
    of its shape, so that a run on stand-in weights (the return-map learner's zeros, a meta run) sees the
    layer's shapes and no packed weight or quantization state; put back on leaving."""
    import torch

    done = []
    for name, m in list(module.named_modules()):
        if name and isinstance(m, torch.nn.Linear) and type(m).__module__.startswith("bitsandbytes"):
            module.set_submodule(name, torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None,
                                                       device="meta"))
            done.append((name, m))
    try:
        yield module
    finally:
        for name, m in done:
            module.set_submodule(name, m)
