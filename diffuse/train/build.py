"""The one builder of tiny Wan text-to-video pipelines, offline and seeded.

``full`` is what the shipped tiny-wan-shapes was trained from (it must keep
building the same weights bit for bit); ``quick`` is for the training test;
``tiny`` (4 blocks, 12 tokens at 32x32x9) is for tests that need a Wan of
their own to split: ``save_pipeline(out_dir, "tiny")``.
"""

from __future__ import annotations

import json
import os

from diffuse.home import libraries_offline  # noqa: E402

libraries_offline()

import torch

from diffuse.train.tokenizers import build_word_tokenizer

from .data import FRAMES, SIZE, WORDS

# ---- sizes -----------------------------------------------------------------

SIZES = {
    "full": dict(
        vae=dict(base_dim=16, z_dim=8, dim_mult=[1, 2, 4], num_res_blocks=1,
                 temperal_downsample=[True, True]),
        transformer=dict(num_attention_heads=4, attention_head_dim=48, ffn_dim=768, num_layers=4),
        text=dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4),
    ),
    "quick": dict(
        vae=dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                 temperal_downsample=[True, True]),
        transformer=dict(num_attention_heads=2, attention_head_dim=24, ffn_dim=96, num_layers=2),
        text=dict(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4),
    ),
    "tiny": dict(  # sized like the components of diffusers' own Wan test, with 4 blocks
        vae=dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                 temperal_downsample=[False, True, True]),
        transformer=dict(num_attention_heads=2, attention_head_dim=12, ffn_dim=32, num_layers=4),
        text=dict(d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4),
    ),
}


def build_tokenizer():
    """Word-level, T5 layout, over the prompt vocabulary: every word its own token."""
    return build_word_tokenizer("t5", WORDS)


def build_text_encoder(size: str, vocab_size: int, seed: int):
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    cfg = UMT5Config(vocab_size=vocab_size, relative_attention_num_buckets=8,
                     dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                     **SIZES[size]["text"])
    m = UMT5EncoderModel(cfg).eval()
    m.requires_grad_(False)
    return m


def build_vae(size: str, seed: int):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    c = dict(SIZES[size]["vae"])
    z = c["z_dim"]
    return AutoencoderKLWan(
        **c, attn_scales=[], latents_mean=[0.0] * z, latents_std=[1.0] * z,
        scale_factor_temporal=2 ** sum(c["temperal_downsample"]),
        scale_factor_spatial=2 ** len(c["temperal_downsample"]),
    )


def build_transformer(size: str, z_dim: int, text_dim: int, seed: int):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), in_channels=z_dim, out_channels=z_dim, text_dim=text_dim,
        freq_dim=128, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
        rope_max_seq_len=32, **SIZES[size]["transformer"],
    )


def build_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)


def build_pipeline(size: str = "full", seed: int = 0):
    """The whole pipeline with random weights (the 'untrained' baseline)."""
    from diffusers import WanPipeline

    tok = build_tokenizer()
    te = build_text_encoder(size, len(tok), seed)
    vae = build_vae(size, seed + 1)
    tr = build_transformer(size, vae.config.z_dim, te.config.d_model, seed + 2)
    return WanPipeline(tokenizer=tok, text_encoder=te, vae=vae, transformer=tr,
                       scheduler=build_scheduler())


GEN_KW = dict(height=SIZE, width=SIZE, num_frames=FRAMES)
# written beside a saved model: `diffuse run` then makes the size it was built for, not Wan's 480x832x81
CALL_DEFAULTS = dict(GEN_KW, num_inference_steps=20)


def save_pipeline(out_dir: str, size: str = "tiny", seed: int = 0) -> str:
    """``build_pipeline(size, seed)`` saved (safetensors) into ``out_dir`` with its call defaults; returns ``out_dir``."""
    build_pipeline(size, seed).save_pretrained(out_dir, safe_serialization=True)
    with open(os.path.join(out_dir, "diffuse_defaults.json"), "w") as f:
        json.dump(CALL_DEFAULTS, f)
    return str(out_dir)
