"""Evidence the model learned: property match rates on held-out prompts.

    python -m diffuse.train evaluate [--model DIR] [--steps 20] [--seeds 2] [--sheet docs/example.png]

Generates every held-out prompt (never trained on) with the plain diffusers
WanPipeline and measures colour / motion / shape of the output with
diffuse.train.props. The same is done for the same architecture with random
weights (everything untrained) and with only the transformer random (trained
VAE), which is the chance level the trained transformer must beat.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from diffuse.home import libraries_offline  # noqa: E402

libraries_offline()

import numpy as np
import torch

from . import DEFAULT_MODEL
from .data import heldout_prompts
from .props import matches, measure

KEYS = ("colour", "motion", "shape")


def load(model_dir: str = DEFAULT_MODEL):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, prompts, seed=0, steps=20, guidance_scale=5.0, frames=None, size=None):
    """frames uint8 (N, F, H, W, 3), one clip per prompt, seeded per call."""
    from .data import FRAMES, SIZE

    out = pipe(prompt=list(prompts), num_inference_steps=steps, guidance_scale=guidance_scale,
               height=size or SIZE, width=size or SIZE, num_frames=frames or FRAMES,
               generator=torch.Generator().manual_seed(seed), output_type="np").frames
    return (np.clip(out, 0, 1) * 255).round().astype(np.uint8)


def score(pipe, prompts, seeds, steps, guidance_scale):
    rows, clips = [], []
    t0 = time.time()
    for s in range(seeds):
        vids = generate(pipe, prompts, seed=s, steps=steps, guidance_scale=guidance_scale)
        for p, v in zip(prompts, vids):
            m = matches(p, v)
            rows.append({"prompt": p, "seed": s, **{k: bool(m[k]) for k in KEYS},
                         "measured": {k: measure(v)[k] for k in KEYS}})
            clips.append(v)
    dt = time.time() - t0
    rates = {k: float(np.mean([r[k] for r in rows])) for k in KEYS}
    rates["colour+motion"] = float(np.mean([r["colour"] and r["motion"] for r in rows]))
    rates["all"] = float(np.mean([all(r[k] for k in KEYS) for r in rows]))
    return {"rates": rates, "rows": rows, "seconds_per_clip": dt / max(1, len(rows))}, clips


def contact_sheet(clips, prompts, path, scale=2, max_rows=6):
    from PIL import Image, ImageDraw

    clips = clips[:max_rows]
    n, f, h, w, _ = clips[0][None].shape if False else (len(clips), *clips[0].shape)
    label_h, pad = 12, 2
    W = f * (w * scale + pad) + pad
    H = n * (h * scale + pad + label_h) + pad
    sheet = Image.new("RGB", (W, H), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for i, (clip, p) in enumerate(zip(clips, prompts)):
        y = pad + i * (h * scale + pad + label_h)
        draw.text((pad, y), p, fill=(0, 0, 0))
        for j in range(f):
            im = Image.fromarray(clip[j]).resize((w * scale, h * scale), Image.NEAREST)
            sheet.paste(im, (pad + j * (w * scale + pad), y + label_h))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    sheet.save(path, optimize=True)
    return path


def evaluate(model_dir=DEFAULT_MODEL, steps=20, seeds=2, guidance_scale=5.0, baselines=True,
             sheet=None, threads=None):
    from . import build

    if threads:
        torch.set_num_threads(threads)
    prompts = heldout_prompts()
    results = {}
    pipe = load(model_dir)
    results["trained"], clips = score(pipe, prompts, seeds, steps, guidance_scale)
    if sheet:
        pick = list(range(0, len(prompts), 2))[:6]
        contact_sheet([clips[i] for i in pick], [prompts[i] for i in pick], sheet)
    if baselines:
        size = "quick" if pipe.transformer.config.num_layers < 4 else "full"
        rnd = build.build_pipeline(size, seed=1234)
        rnd.set_progress_bar_config(disable=True)
        results["random (all weights)"], _ = score(rnd, prompts, seeds, steps, guidance_scale)
        half = type(pipe)(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae,
                          transformer=rnd.transformer, scheduler=pipe.scheduler)
        half.set_progress_bar_config(disable=True)
        results["random transformer, trained VAE"], _ = score(half, prompts, seeds, steps, guidance_scale)
    return results


def print_table(results, n):
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"Held-out prompts: property match rate ({n} clips each)")
    t.add_column("model")
    for k in (*KEYS, "colour+motion", "all"):
        t.add_column(k, justify="right")
    t.add_column("s/clip", justify="right")
    for name, r in results.items():
        t.add_row(name, *[f"{r['rates'][k]:.0%}" for k in (*KEYS, "colour+motion", "all")],
                  f"{r['seconds_per_clip']:.2f}")
    Console().print(t)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m diffuse.train evaluate")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--steps", type=int, default=20, help="inference steps")
    ap.add_argument("--seeds", type=int, default=2, help="clips per held-out prompt")
    ap.add_argument("--guidance", type=float, default=5.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sheet", default=None, help="write a PNG contact sheet here (e.g. docs/example.png)")
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--json", default=None, help="write all results as JSON here")
    a = ap.parse_args(argv)
    res = evaluate(a.model, a.steps, a.seeds, a.guidance, not a.no_baselines, a.sheet, a.threads)
    print_table(res, len(heldout_prompts()) * a.seeds)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
