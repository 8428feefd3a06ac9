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

import sys

import numpy as np
import torch

from jobfile import run_jobs


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
    return run_jobs(lambda job: {"arrays": encode(job["model"], job["kwargs"], job["out"], job.get("dtype"))}, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
