"""Ground truth for a pipeline whose VAE decodes (and encodes) elsewhere: the pipeline run whole in plain diffusers,
its VAE set as the job says.

    python tests/decode_reference.py --jobs JOBS.json --threads N --out RESULTS.json

Each job is ``{"model": DIR, "kwargs": {...}, "seed": S, "out": FILE.npy}``, and optionally ``"pipeline"`` (a
diffusers pipeline class loaded from the same folder in place of the one model_index.json names: an
image-to-image pipeline, whose VAE encodes too), ``"image"`` (an .npy file passed as the call's ``image``),
``"tiling"`` (``vae.enable_tiling()`` first), ``"vae"`` (attributes set on the VAE then, such as its tile
sizes) and ``"dtype"`` (loaded with ``torch_dtype`` set to it). The pipeline is called under ``torch.no_grad()`` with
``generator=torch.Generator("cpu").manual_seed(S)`` and ``output_type="np"``; the first field of its output is
saved as returned. A job with ``"encode"`` (an .npy file) calls no pipeline: its VAE encodes that array, and a
draw from the latent distribution with that generator is saved. RESULTS.json lists, per job,
``{"array": FILE}`` or ``{"error": "..."}``.

Imports only torch, numpy and diffusers: nothing from the ``diffuse`` package, so the reference cannot share a
bug with what it checks.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from jobfile import run_jobs


def run(job: dict) -> str:
    import diffusers

    cls = getattr(diffusers, job["pipeline"]) if job.get("pipeline") else diffusers.DiffusionPipeline
    typed = {"torch_dtype": getattr(torch, job["dtype"])} if job.get("dtype") else {}
    pipe = cls.from_pretrained(job["model"], **typed)
    pipe.set_progress_bar_config(disable=True)
    if job.get("tiling"):
        pipe.vae.enable_tiling()
    for key, value in (job.get("vae") or {}).items():
        setattr(pipe.vae, key, value)
    if job.get("encode"):
        with torch.no_grad():
            dist = pipe.vae.encode(torch.from_numpy(np.load(job["encode"]))).latent_dist
            np.save(job["out"], dist.sample(generator=torch.Generator("cpu").manual_seed(job.get("seed", 0))).numpy())
        return job["out"]
    kwargs = dict(job["kwargs"])
    if job.get("image"):
        kwargs["image"] = np.load(job["image"])
    with torch.no_grad():
        output = pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(job.get("seed", 0)), output_type="np")
    np.save(job["out"], np.asarray(output[0]))
    return job["out"]


def main(argv: list[str] | None = None) -> int:
    return run_jobs(lambda job: {"array": run(job)}, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
