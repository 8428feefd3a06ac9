"""Training: a tiny AutoencoderKLWan first, then (VAE frozen) a WanTransformer3DModel
with diffusers' flow-matching objective, text encoder frozen random."""

from __future__ import annotations

import copy
import json
import math
import os
import tempfile
import platform
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from . import build
from .data import make_dataset, train_combos
from .text_rows import PadBias, encode_prompts, install_pad_bias, remove_pad_bias, text_batch


@dataclass
class TrainConfig:
    out: str = "diffuse/trained/tiny-wan-shapes"
    size: str = "full"
    steps: int = 6000
    vae_steps: int = 500
    decoder_steps: int = 400  # decoder-only polish after the transformer (encoder frozen)
    seed: int = 0
    threads: int = 1
    per_combo: int = 40
    batch: int = 32
    vae_batch: int = 8
    lr: float = 5e-4
    vae_lr: float = 1e-3
    warmup: int = 200
    cfg_dropout: float = 0.1
    ema_decay: float = 0.999
    max_sequence_length: int = 512  # what WanPipeline pads prompts to by default
    log_every: int = 50
    time_budget_min: float = 0.0  # transformer phase wall-clock cap (0 = none); the LR schedule follows it
    quick: bool = False
    extra: dict = field(default_factory=dict)


def quick_config(out: str, **kw) -> TrainConfig:
    c = TrainConfig(out=out, size="quick", steps=60, vae_steps=15, decoder_steps=3, per_combo=1, batch=16,
                    vae_batch=4, lr=2e-3, warmup=5, ema_decay=0.0, log_every=5, quick=True)
    for k, v in kw.items():
        if v is not None:
            setattr(c, k, v)
    return c


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]:.4f}"), TimeElapsedColumn(), TimeRemainingColumn())


def _lr_at(step, total, warmup, base, frac=None):
    if step < warmup:
        return base * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    if frac is not None:
        t = min(1.0, max(t, frac))
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def to_video_tensor(clips: np.ndarray) -> torch.Tensor:
    """uint8 (N, F, H, W, 3) -> float (N, 3, F, H, W) in [-1, 1]."""
    return torch.from_numpy(clips).permute(0, 4, 1, 2, 3).float().div(127.5).sub(1.0)


def train_vae(vae, clips_t, cfg, log):
    g = torch.Generator().manual_seed(cfg.seed + 10)
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_lr, weight_decay=0.0)
    vae.train()
    losses, smooth = [], None
    with _progress() as prog:
        task = prog.add_task("VAE", total=cfg.vae_steps, loss=float("nan"))
        for step in range(cfg.vae_steps):
            for pg in opt.param_groups:
                pg["lr"] = _lr_at(step, cfg.vae_steps, min(50, cfg.vae_steps // 10 + 1), cfg.vae_lr)
            idx = torch.randint(0, len(clips_t), (cfg.vae_batch,), generator=g)
            x = clips_t[idx]
            post = vae.encode(x).latent_dist
            z = post.sample(generator=g)
            rec = vae.decode(z).sample
            # the shape covers ~10% of the frame: weight foreground pixels up
            w = 1.0 + 4.0 * (x.amax(dim=1, keepdim=True) > -0.6).float()
            rec_loss = (w * (rec - x) ** 2).mean()
            kl = post.kl().mean() / x[0].numel()
            loss = rec_loss + 1e-4 * kl
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
            opt.step()
            lv = rec_loss.item()
            smooth = lv if smooth is None else 0.95 * smooth + 0.05 * lv
            if step % cfg.log_every == 0 or step == cfg.vae_steps - 1:
                losses.append((step, round(smooth, 5)))
                log(f"vae step {step} recon {lv:.5f} (smoothed {smooth:.5f}) kl {kl.item():.3f}")
            prog.update(task, advance=1, loss=smooth)
    vae.eval()
    vae.requires_grad_(False)
    return losses


def polish_decoder(vae, clips_t, steps, cfg, log):
    """Train the VAE decoder only (encoder frozen): the latents, and so the
    transformer trained on them, stay valid while reconstructions sharpen."""
    g = torch.Generator().manual_seed(cfg.seed + 30)
    params = list(vae.decoder.parameters()) + list(vae.post_quant_conv.parameters())
    vae.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=cfg.vae_lr * 0.5, weight_decay=0.0)
    vae.decoder.train()
    losses, smooth = [], None
    with _progress() as prog:
        task = prog.add_task("VAE decoder", total=steps, loss=float("nan"))
        for step in range(steps):
            for pg in opt.param_groups:
                pg["lr"] = _lr_at(step, steps, min(20, steps // 10 + 1), cfg.vae_lr * 0.5)
            idx = torch.randint(0, len(clips_t), (cfg.vae_batch,), generator=g)
            x = clips_t[idx]
            with torch.no_grad():
                z = vae.encode(x).latent_dist.sample(generator=g)
            rec = vae.decode(z).sample
            w = 1.0 + 4.0 * (x.amax(dim=1, keepdim=True) > -0.6).float()
            loss = (w * (rec - x) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            lv = loss.item()
            smooth = lv if smooth is None else 0.95 * smooth + 0.05 * lv
            if step % cfg.log_every == 0 or step == steps - 1:
                losses.append((step, round(smooth, 5)))
                log(f"decoder step {step} recon {lv:.5f} (smoothed {smooth:.5f})")
            prog.update(task, advance=1, loss=smooth)
    vae.eval()
    vae.requires_grad_(False)
    return losses


def polish_saved(model_dir: str, steps: int, seed: int = 0, threads: int = 1, per_combo: int = 40):
    """Decoder polish on a saved pipeline folder (rewrites its vae/ weights and stats)."""
    from diffusers import AutoencoderKLWan

    torch.set_num_threads(threads)
    cfg = TrainConfig(out=model_dir, seed=seed, threads=threads, per_combo=per_combo)
    t0 = time.time()
    log = lambda m: print(f"[{time.time() - t0:7.1f}s] {m}", flush=True)  # noqa: E731
    vae = AutoencoderKLWan.from_pretrained(os.path.join(model_dir, "vae"))
    log(f"before: VAE reconstruction of held-out clips, property match rates: {vae_sanity(vae)}")
    clips, _ = make_dataset(train_combos(), per_combo, seed=seed + 100)
    losses = polish_decoder(vae, to_video_tensor(clips), steps, cfg, log)
    check = vae_sanity(vae)
    log(f"after: VAE reconstruction of held-out clips, property match rates: {check}")
    vae.save_pretrained(os.path.join(model_dir, "vae"), safe_serialization=True)
    sp = os.path.join(model_dir, "train_stats.json")
    st = json.load(open(sp))
    st.update(decoder_steps=steps, decoder_seconds=round(time.time() - t0, 1), decoder_loss_curve=losses,
              vae_recon_match_before_polish=st.get("vae_recon_match"), vae_recon_match=check)
    json.dump(st, open(sp, "w"), indent=1)
    return st


@torch.no_grad()
def vae_sanity(vae, seed=123):
    """Property match rate of VAE reconstructions of held-out clips (an upper bound for generation)."""
    from .data import heldout_combos, make_prompt
    from .props import matches

    clips, prompts = make_dataset(heldout_combos(), 2, seed=seed)
    rec = vae.decode(vae.encode(to_video_tensor(clips)).latent_dist.mode()).sample
    rec = ((rec.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 4, 1).numpy()
    res = [matches(p, r) for p, r in zip(prompts, rec)]
    return {k: round(float(np.mean([r[k] for r in res])), 3) for k in ("colour", "motion", "shape")}


@torch.no_grad()
def encode_latents(vae, clips_t, bs=32):
    zs = [vae.encode(clips_t[i:i + bs]).latent_dist.mode() for i in range(0, len(clips_t), bs)]
    return torch.cat(zs)


def train_transformer(transformer, latents, prompts, embs, scheduler, cfg, log):
    from diffusers.training_utils import compute_density_for_timestep_sampling

    g = torch.Generator().manual_seed(cfg.seed + 20)
    torch.manual_seed(cfg.seed + 21)  # compute_density_for_timestep_sampling uses the global RNG
    procs = install_pad_bias(transformer)
    transformer.train()
    ema = copy.deepcopy(transformer).eval().requires_grad_(False) if cfg.ema_decay > 0 else None
    opt = torch.optim.AdamW(transformer.parameters(), lr=cfg.lr, weight_decay=0.01)
    sched_sigmas = scheduler.sigmas.clone()
    sched_timesteps = scheduler.timesteps.clone()
    n_train_t = scheduler.config.num_train_timesteps
    losses, smooth, raw = [], None, []
    with _progress() as prog:
        task = prog.add_task("transformer", total=cfg.steps, loss=float("nan"))
        t_begin = time.time()
        for step in range(cfg.steps):
            frac = None
            if cfg.time_budget_min > 0:
                # the cosine schedule runs on whichever is further along: steps or wall clock
                frac = (time.time() - t_begin) / (60 * cfg.time_budget_min)
                if frac >= 1.0:
                    log(f"time budget of {cfg.time_budget_min} min reached at step {step}; stopping")
                    break
            for pg in opt.param_groups:
                pg["lr"] = _lr_at(step, cfg.steps, cfg.warmup, cfg.lr, frac)
            idx = torch.randint(0, len(latents), (cfg.batch,), generator=g)
            x0 = latents[idx]
            ps = [prompts[i] for i in idx.tolist()]
            drop = torch.rand(cfg.batch, generator=g) < cfg.cfg_dropout
            ps = ["" if d else p for p, d in zip(ps, drop.tolist())]
            text, bias = text_batch(embs, ps, cfg.max_sequence_length)
            for p in procs:
                p.bias = bias
            # diffusers' flow-matching recipe (train_dreambooth_sd3 / train_wan):
            u = compute_density_for_timestep_sampling("logit_normal", cfg.batch, logit_mean=0.0, logit_std=1.0)
            ti = (u * n_train_t).long().clamp(0, n_train_t - 1)
            timesteps = sched_timesteps[ti]
            sigmas = sched_sigmas[ti].view(-1, 1, 1, 1, 1)
            noise = torch.randn(x0.shape, generator=g)
            noisy = (1.0 - sigmas) * x0 + sigmas * noise
            target = noise - x0
            pred = transformer(noisy, timesteps, text, return_dict=False)[0]
            loss = F.mse_loss(pred.float(), target.float())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
            opt.step()
            if ema is not None:
                d = min(cfg.ema_decay, (1 + step) / (10 + step))
                with torch.no_grad():
                    for pe, pm in zip(ema.parameters(), transformer.parameters()):
                        pe.lerp_(pm, 1 - d)
            lv = loss.item()
            raw.append(lv)
            smooth = lv if smooth is None else 0.98 * smooth + 0.02 * lv
            if step % cfg.log_every == 0 or step == cfg.steps - 1:
                losses.append((step, round(smooth, 5)))
                log(f"transformer step {step} loss {lv:.4f} (smoothed {smooth:.4f}) lr {opt.param_groups[0]['lr']:.2e}")
            prog.update(task, advance=1, loss=smooth)
    remove_pad_bias(transformer, procs)
    final = ema if ema is not None else transformer
    if ema is not None:
        for blk in ema.blocks:  # the deepcopy carried PadBias processors
            if isinstance(blk.attn2.processor, PadBias):
                blk.attn2.set_processor(blk.attn2.processor.inner)
    final.eval()
    return final, losses, raw


def run(cfg: TrainConfig) -> dict:
    from diffusers import WanPipeline

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    t_start = time.time()
    os.makedirs(cfg.out, exist_ok=True)
    logf = open(os.path.join(tempfile.gettempdir(), f"diffuse-train-{os.getpid()}.log"), "a")

    def log(msg):
        line = f"[{time.time() - t_start:7.1f}s] {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    tok = build.build_tokenizer()
    te = build.build_text_encoder(cfg.size, len(tok), cfg.seed)
    vae = build.build_vae(cfg.size, cfg.seed + 1)
    scheduler = build.build_scheduler()

    clips, prompts = make_dataset(train_combos(), cfg.per_combo, seed=cfg.seed + 100)
    clips_t = to_video_tensor(clips)
    log(f"data: {len(clips)} clips {tuple(clips.shape[1:])} over {len(set(prompts))} training prompts")

    t0 = time.time()
    vae_losses = train_vae(vae, clips_t, cfg, log) if cfg.vae_steps > 0 else []
    t_vae = time.time() - t0
    vae_check = vae_sanity(vae)
    log(f"VAE reconstruction of held-out clips, property match rates: {vae_check}")

    t0 = time.time()
    lat = encode_latents(vae, clips_t)
    mean = lat.mean(dim=(0, 2, 3, 4))
    std = lat.std(dim=(0, 2, 3, 4)).clamp_min(1e-3)
    vae.register_to_config(latents_mean=[round(float(v), 5) for v in mean],
                           latents_std=[round(float(v), 5) for v in std])
    # what the pipeline inverts: latents / (1/std) + mean
    lat = (lat - mean.view(1, -1, 1, 1, 1)) / std.view(1, -1, 1, 1, 1)
    log(f"latents {tuple(lat.shape)} encoded in {time.time() - t0:.1f}s; mean {mean.tolist()} std {std.tolist()}")

    embs = encode_prompts(tok, te, sorted(set(prompts)) + [""])
    transformer = build.build_transformer(cfg.size, vae.config.z_dim, te.config.d_model, cfg.seed + 2)
    t0 = time.time()
    transformer, tr_losses, raw = train_transformer(transformer, lat, prompts, embs, scheduler, cfg, log)
    t_tr = time.time() - t0

    t0 = time.time()
    dec_losses, vae_check_before = [], vae_check
    if cfg.decoder_steps > 0:
        dec_losses = polish_decoder(vae, clips_t, cfg.decoder_steps, cfg, log)
        vae_check = vae_sanity(vae)
        log(f"after decoder polish, VAE reconstruction of held-out clips: {vae_check}")
    t_dec = time.time() - t0

    pipe = WanPipeline(tokenizer=tok, text_encoder=te, vae=vae, transformer=transformer, scheduler=scheduler)
    pipe.save_pretrained(cfg.out, safe_serialization=True)
    k = max(1, min(50, len(raw) // 5))
    stats = {
        "size": cfg.size, "seed": cfg.seed, "threads": cfg.threads,
        "steps": cfg.steps, "steps_done": len(raw), "time_budget_min": cfg.time_budget_min, "vae_steps": cfg.vae_steps, "batch": cfg.batch, "vae_batch": cfg.vae_batch,
        "clips": len(clips), "train_prompts": len(set(prompts)),
        "vae_seconds": round(t_vae, 1), "transformer_seconds": round(t_tr, 1),
        "total_seconds": round(time.time() - t_start, 1),
        "vae_loss_curve": vae_losses, "loss_curve": tr_losses,
        "loss_first": round(float(np.mean(raw[:k])), 5), "loss_last": round(float(np.mean(raw[-k:])), 5),
        "vae_recon_match": vae_check,
        "decoder_steps": cfg.decoder_steps, "decoder_seconds": round(t_dec, 1), "decoder_loss_curve": dec_losses,
        "vae_recon_match_before_polish": vae_check_before,
        "vae_loss_final": vae_losses[-1][1] if vae_losses else None,
        "params": {"transformer": sum(p.numel() for p in transformer.parameters()),
                   "vae": sum(p.numel() for p in vae.parameters()),
                   "text_encoder": sum(p.numel() for p in te.parameters())},
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus, torch {torch.__version__}".strip(),
    }
    with open(os.path.join(cfg.out, "train_stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
    log(f"saved pipeline to {cfg.out}; transformer loss {stats['loss_first']} -> {stats['loss_last']}; "
        f"vae recon {stats['vae_loss_final']}; {stats['total_seconds']}s")
    return stats
