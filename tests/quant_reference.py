"""Ground truth for quantized runs: a saved model run whole by plain diffusers or transformers, loaded with
torchao's weight-only quantization through the library's own ``TorchAoConfig``.

    python tests/quant_reference.py --mode int8|int4|fp8 --only PREFIX [--only PREFIX]... --threads N
        --model PIPELINE_DIR --component NAME [--component NAME] --kwargs JSON --seed S --out OUT.npy
        --model LM_DIR --prompt TEXT --max-new-tokens N --out OUT.json

The linear layers quantized are those whose names start with an ``--only`` prefix (the block stacks, as a split
run's nodes hold them): every other linear layer of the model is named in ``modules_to_not_convert``. A
pipeline's ``--component`` is loaded by its own class with the config and handed to
``DiffusionPipeline.from_pretrained``; the run and what is saved are ``reference.py``'s. A language model is
loaded by ``AutoModelForCausalLM`` in float32 with sdpa, as ``lm_reference.py`` loads it, with the config, and its greedy answer written as
``lm_reference.py`` writes it.

The libraries match ``modules_to_not_convert`` by substring (a name followed by a dot anywhere in a weight's
name), so a block layer that shares its name with a layer outside the blocks (Flux's single blocks' ``proj_out``
beside the model's own) is left unquantized by that list. Such layers are quantized after the load with torchao's
own ``quantize_`` and the same config (``leftover``): the reference quantizes exactly the blocks' linear layers, as
the nodes do.

Each mode's config is written out here, from torchao's documentation, not taken from ``diffuse``: the reference
cannot share a bug with what it checks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def torchao_config(mode: str):
    import torchao.quantization as q
    from torchao.quantization.granularity import PerGroup

    return {"int8": lambda: q.Int8WeightOnlyConfig(), "fp8": lambda: q.Float8WeightOnlyConfig(),
            "int4": lambda: q.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))}[mode]()


GROUP = {"int4": 32}  # int4's groups of 32 input features: a layer narrower or not a multiple stays unquantized


def outside(model, only: list[str], mode: str) -> list[str]:
    """Every linear layer of ``model`` not under one of the ``only`` prefixes, and those ``mode``'s groups cannot
    cut (the rule Diffuse documents for int4)."""
    group = GROUP.get(mode, 0)
    return [n for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and (not any(n.startswith(p) for p in only)
                                                   or (group and m.in_features % group))]


def leftover(model, only: list[str], mode: str) -> int:
    """Quantize the linear layers under the ``only`` prefixes that the load left plain (see above); how many."""
    from torchao.quantization import quantize_

    group = GROUP.get(mode, 0)
    plain = [m for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and any(n.startswith(p) for p in only) and type(m.weight) is
             torch.nn.Parameter and type(m.weight.data) is torch.Tensor and not (group and m.in_features % group)]
    for m in plain:
        quantize_(m, torchao_config(mode))
    return len(plain)


def pipeline_run(args) -> None:
    import diffusers
    import transformers
    from diffusers import DiffusionPipeline

    from reference import import_component_libraries

    import_component_libraries(args.model)
    only = [""] if args.everything else args.only  # --everything: every linear layer of it (as its groups allow)
    parts = {}
    for component in args.component:  # each denoiser (two where the pipeline has two experts), each text encoder
        with open(os.path.join(args.model, component, "config.json")) as f:
            config = json.load(f)
        library = diffusers if "_class_name" in config else transformers  # (a transformers model names its class
        cls = getattr(library, config.get("_class_name") or config["architectures"][0])  # in architectures)
        folder = os.path.join(args.model, component)
        skip = outside(cls.from_pretrained(folder), only, args.mode)
        parts[component] = cls.from_pretrained(folder, torch_dtype=torch.float32, quantization_config=library.TorchAoConfig(
            torchao_config(args.mode), modules_to_not_convert=skip))  # float32, as a plain load (torchao's: bf16)
        if not args.everything:  # (with nothing named outside, no block layer is skipped by name; what is left
            leftover(parts[component], only, args.mode)  # plain then is what the library keeps in float32, as
    pipe = DiffusionPipeline.from_pretrained(args.model)  # Diffuse's client does)
    pipe.register_modules(**parts)
    if args.everything:  # --quantize-client: every other model of the pipeline loaded with the same mode
        pipe.register_modules(**everything_else(args, pipe))
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        out = pipe(**json.loads(args.kwargs), generator=torch.Generator("cpu").manual_seed(args.seed),
                   output_type="np")
    array = out[0].cpu().numpy() if isinstance(out[0], torch.Tensor) else np.asarray(out[0])
    np.save(args.out, array)


def everything_else(args, pipe) -> dict:
    """Every component but the ``args.component`` ones that its library loads from a folder, loaded again by that library
    with ``TorchAoConfig(<the mode's config>)`` and nothing excluded (the library leaves out what it always leaves
    out: the modules a model keeps in float32), in float32 as the plain load. (The split component is then loaded
    with every linear layer quantized, its ends too, which a split run's client holds.)"""
    import diffusers
    import transformers

    with open(os.path.join(args.model, "model_index.json")) as f:
        index = json.load(f)
    out = {}
    for name, value in index.items():
        part = getattr(pipe, name, None)
        if name.startswith("_") or name in args.component or not isinstance(part, torch.nn.Module):
            continue
        library = transformers if value[0] == "transformers" else diffusers
        config = library.TorchAoConfig(torchao_config(args.mode))
        out[name] = type(part).from_pretrained(os.path.join(args.model, name), torch_dtype=torch.float32,
                                               quantization_config=config)
    return out


def lm_run(args) -> None:
    import lm_reference
    from transformers import AutoModelForCausalLM, TorchAoConfig

    def quantized(model_dir, dtype="float32", device=None):
        plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa")
        config = TorchAoConfig(torchao_config(args.mode), modules_to_not_convert=outside(plain, args.only, args.mode))
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa",
                                                     quantization_config=config).eval()
        leftover(model, args.only, args.mode)
        return model

    lm_reference.load_model = quantized  # the inputs, the call and what is written stay lm_reference.py's
    result = lm_reference.run(args.model, args.prompt, max_new_tokens=args.max_new_tokens, threads=args.threads)
    with open(args.out, "w") as f:
        json.dump(result, f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", required=True, choices=("int8", "int4", "fp8"))
    ap.add_argument("--only", action="append", required=True, help="a prefix of the linear layers to quantize")
    ap.add_argument("--model", required=True)
    ap.add_argument("--component", action="append", help="a pipeline's component to quantize (a pipeline run; "
                    "repeated for each denoiser of a pipeline with several)")
    ap.add_argument("--kwargs", default="{}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt", help="a language model's prompt (a language-model run)")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--everything", action="store_true", help="a pipeline's other components quantized too, and "
                    "the split component's linear layers outside the blocks (a client run with --quantize-client)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.component:
        pipeline_run(args)
    else:
        lm_run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
