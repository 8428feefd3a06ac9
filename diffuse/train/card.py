"""Writes the model card (README.md) of a trained pipeline folder from its
train_stats.json and, if given, the JSON written by `evaluate --json`."""

from __future__ import annotations

import json
import os
import sys

from .data import COLOURS, DIRECTIONS, FRAMES, SHAPES, SIZE, heldout_prompts


def write_card(model_dir: str, eval_json: str | None = None, command: str = "") -> str:
    st = json.load(open(os.path.join(model_dir, "train_stats.json")))
    ev = json.load(open(eval_json)) if eval_json else None
    configs = {part: json.load(open(os.path.join(model_dir, part, "config.json")))
               for part in ("transformer", "vae", "text_encoder")}
    lines = _parts(st, configs) + _data_and_training(st, command) + (_evaluation(ev) if ev else []) + LIMITS
    path = os.path.join(model_dir, "README.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def _parts(st: dict, configs: dict) -> list[str]:
    """The card's head: what the model is, how to load it, and its parts from their configs."""
    tc, vc, ec = configs["transformer"], configs["vae"], configs["text_encoder"]
    return [
        "---",
        "library_name: diffusers",
        "pipeline_tag: text-to-video",
        "license: apache-2.0",
        "---",
        "",
        "# tiny-wan-shapes",
        "",
        f"A tiny text-to-video model in the Wan 2.1 architecture (diffusers `WanPipeline`), trained from scratch on CPU "
        f"in this repository by `python -m diffuse.train`. It makes {FRAMES}-frame {SIZE}x{SIZE} clips of one coloured "
        f"shape moving on a black background. It is the default model of `diffuse`: small enough to split over 2–4 "
        f"nodes (4 transformer blocks) and run in well under a second per step on CPU.",
        "",
        "```python",
        "from diffusers import WanPipeline",
        "pipe = WanPipeline.from_pretrained('diffuse/trained/tiny-wan-shapes')",
        f"video = pipe('a red circle moving up', height={SIZE}, width={SIZE}, num_frames={FRAMES}, "
        "num_inference_steps=20, output_type='np').frames[0]",
        "```",
        "",
        "## Parts",
        "",
        f"- transformer: `WanTransformer3DModel`, {tc['num_layers']} blocks, hidden {tc['num_attention_heads'] * tc['attention_head_dim']} "
        f"({tc['num_attention_heads']} heads x {tc['attention_head_dim']}), ffn {tc['ffn_dim']}, patch {tuple(tc['patch_size'])}; "
        f"{st['params']['transformer'] / 1e6:.2f} M parameters, trained",
        f"- vae: `AutoencoderKLWan`, base_dim {vc['base_dim']}, dim_mult {vc['dim_mult']}, z_dim {vc['z_dim']}, "
        f"spatial x{vc['scale_factor_spatial']}, temporal x{vc['scale_factor_temporal']} "
        f"({FRAMES} frames -> {(FRAMES - 1) // vc['scale_factor_temporal'] + 1} latent frames of "
        f"{SIZE // vc['scale_factor_spatial']}x{SIZE // vc['scale_factor_spatial']}); "
        f"{st['params']['vae'] / 1e6:.2f} M parameters, trained first, then frozen; `latents_mean/std` measured on the data",
        f"- text encoder: `UMT5EncoderModel`, {ec['num_layers']} layers, d_model {ec['d_model']}, **frozen random weights** "
        f"({st['params']['text_encoder'] / 1e3:.0f} k parameters); a word-level tokenizer makes every word its own "
        "token, so random embeddings still tell the words apart",
        "- tokenizer: word-level (`tokenizers` WordLevel, T5 layout: `</s>` appended, `<pad>` = 0) over the prompt vocabulary; "
        "unknown words map to `<unk>`",
        "- scheduler: `FlowMatchEulerDiscreteScheduler` (shift 1.0)",
        "",
    ]


def _data_and_training(st: dict, command: str) -> list[str]:
    """Where the data came from, and how training went, from train_stats.json."""
    mi = lambda s: f"{s / 60:.1f} min"  # noqa: E731
    return [
        "## Data",
        "",
        f"Procedural, made offline (`diffuse/train/data.py`): prompts `a <colour> <shape> moving <direction>` with "
        f"colours {', '.join(COLOURS)}; shapes {', '.join(SHAPES)}; directions {', '.join(DIRECTIONS)} "
        f"({len(COLOURS) * len(SHAPES) * len(DIRECTIONS)} combinations). Start position, size and speed vary per clip. "
        f"{len(heldout_prompts())} combinations are held out and never trained on (every word still appears in "
        f"training): {', '.join(repr(p) for p in heldout_prompts())}. Training used {st['clips']} clips over "
        f"{st['train_prompts']} prompts.",
        "",
        "## Training",
        "",
        f"- command: {command or '`python -m diffuse.train`'} (seed {st['seed']}, {st['threads']} torch thread)",
        f"- machine: {st['machine']}, shared with other jobs",
        f"- VAE: {st['vae_steps']} steps, batch {st['vae_batch']}, AdamW 1e-3, foreground-weighted MSE + 1e-4 KL; "
        f"{mi(st['vae_seconds'])}; final (smoothed) weighted reconstruction loss {st['vae_loss_final']}",
        f"- VAE reconstructions of held-out clips keep their properties: {st.get('vae_recon_match')}",
        f"- transformer: {st['steps_done']} steps (of {st['steps']} planned; wall-clock cap {st['time_budget_min']} min), "
        f"batch {st['batch']}, AdamW 5e-4 with warmup and cosine decay, EMA 0.999 (shipped), 10% empty-prompt "
        f"dropout for classifier-free guidance; diffusers' flow-matching objective (logit-normal timesteps, "
        f"input (1-s)·x0 + s·noise, target noise − x0); {mi(st['transformer_seconds'])}",
        *([f"- VAE decoder polish (encoder frozen, so the latents the transformer learned stay valid): "
           f"{st['decoder_steps']} steps, {mi(st['decoder_seconds'])}, final weighted reconstruction loss "
           f"{st['decoder_loss_curve'][-1][1]}; held-out reconstructions before {st.get('vae_recon_match_before_polish')}, "
           f"after {st['vae_recon_match']}"] if st.get("decoder_steps") else []),
        f"- transformer loss: {st['loss_first']} (first steps) -> {st['loss_last']} (last steps)",
        f"- total wall time: {mi(st['total_seconds'])}",
        "",
    ]


def _evaluation(ev: dict) -> list[str]:
    """The held-out prompts' properties, from the JSON of ``evaluate --json``."""
    n = len(ev["trained"]["rows"])
    lines = [
        "## Evaluation (held-out prompts)",
        "",
        f"`python -m diffuse.train evaluate`: each held-out prompt generated with plain diffusers "
        f"(20 steps, guidance 5.0), {n} clips; properties measured by `diffuse.train.props` "
        "(dominant colour of the foreground; direction of the foreground centroid from first to last frames; "
        "bounding-box fill for the shape).",
        "",
        "| model | colour | motion | shape | colour+motion | all three |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in ev.items():
        R = r["rates"]
        lines.append(f"| {name} | {R['colour']:.0%} | {R['motion']:.0%} | {R['shape']:.0%} | "
                     f"{R['colour+motion']:.0%} | {R['all']:.0%} |")
    return lines + ["", "Chance level: colour 1/6, motion 1/4 (a random clip may also be 'static'), shape 1/3.", ""]


LIMITS = [
    "## Limits",
    "",
    "A toy: it knows only the words above, one shape per clip, 32x32 pixels, 9 frames. "
    "It exists to give `diffuse` a real, small, trained video model to split and test with.",
    "",
    "- Shapes come out as rounded blobs: the tiny VAE (8x8 latents, 4 frames per latent frame, 8.5 min of "
    "training) does not keep corners, so even its reconstructions of real clips measure at chance for shape, "
    "and so does generation. Colour and motion are learned; the colour errors on held-out prompts are "
    "blue <-> cyan confusions.",
    "- The text encoder is random and frozen: words outside the vocabulary become `<unk>`.",
    "",
]


if __name__ == "__main__":
    print(write_card(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None,
                     sys.argv[3] if len(sys.argv) > 3 else ""))
