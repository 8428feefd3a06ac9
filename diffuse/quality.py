"""``python -m diffuse.bench quality``: what patches cost on a real picture.

The embedded trained model (or ``--model``) generates each held-out prompt
whole in this process and split over two local nodes at ``--patches`` 1, 2 and
4 (20 steps by default, one torch thread everywhere). For each P it prints the
mean and maximum absolute difference from the whole model in 8-bit levels, and
how often the prompt's colour and direction of motion still measure as asked
(``diffuse.train.props``). Row one must be exactly zero.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from diffuse.text import plain

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _generate(pipe, prompt: str, steps: int, seed: int) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = pipe(prompt=prompt, num_inference_steps=steps, generator=torch.Generator("cpu").manual_seed(seed),
                   output_type="np", **_call_defaults(pipe))
    return np.asarray(out[0])[0]


def _call_defaults(pipe) -> dict:
    return {k: v for k, v in pipe._diffuse.call_defaults().items() if k != "num_inference_steps"}


def _holds(prompt: str, frames: np.ndarray) -> bool:
    from diffuse.train.props import matches

    m = matches(prompt, frames)
    return bool(m["colour"] and m["motion"])


def main(argv: list[str] | None = None) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    import diffuse
    from diffuse.api import ModelInfo
    from diffuse.localnodes import start_local_nodes
    from diffuse.planner import load_pipeline
    from diffuse.train.data import heldout_prompts
    from diffuse.writers import to_uint8

    ap = argparse.ArgumentParser(prog="python -m diffuse.bench quality", description=plain(__doc__.split("\n")[0]))
    ap.add_argument("--model", default=None, help="default: the embedded trained model")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--patches", default="1,2,4")
    ap.add_argument("--prompts", type=int, default=None, help="use only the first N held-out prompts")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    console = Console()
    torch.set_num_threads(1)
    info = ModelInfo.of(a.model)
    model = info.path
    prompts = heldout_prompts()[: a.prompts]
    patch_counts = [int(p) for p in a.patches.split(",")]

    whole_pipe = load_pipeline(model)
    whole_pipe._diffuse = info
    whole = {p: _generate(whole_pipe, p, a.steps, a.seed) for p in prompts}
    rows = []
    pipe = diffuse.from_pretrained(model)
    nodes = start_local_nodes(model, 2, threads=1)
    addresses = [f"{n.address}#{n.key}" for n in nodes]
    try:
        for patches in patch_counts:
            diffs, holds, t0 = [], 0, time.perf_counter()
            for prompt in prompts:
                # a fresh session per prompt: stale buffers never carry over from another picture
                with diffuse.split(pipe, nodes=addresses, patches=patches):
                    split = _generate(pipe, prompt, a.steps, a.seed)
                diffs.append(np.abs(to_uint8(split).astype(np.int16) - to_uint8(whole[prompt]).astype(np.int16)))
                holds += _holds(prompt, split)
            d = np.stack(diffs)
            rows.append((patches, float(d.mean()), int(d.max()), holds, time.perf_counter() - t0))
    finally:
        nodes.stop()

    whole_holds = sum(_holds(p, whole[p]) for p in prompts)
    table = Table(title=f"split vs whole: {os.path.basename(model)}, 2 nodes, {a.steps} steps, "
                        f"{len(prompts)} held-out prompts, 8-bit levels")
    for col in ("--patches", "mean |diff|", "max |diff|", "colour+motion hold (split)", "seconds"):
        table.add_column(col, justify="right")
    for patches, mean, mx, holds, secs in rows:
        table.add_row(str(patches), f"{mean:.3f}", str(mx), f"{holds}/{len(prompts)}", f"{secs:.1f}")
    console.print(table)
    console.print(f"whole model: colour+motion hold in {whole_holds}/{len(prompts)}")
    if rows and rows[0][0] == 1 and (rows[0][1] != 0 or rows[0][2] != 0):
        console.print("[bold red]row one is not zero: the split model at one patch differs from the whole model[/]")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
