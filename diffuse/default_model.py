"""The embedded default model, and a builder for tiny random-weight Wan pipelines.

``default_model_dir()`` is tiny-wan-shapes: a Wan 2.1-architecture text-to-video
model trained in this repository (``python -m diffuse.train``) and shipped in
the package, so a fresh install generates something real with no network.

``build_tiny_wan()`` writes a seeded random-weight Wan pipeline (4 blocks,
AutoencoderKLWan, a small UMT5 text encoder, a word-level tokenizer) for tests
that need a Wan of their own. Keep its runs small: 16 or 32 px and 9 frames
(the pipeline's own defaults are 480x832, 81 frames).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["SHIPPED_MODEL_NAME", "build_tiny_wan", "default_model_dir"]

SHIPPED_MODEL_NAME = "tiny-wan-shapes"
# call defaults written beside a built model: the size these tiny models are made for
CALL_DEFAULTS = {"height": 32, "width": 32, "num_frames": 9, "num_inference_steps": 20}


def build_tiny_wan(out_dir: str, seed: int = 0) -> str:
    """Build the tiny Wan pipeline with weights seeded by ``seed``, save it
    (safetensors) into ``out_dir`` and return ``out_dir``.

    Configs follow diffusers' own Wan test (tests/pipelines/wan/test_wan.py),
    with 4 transformer blocks instead of 2 and UMT5 (what WanPipeline declares)
    instead of T5.
    """
    import torch
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from diffuse.tiny_tokenizers import build_word_tokenizer

    tokenizer = build_word_tokenizer("t5")
    torch.manual_seed(seed)
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer),
            d_model=32,
            d_kv=8,
            d_ff=37,
            num_heads=4,
            num_layers=2,
            relative_attention_num_buckets=8,
            feed_forward_proj="gated-gelu",
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id,
        )
    )
    torch.manual_seed(seed)
    vae = AutoencoderKLWan(
        base_dim=3,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    )
    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=256,
        ffn_dim=32,
        num_layers=4,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    torch.manual_seed(seed)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=7.0)
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        transformer=transformer,
        vae=vae,
        scheduler=scheduler,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
    with open(os.path.join(out_dir, "diffuse_defaults.json"), "w") as f:
        json.dump(CALL_DEFAULTS, f)
    return out_dir


def default_model_dir() -> str:
    """The embedded default: tiny-wan-shapes, trained here and shipped inside the package.

    See ``diffuse/trained/tiny-wan-shapes/README.md`` (its model card) and
    ``python -m diffuse.train`` (the command that made it).
    """
    path = Path(__file__).resolve().parent / "trained" / SHIPPED_MODEL_NAME
    if not (path / "model_index.json").is_file():
        from diffuse.errors import DiffuseError

        raise DiffuseError(f"the embedded model is missing from {path}: reinstall diffuse, or give --model")
    return str(path)
