"""``python -m diffuse.bench quality`` and ``... cache``: what patches and the first-block cache cost on a real picture.

The embedded trained model (or ``--model``) generates each held-out prompt
whole in this process and split over two local nodes at ``--patches`` 1, 2 and
4 (20 steps by default, one torch thread everywhere). For each P it prints the
mean and maximum absolute difference from the whole model in 8-bit levels, and
how often the prompt's colour and direction of motion still measure as asked
(``diffuse.train.props``). Row one must be exactly zero.

``cache`` does the same for ``--cache-threshold`` 0 (off), 0.05, 0.1 and 0.2
(``--thresholds``) with ``--patches 2`` beside them, the runs of each prompt
one after another so that load on the machine falls on every row alike: calls
skipped of all calls, seconds of the pipeline calls and the speedup over
threshold 0, and the denoiser's own seconds (the sum of its forward calls: the
time the ring takes, without the text encoder, scheduler and VAE around it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from diffuse.text import plain

from diffuse.home import libraries_offline  # noqa: E402

libraries_offline()


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


def _parser(name: str, doc: str) -> argparse.ArgumentParser:
    from diffuse.flags import Parser, positive

    ap = Parser(prog=f"diffuse bench {name}", description=doc)
    ap.add_argument("--model", default=None, help="default: the embedded trained model")
    ap.add_argument("--steps", type=positive, default=20, help="denoising steps (default 20)")
    ap.add_argument("--prompts", type=positive, default=None, help="use only the first N held-out prompts")
    ap.add_argument("--seed", type=int, default=0, help="the generator's seed (default 0)")
    return ap


def _whole_and_split(a):
    """(model folder, prompts, the whole model's output per prompt, a pipeline to split, two local nodes
    and their pinned addresses), all at one torch thread."""
    import torch

    import diffuse
    from diffuse.client.api import ModelInfo
    from diffuse.local.nodes import start_local_nodes
    from diffuse.plan.planner import load_pipeline
    from diffuse.train.data import heldout_prompts

    torch.set_num_threads(1)
    info = ModelInfo.of(a.model, "whole")  # it runs the pipeline whole
    model = info.path
    prompts = heldout_prompts()[: a.prompts]
    whole_pipe = load_pipeline(model)
    whole_pipe._diffuse = info
    whole = {p: _generate(whole_pipe, p, a.steps, a.seed) for p in prompts}
    pipe = diffuse.from_pretrained(model)
    nodes = start_local_nodes(model, 2, threads=1)
    return model, prompts, whole, pipe, nodes, [f"{n.address}#{n.key}" for n in nodes]


def _diff(split: np.ndarray, whole: np.ndarray) -> np.ndarray:
    """|split - whole| in 8-bit levels."""
    from diffuse.client.writers import to_uint8

    return np.abs(to_uint8(split).astype(np.int16) - to_uint8(whole).astype(np.int16))


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    import diffuse

    ap = _parser("quality", plain(__doc__.split("\n")[0]))
    ap.add_argument("--patches", default="1,2,4", help="comma-separated patch counts; 1 is exact (the baseline)")
    a = ap.parse_args(argv)
    console = Console()
    patch_counts = [int(p) for p in a.patches.split(",")]
    model, prompts, whole, pipe, nodes, addresses = _whole_and_split(a)
    rows = []
    try:
        for patches in patch_counts:
            diffs, holds, t0 = [], 0, time.perf_counter()
            for prompt in prompts:
                # a fresh session per prompt: stale buffers never carry over from another picture
                with diffuse.split(pipe, nodes=addresses, patches=patches):
                    split = _generate(pipe, prompt, a.steps, a.seed)
                diffs.append(_diff(split, whole[prompt]))
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


class _DenoiserClock:
    """Calls of the denoiser's forward and the seconds spent in them (hooks on the module, removed by ``close``)."""

    def __init__(self, denoiser):
        self.seconds, self.calls, self._t0 = 0.0, 0, None
        self._hooks = [denoiser.register_forward_pre_hook(self._start),
                       denoiser.register_forward_hook(self._stop, always_call=True)]

    def _start(self, *_):
        self._t0 = time.perf_counter()

    def _stop(self, *_):
        self.seconds += time.perf_counter() - self._t0
        self.calls += 1

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


def cache_main(argv: list[str] | None = None) -> int:
    """``python -m diffuse.bench cache``: the first-block cache's speed and quality against --patches 2."""
    from rich.console import Console
    from rich.table import Table

    import diffuse
    from diffuse.client.request import checked_threshold

    ap = _parser("cache", "What the first-block cache (--cache-threshold) costs and saves on the trained model, "
                          "beside --patches 2.")
    ap.add_argument("--thresholds", default="0,0.05,0.1,0.2", help="comma-separated; 0 is off (the baseline)")
    a = ap.parse_args(argv)
    console = Console(width=160)
    thresholds = [checked_threshold(float(t)) for t in a.thresholds.split(",")]
    if 0.0 not in thresholds:
        thresholds.insert(0, 0.0)
    configs = [(t, 1) for t in thresholds] + [(0.0, 2)]
    model, prompts, whole, pipe, nodes, addresses = _whole_and_split(a)
    rows = {c: {"diffs": [], "holds": 0, "seconds": 0.0, "denoiser": 0.0, "skipped": 0, "calls": 0} for c in configs}
    clock = _DenoiserClock(pipe.transformer)
    try:
        for prompt in prompts:
            for threshold, patches in configs:  # one prompt's rows back to back: load falls on each alike
                row = rows[(threshold, patches)]
                seconds, calls = clock.seconds, clock.calls
                with diffuse.split(pipe, nodes=addresses, patches=patches, cache_threshold=threshold) as split:
                    t0 = time.perf_counter()
                    out = _generate(pipe, prompt, a.steps, a.seed)
                    row["seconds"] += time.perf_counter() - t0
                row["denoiser"] += clock.seconds - seconds
                row["skipped"] += split.cache_skipped
                row["calls"] += clock.calls - calls
                row["diffs"].append(_diff(out, whole[prompt]))
                row["holds"] += _holds(prompt, out)
    finally:
        clock.close()
        nodes.stop()

    base = rows[(0.0, 1)]
    table = Table(title=f"first-block cache: {os.path.basename(model)}, 2 nodes, {a.steps} steps, "
                        f"{len(prompts)} held-out prompts; differences from whole in 8-bit levels")
    for col in ("run", "calls skipped", "seconds", "speedup", "denoiser s", "denoiser speedup", "mean |diff|",
                "max |diff|", "colour+motion hold"):
        table.add_column(col, justify="right")
    for (threshold, patches), row in rows.items():
        name = f"--patches {patches}" if patches > 1 else "threshold 0 (off)" if threshold == 0 else \
            f"threshold {threshold:g}"
        d = np.stack(row["diffs"])
        table.add_row(name, f"{row['skipped']}/{row['calls']}", f"{row['seconds']:.1f}",
                      f"{base['seconds'] / row['seconds']:.2f}x", f"{row['denoiser']:.1f}",
                      f"{base['denoiser'] / row['denoiser']:.2f}x", f"{float(d.mean()):.3f}", str(int(d.max())),
                      f"{row['holds']}/{len(prompts)}")
    console.print(table)
    whole_holds = sum(_holds(p, whole[p]) for p in prompts)
    console.print(f"whole model: colour+motion hold in {whole_holds}/{len(prompts)}; seconds: the pipeline calls "
                  f"(text encoder, steps, VAE); denoiser s: its forward calls only (the ring's share); "
                  f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
