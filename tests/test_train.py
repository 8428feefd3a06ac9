"""The shipped tiny-wan-shapes model, its training command and its evaluation props."""

import json
import os

import numpy as np
import pytest
import torch

from diffuse.train import DEFAULT_MODEL
from diffuse.train.data import (COLOURS, DIRECTIONS, SHAPES, all_combos, heldout_combos, make_prompt,
                                render_clip, train_combos)
from diffuse.train.props import matches, measure, prompt_properties


@pytest.mark.timeout(180)
def test_quick_training_loss_falls(tmp_path, capsys):
    """``python -m diffuse.train --quick``: the command's own code, in this process (a fresh interpreter would only
    add its start-up)."""
    from diffuse.train.__main__ import main

    out = tmp_path / "m"
    assert main(["--quick", "--out", str(out), "--threads", "1"]) == 0
    assert "loss" in capsys.readouterr().out
    stats = json.loads((out / "train_stats.json").read_text())
    assert stats["loss_last"] < 0.8 * stats["loss_first"], stats
    vae_curve = [v for _, v in stats["vae_loss_curve"]]
    assert vae_curve[-1] < vae_curve[0], vae_curve
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(out))
    assert pipe.transformer.config.num_layers == 2


def test_heldout_split():
    assert len(all_combos()) == len(COLOURS) * len(SHAPES) * len(DIRECTIONS)
    held, train = set(heldout_combos()), set(train_combos())
    assert held and not held & train
    # every word is still seen in training; only the combination is new
    for c, s, d in held:
        assert any(t[0] == c for t in train) and any(t[1] == s for t in train) and any(t[2] == d for t in train)


def test_props_on_synthetic_clips():
    rng = np.random.default_rng(7)
    for combo in all_combos():
        clip = render_clip(*combo, rng=rng)
        p = make_prompt(*combo)
        assert prompt_properties(p) == {"colour": combo[0], "shape": combo[1], "motion": combo[2]}
        m = matches(p, clip)
        assert m == {"colour": True, "motion": True, "shape": True}, (p, measure(clip))
        # float frames in [0, 1] (the pipeline's output_type="np") measure the same
        assert matches(p, clip.astype(np.float32) / 255.0) == m
    clip = render_clip("red", "circle", "up", rng=0)
    assert matches("a blue circle moving down", clip) == {"colour": False, "motion": False, "shape": True}
    blank = np.zeros((9, 32, 32, 3), np.uint8)
    assert measure(blank)["colour"] is None
    assert not any(matches("a red square moving left", blank).values())
    still = np.repeat(clip[:1], 9, axis=0)
    assert measure(still)["motion"] == "static"


@pytest.fixture(scope="module")
def shipped():
    from diffusers import WanPipeline

    torch.set_num_threads(1)
    assert os.path.exists(os.path.join(DEFAULT_MODEL, "model_index.json")), DEFAULT_MODEL
    pipe = WanPipeline.from_pretrained(DEFAULT_MODEL)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_shipped_model_loads_and_generates(shipped):
    from diffusers import AutoencoderKLWan, DiffusionPipeline, WanTransformer3DModel

    assert isinstance(shipped.transformer, WanTransformer3DModel)
    assert isinstance(shipped.vae, AutoencoderKLWan)
    assert shipped.transformer.config.num_layers == 4
    files = [os.path.join(dp, f) for dp, _, fs in os.walk(DEFAULT_MODEL) for f in fs]
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pkl"))]
    assert sum(os.path.getsize(f) for f in files) <= 30 * 2**20
    assert os.path.exists(os.path.join(DEFAULT_MODEL, "README.md"))
    assert type(DiffusionPipeline.from_pretrained(DEFAULT_MODEL)).__name__ == "WanPipeline"
    out = shipped("a red square moving left", num_inference_steps=2, height=32, width=32, num_frames=9,
                  generator=torch.Generator().manual_seed(0), output_type="np").frames
    assert out.shape == (1, 9, 32, 32, 3) and np.isfinite(out).all()


def test_shipped_vae_roundtrip_keeps_properties(shipped):
    """A clip from the data generator, through the shipped VAE, still measures as its own prompt."""
    from diffuse.train.trainer import to_video_tensor

    rng = np.random.default_rng(3)
    combos = heldout_combos()
    clips = np.stack([render_clip(*c, rng=rng) for c in combos])
    with torch.no_grad():
        z = shipped.vae.encode(to_video_tensor(clips)).latent_dist.mode()
        rec = shipped.vae.decode(z).sample
    rec = ((rec.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 4, 1).numpy()
    ms = [matches(make_prompt(*c), r) for c, r in zip(combos, rec)]
    # motion survives the VAE always; colour mostly (its errors are blue <-> cyan)
    assert all(m["motion"] for m in ms), [measure(r) for r in rec]
    assert np.mean([m["colour"] for m in ms]) >= 0.6, [measure(r)["rgb"] for r in rec]
