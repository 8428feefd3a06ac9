"""Ground truth for GGUF denoisers: a pipeline run whole by plain diffusers, its denoiser loaded from a GGUF file
by diffusers' own single-file loader and GGUF quantizer.

    python tests/gguf_reference.py --model PIPELINE_DIR --gguf FILE --component transformer --dtype float32
        --kwargs JSON --seed S --threads N --out OUT.npy [--plain-model DIR --plain-out PLAIN.npy]

The component is loaded by its own class, ``from_single_file(FILE, quantization_config=
GGUFQuantizationConfig(compute_dtype=D), torch_dtype=D, config=PIPELINE_DIR, subfolder=COMPONENT)`` (diffusers
converts a file in the model's original layout as it loads it), and the pipeline assembled with it
(``assembled``); the call and what is saved are ``reference.py``'s. Imports
nothing of Diffuse's, so the reference cannot share a bug with what it checks. ``--plain-model`` runs that folder's
pipeline too, as saved (unquantized), into ``--plain-out``: what a run that quantized nothing would give.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--gguf", required=True, help="the denoiser's GGUF file")
    ap.add_argument("--component", default="transformer")
    ap.add_argument("--dtype", help="the GGUF quantizer's compute dtype and every component's torch_dtype, as "
                    "DiffusionPipeline.from_pretrained(torch_dtype=...) gives it (default: float32, the rest as saved)")
    ap.add_argument("--kwargs", default="{}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--plain-model", help="a pipeline folder run as saved, too")
    ap.add_argument("--plain-out")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import diffusers
    from diffusers import DiffusionPipeline, GGUFQuantizationConfig

    with open(os.path.join(args.model, args.component, "config.json")) as f:
        cls = getattr(diffusers, json.load(f)["_class_name"])
    dtype = getattr(torch, args.dtype or "float32")
    part = cls.from_single_file(args.gguf, quantization_config=GGUFQuantizationConfig(compute_dtype=dtype),
                                torch_dtype=dtype, config=args.model, subfolder=args.component)
    typed = getattr(torch, args.dtype) if args.dtype else None
    np.save(args.out, run(assembled(args.model, args.component, part, typed), args))
    if args.plain_model:
        np.save(args.plain_out, run(DiffusionPipeline.from_pretrained(args.plain_model), args))
    return 0


def assembled(model_dir: str, component: str, part, dtype=None):
    """The pipeline of ``model_dir`` with ``part`` as its ``component``: every other component loaded by its own
    class from its folder, and the pipeline class called with them and model_index.json's settings, as
    ``DiffusionPipeline.from_pretrained`` does (which would load an optional denoiser from its folder even when
    one is passed: Wan's)."""
    import importlib

    import diffusers

    with open(os.path.join(model_dir, "model_index.json")) as f:
        index = json.load(f)
    parts = {}
    for name, value in index.items():
        if name.startswith("_"):
            continue
        if name == component:
            parts[name] = part
        elif isinstance(value, list) and len(value) == 2:
            cls = None if value[0] is None else getattr(importlib.import_module(value[0]), value[1])
            typed = {} if dtype is None or not hasattr(cls, "dtype") else \
                {"dtype" if value[0] == "transformers" else "torch_dtype": dtype}  # (its library's keyword)
            parts[name] = None if cls is None else cls.from_pretrained(os.path.join(model_dir, name), **typed)
        else:
            parts[name] = value  # a setting of the pipeline's own (Wan 2.2's boundary_ratio, ...)
    return getattr(diffusers, index["_class_name"])(**parts)


def run(pipe, args) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        out = pipe(**json.loads(args.kwargs), generator=torch.Generator("cpu").manual_seed(args.seed),
                   output_type="np")
    array = out[0].cpu().numpy() if isinstance(out[0], torch.Tensor) else np.asarray(out[0])
    if array.dtype != np.float32:
        raise SystemExit(f"gguf_reference: the pipeline returned {array.dtype}, expected float32")
    return array


if __name__ == "__main__":
    sys.exit(main())
