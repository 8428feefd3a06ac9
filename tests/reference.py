"""Ground truth: run a saved pipeline whole, in plain diffusers, and save its array.

    python tests/reference.py --model DIR --kwargs JSON --seed S --threads N --out OUT.npy

Loads ``DiffusionPipeline.from_pretrained(DIR)``, sets the torch thread count,
calls the pipeline under ``torch.no_grad()`` with the kwargs plus
``generator=torch.Generator("cpu").manual_seed(S)`` and ``output_type="np"``,
and saves the first field of the output (``.images`` / ``.frames`` /
``.audios``) as float32, exactly as returned. Split runs are compared to it byte
for byte.

``--dtype bfloat16`` (or float16, float32) loads with ``torch_dtype`` set to it
and ``--device cuda`` moves the pipeline there (``pipe.to``); the generator stays on
the CPU, as a split run's does.

Repeat ``--out`` to load the model afresh and run again for each file: two
independent runs in one process (cheaper than two processes when checking that
a model is reproducible). ``--jobs FILE`` runs a JSON list of ``{"model",
"kwargs", "seed", "out": [...]}`` in this one process (one start-up for many
models); a job that fails writes its error to ``<first out>.error`` and the
others go on.

Imports only torch, numpy and diffusers, plus any component library that
model_index.json names besides diffusers and transformers (such a library must
be imported before loading; FACTS-diffusers.md, last section). Nothing from the
``diffuse`` package, so the reference cannot share a bug with what it checks.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

import numpy as np
import torch

_BUILTIN_LIBRARIES = {"diffusers", "transformers"}


def _is_diffusers_pipeline_module(name: str) -> bool:
    import diffusers.pipelines

    return hasattr(diffusers.pipelines, name)


def import_component_libraries(model_dir: str) -> list[str]:
    """Import each library model_index.json names that diffusers would not load itself."""
    with open(os.path.join(model_dir, "model_index.json")) as f:
        index = json.load(f)
    imported = []
    for key, value in index.items():
        if key.startswith("_") or not isinstance(value, list) or len(value) != 2:
            continue
        library = value[0]
        if library is None or library in _BUILTIN_LIBRARIES or library in imported:
            continue
        # ["stable_audio", "StableAudioProjectionModel"]: a diffusers pipeline module.
        if _is_diffusers_pipeline_module(library):
            continue
        # A .py shipped in the component folder is remote code, not a library.
        if os.path.isfile(os.path.join(model_dir, key, f"{library}.py")):
            continue
        importlib.import_module(library)
        imported.append(library)
    return imported


def run_once(model_dir: str, kwargs: dict, seed: int, dtype: str | None = None, device: str | None = None) -> np.ndarray:
    from diffusers import DiffusionPipeline

    typed = {"torch_dtype": getattr(torch, dtype)} if dtype else {}
    pipe = DiffusionPipeline.from_pretrained(model_dir, **typed)
    if device:
        pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        output = pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(seed), output_type="np")
    array = output[0]
    if isinstance(array, torch.Tensor):
        array = array.cpu().numpy()
    array = np.asarray(array)
    if array.dtype != np.float32:
        raise SystemExit(f"reference: the pipeline returned {array.dtype}, expected float32")
    return array


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="folder written by save_pretrained")
    parser.add_argument("--jobs", help="a JSON list of {model, kwargs, seed, out: [...]} run in this process")
    parser.add_argument("--kwargs", default="{}", help="JSON object of __call__ keyword arguments")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: torch's own default)")
    parser.add_argument("--out", action="append", help="where to np.save the array (repeatable)")
    parser.add_argument("--dtype", help="torch_dtype to load with (default: diffusers' own)")
    parser.add_argument("--device", help="where to run the pipeline (default: the CPU)")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.jobs:
        with open(args.jobs) as f:
            jobs = json.load(f)
        for job in jobs:
            try:
                import_component_libraries(job["model"])
                for out in job["out"]:
                    np.save(out, run_once(job["model"], job["kwargs"], job["seed"]))
            except BaseException as exc:  # noqa: BLE001 - this job's failure is reported in its own file
                with open(job["out"][0] + ".error", "w") as f:
                    f.write(f"{type(exc).__name__}: {exc}")
        return 0
    if not args.model or not args.out:
        parser.error("give --model and --out, or --jobs")
    kwargs = json.loads(args.kwargs)
    if not isinstance(kwargs, dict):
        parser.error("--kwargs must be a JSON object")
    import_component_libraries(args.model)
    for out in args.out:
        np.save(out, run_once(args.model, kwargs, args.seed, args.dtype, args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
