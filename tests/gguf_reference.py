"""Ground truth for GGUF denoisers: a pipeline run whole by plain diffusers, its denoiser loaded from a GGUF file
by diffusers' own single-file loader and GGUF quantizer.

    python tests/gguf_reference.py --model PIPELINE_DIR --gguf FILE --component transformer --dtype float32
        --kwargs JSON --seed S --threads N --out OUT.npy [--plain-model DIR --plain-out PLAIN.npy]

The component is loaded by its own class, ``from_single_file(FILE, quantization_config=
GGUFQuantizationConfig(compute_dtype=D), torch_dtype=D, config=PIPELINE_DIR, subfolder=COMPONENT)``, and handed to
``DiffusionPipeline.from_pretrained(PIPELINE_DIR)``; the call and what is saved are ``reference.py``'s. Imports
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
    ap.add_argument("--dtype", default="float32", help="the GGUF quantizer's compute dtype and the load's torch_dtype")
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
    dtype = getattr(torch, args.dtype)
    part = cls.from_single_file(args.gguf, quantization_config=GGUFQuantizationConfig(compute_dtype=dtype),
                                torch_dtype=dtype, config=args.model, subfolder=args.component)
    np.save(args.out, run(DiffusionPipeline.from_pretrained(args.model, **{args.component: part}), args))
    if args.plain_model:
        np.save(args.plain_out, run(DiffusionPipeline.from_pretrained(args.plain_model), args))
    return 0


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
