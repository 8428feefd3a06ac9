"""Ground truth for prompt embeddings: a saved pipeline's own ``encode_prompt``, run whole in plain diffusers.

    python tests/encode_reference.py --jobs JOBS.json --threads N --out RESULTS.json

Each job is ``{"model": DIR, "kwargs": {...}, "out": PREFIX}`` (and optionally ``"dtype"``, loaded
with ``torch_dtype`` set to it): the pipeline is loaded by ``DiffusionPipeline.from_pretrained(DIR)``
and ``encode_prompt(**kwargs)`` called under ``torch.no_grad()``; each tensor it returns (Nones left
out, order kept) is saved as ``PREFIX.<i>.npy`` in its own dtype (bfloat16, which numpy lacks, widened
to float32: every value exactly). RESULTS.json lists, per job, the files written
(``{"arrays": [...]}``) or the error (``{"error": "..."}``).

Imports only torch, numpy and diffusers: nothing from the ``diffuse`` package, so the
reference cannot share a bug with what it checks.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch


def encode(model_dir: str, kwargs: dict, out: str, dtype: str | None = None) -> list[str]:
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(model_dir, **({"torch_dtype": getattr(torch, dtype)} if dtype else {}))
    with torch.no_grad():
        found = pipe.encode_prompt(**kwargs)
    written = []
    for t in (found if isinstance(found, tuple) else (found,)):
        if isinstance(t, torch.Tensor):
            written.append(f"{out}.{len(written)}.npy")
            np.save(written[-1], (t.float() if t.dtype == torch.bfloat16 else t).numpy())  # bf16 exactly, widened
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", required=True, help="a JSON list of {model, kwargs, out}")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: torch's own default)")
    parser.add_argument("--out", required=True, help="where to write the results (JSON)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with open(args.jobs) as f:
        jobs = json.load(f)
    results = []
    for job in jobs:
        try:
            results.append({"arrays": encode(job["model"], job["kwargs"], job["out"], job.get("dtype"))})
        except Exception as exc:  # noqa: BLE001 - this job's failure is reported in its own entry
            results.append({"error": f"{type(exc).__name__}: {exc}"})
    with open(args.out, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
