"""Tiny pipelines for every diffusers DiT family, built offline, plus odd ones.

``build(name, out_dir)`` writes a seeded random-weight pipeline with
``save_pretrained`` (safetensors) and returns the folder; ``call_args(name)``
gives JSON-serializable keyword arguments for a fast deterministic run (pass
the seed separately as ``generator=torch.Generator("cpu").manual_seed(seed)``);
``expected_shape(name)`` is the shape of the array such a run returns with
``output_type="np"``.

Configs follow the dummy components of diffusers' own test suites
(tests/pipelines/<family>/test_*.py), with every hub tokenizer or text-encoder
config replaced by one built in code (FACTS-diffusers.md, "How components were
built"), and 3-4 blocks in each main stack so a 3-node split gives every node
one. Each builder's docstring names the FACTS traps its model exercises.

``FAMILIES`` are the models Diffuse must split bit-exactly. ``EXTRAS`` are for
refusal and genericity tests: ``sdxl`` (a U-Net), ``odd`` (a non-diffusers DiT,
see tests/oddmodel), ``remote_code`` (needs trust_remote_code), ``no_stack``
and ``recurrent`` (nothing to split), ``wan22`` (two denoiser components).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

FAMILIES = [
    "wan",
    "flux",
    "sd3",
    "pixart_sigma",
    "sana",
    "ltx",
    "cogvideox",
    "cogvideox_rope",
    "mochi",
    "hunyuan_video",
    "stable_audio",
    "qwenimage",
]
EXTRAS = ["sdxl", "odd", "remote_code", "no_stack", "recurrent", "wan22", "wan_vace"]

_PROMPT = "a painting of a squirrel eating a burger"
_NEGATIVE = "bad quality , blurry"


# --------------------------------------------------------------------------- #
# shared component helpers


def _seed(seed: int) -> None:
    import torch

    torch.manual_seed(seed)


def _tok(kind: str, **kw):
    from diffuse.train.tokenizers import build_word_tokenizer

    return build_word_tokenizer(kind, **kw)


def _t5(tokenizer, seed: int, d_model: int = 32):
    """T5 encoder shaped like hf-internal-testing/tiny-random-t5 (d_model 32)."""
    from transformers import T5Config, T5EncoderModel

    _seed(seed)
    return T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer),
            d_model=d_model,
            d_kv=8,
            d_ff=37,
            num_heads=4,
            num_layers=2,
            relative_attention_num_buckets=8,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id,
        )
    )


def _clip_config(tokenizer, hidden_size: int = 32, projection_dim: int = 32):
    """The test suites' CLIPTextConfig, with token ids taken from our tokenizer
    (eos is not 2, so CLIP pools at the first eos, not at argmax(id))."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        hidden_size=hidden_size,
        intermediate_size=37,
        layer_norm_eps=1e-05,
        num_attention_heads=4,
        num_hidden_layers=2,
        vocab_size=len(tokenizer),
        hidden_act="gelu",
        projection_dim=projection_dim,
        max_position_embeddings=77,
    )


def _save(pipe, out_dir: str) -> str:
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return str(out_dir)


# --------------------------------------------------------------------------- #
# the DiT families


def build_wan(out_dir: str, seed: int = 0) -> str:
    """Wan 2.1 (the builder the shipped model was trained from, at its 4-block test size).

    Traps: blocks called positionally, rotary as a (cos, sin) tuple; non-persistent
    ``rope.freqs_cos/sin`` stay on meta under ``torch.device('meta')``; last bits
    depend on the thread count; CFG runs as separate cond/uncond calls (b=1).
    """
    from diffuse.train.build import save_pipeline

    return save_pipeline(str(out_dir), "tiny", seed=seed)


def build_wan22(out_dir: str, seed: int = 0) -> str:
    """Wan 2.2 A14B layout: two denoiser components, ``transformer`` (high-noise expert) and ``transformer_2``
    (low-noise expert), each the tiny Wan's 4-block transformer with weights of its own; the pipeline picks one
    per step by timestep (``boundary_ratio`` 0.875: with 2 steps, step 1 runs the first, step 2 the second).

    Traps: ``model_index.json`` names two components holding block stacks; both are optional in
    ``WanPipeline.__init__`` (loaded from disk even when passed); the second expert is first called at step 2.
    """
    from diffusers import WanPipeline

    from diffuse.train.build import build_pipeline, build_transformer

    pipe = build_pipeline("tiny", seed)
    second = build_transformer("tiny", pipe.vae.config.z_dim, pipe.text_encoder.config.d_model, seed + 3)
    pipe = WanPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae,
                       transformer=pipe.transformer, transformer_2=second, scheduler=pipe.scheduler,
                       boundary_ratio=0.875)
    return _save(pipe, out_dir)


def build_wan_vace(out_dir: str, seed: int = 0) -> str:
    """Wan VACE (WanVACEPipeline): the tiny Wan's components with a WanVACETransformer3DModel of the same
    size, its side stack ``vace_blocks`` (2 blocks) feeding hints into main blocks 0 and 2.

    Traps: the denoiser adds each hint to the hidden state after its main block (work between the blocks
    of ``blocks``), and collects the output of every ``vace_blocks`` block, not only the last."""
    from diffusers import WanVACEPipeline, WanVACETransformer3DModel

    from diffuse.train.build import SIZES, build_pipeline

    pipe = build_pipeline("tiny", seed)
    z_dim, spatial = pipe.vae.config.z_dim, 2 ** len(pipe.vae.config.temperal_downsample)
    _seed(seed + 2)
    transformer = WanVACETransformer3DModel(
        patch_size=(1, 2, 2), in_channels=z_dim, out_channels=z_dim, text_dim=pipe.text_encoder.config.d_model,
        freq_dim=128, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=32,
        vace_layers=[0, 2], vace_in_channels=2 * z_dim + spatial ** 2, **SIZES["tiny"]["transformer"])
    pipe = WanVACEPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae,
                           transformer=transformer, scheduler=pipe.scheduler)
    return _save(pipe, out_dir)


def build_flux(out_dir: str, seed: int = 0) -> str:
    """Flux.1: two stacks (3 double + 3 single blocks).

    Traps: keyword calls with ``joint_attention_kwargs={}``; both block types
    return ``(encoder_hidden_states, hidden_states)`` (reversed), including the
    double -> single hand-off; ``guidance_embeds=False`` so ``guidance=None``;
    CFG only via ``true_cfg_scale`` + ``negative_prompt`` (separate calls, b=1).
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    tokenizer, tokenizer_2 = _tok("clip"), _tok("t5")
    _seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=3,
        num_single_layers=3,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
    )
    _seed(seed)
    text_encoder = CLIPTextModel(_clip_config(tokenizer))
    text_encoder_2 = _t5(tokenizer_2, seed)
    _seed(seed)
    vae = AutoencoderKL(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        block_out_channels=(4,),
        layers_per_block=1,
        latent_channels=1,
        norm_num_groups=1,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
        vae=vae,
        image_encoder=None,
        feature_extractor=None,
    )
    return _save(pipe, out_dir)


def build_sd3(out_dir: str, seed: int = 0) -> str:
    """Stable Diffusion 3.

    Traps: the last block has ``context_pre_only`` and returns
    ``(None, hidden_states)``; the text sequence is 77 (CLIP) + T5 tokens; CFG
    concatenates cond and uncond (b=2); last bits depend on the thread count.
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection

    tokenizer, tokenizer_2, tokenizer_3 = _tok("clip"), _tok("clip"), _tok("t5")
    _seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=32,
        patch_size=1,
        in_channels=4,
        num_layers=4,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=32,
        pooled_projection_dim=64,
        out_channels=4,
    )
    _seed(seed)
    text_encoder = CLIPTextModelWithProjection(_clip_config(tokenizer))
    _seed(seed)
    text_encoder_2 = CLIPTextModelWithProjection(_clip_config(tokenizer_2))
    text_encoder_3 = _t5(tokenizer_3, seed)
    _seed(seed)
    vae = AutoencoderKL(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        block_out_channels=(4,),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=1,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )
    pipe = StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        text_encoder_3=text_encoder_3,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        tokenizer_3=tokenizer_3,
        transformer=transformer,
        vae=vae,
        image_encoder=None,
        feature_extractor=None,
    )
    return _save(pipe, out_dir)


def build_pixart_sigma(out_dir: str, seed: int = 0) -> str:
    """PixArt-Sigma.

    Traps: ``clean_caption=True`` (the default) wants bs4 + ftfy, so call_args
    passes False; ``hidden_states`` positional, the rest keywords with three
    Nones; non-persistent ``pos_embed.pos_embed`` stays on meta under
    ``torch.device('meta')``; ``AutoencoderKL()`` defaults (vae scale factor 1).
    """
    from diffusers import AutoencoderKL, DDIMScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel

    tokenizer = _tok("t5")
    _seed(seed)
    transformer = PixArtTransformer2DModel(
        sample_size=8,
        num_layers=4,
        patch_size=2,
        attention_head_dim=8,
        num_attention_heads=3,
        caption_channels=32,
        in_channels=4,
        cross_attention_dim=24,
        out_channels=8,
        attention_bias=True,
        activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000,
        norm_type="ada_norm_single",
        norm_elementwise_affine=False,
        norm_eps=1e-6,
    )
    _seed(seed)
    vae = AutoencoderKL()
    text_encoder = _t5(tokenizer, seed)
    pipe = PixArtSigmaPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=DDIMScheduler()
    )
    return _save(pipe, out_dir)


def build_sana(out_dir: str, seed: int = 0) -> str:
    """Sana.

    Traps: ``use_resolution_binning=True`` (the default) turns 32 px into 512 px,
    so call_args passes False; blocks take 7 positional args including python ints
    (post-patch height, width); linear-attention processor; last bits depend on
    the thread count. The test suite's Gemma2 has ``vocab_size=8`` (only the empty
    prompt fits); here the encoder is sized to the tokenizer instead.
    """
    from diffusers import AutoencoderDC, FlowMatchEulerDiscreteScheduler, SanaPipeline, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    tokenizer = _tok("gemma")
    _seed(seed)
    transformer = SanaTransformer2DModel(
        patch_size=1,
        in_channels=4,
        out_channels=4,
        num_layers=4,
        num_attention_heads=2,
        attention_head_dim=4,
        num_cross_attention_heads=2,
        cross_attention_head_dim=4,
        cross_attention_dim=8,
        caption_channels=8,
        sample_size=32,
    )
    _seed(seed)
    vae = AutoencoderDC(
        in_channels=3,
        latent_channels=4,
        attention_head_dim=2,
        encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8),
        encoder_qkv_multiscales=((), (5,)),
        decoder_qkv_multiscales=((), (5,)),
        encoder_layers_per_block=(1, 1),
        decoder_layers_per_block=[1, 1],
        downsample_block_type="conv",
        upsample_block_type="interpolate",
        decoder_norm_types="rms_norm",
        decoder_act_fns="silu",
        scaling_factor=0.41407,
    )
    _seed(seed)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=7.0)
    _seed(seed)
    text_encoder = Gemma2Model(
        Gemma2Config(
            head_dim=16,
            hidden_size=8,
            initializer_range=0.02,
            intermediate_size=64,
            max_position_embeddings=8192,
            num_attention_heads=2,
            num_hidden_layers=1,
            num_key_value_heads=2,
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            attn_implementation="eager",
        )
    )
    pipe = SanaPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler
    )
    return _save(pipe, out_dir)


def build_ltx(out_dir: str, seed: int = 0) -> str:
    """LTX-Video.

    Traps: keyword calls; rotary (cos, sin) computed inside ``transformer.forward``
    with a batch dimension; float attention-mask bias.
    """
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXPipeline, LTXVideoTransformer3DModel

    tokenizer = _tok("t5")
    _seed(seed)
    transformer = LTXVideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=4,
        attention_head_dim=8,
        cross_attention_dim=32,
        num_layers=4,
        caption_channels=32,
    )
    _seed(seed)
    vae = AutoencoderKLLTXVideo(
        latent_channels=8,
        block_out_channels=(8, 8, 8, 8),
        spatio_temporal_scaling=(True, True, False, False),
        layers_per_block=(1, 1, 1, 1, 1),
        # The test suite's encoder-only settings leave the decoder at full size
        # (3 upscalings, 512 channels): 17x64x64 out and ~12 s a run.
        decoder_block_out_channels=(8, 8, 8, 8),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        decoder_spatio_temporal_scaling=(True, True, False, False),
        patch_size=1,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    )
    _seed(seed)
    text_encoder = _t5(tokenizer, seed)
    pipe = LTXPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    return _save(pipe, out_dir)


def _cogvideox(out_dir: str, seed: int, rope: bool) -> str:
    from diffusers import AutoencoderKLCogVideoX, CogVideoXPipeline, CogVideoXTransformer3DModel, DDIMScheduler

    tokenizer = _tok("t5")
    _seed(seed)
    transformer = CogVideoXTransformer3DModel(
        # heads * head_dim = 32 = the T5 width; RoPE needs head_dim % 16 == 0.
        num_attention_heads=2 if rope else 4,
        attention_head_dim=16 if rope else 8,
        in_channels=4,
        out_channels=4,
        time_embed_dim=2,
        text_embed_dim=32,
        num_layers=4,
        sample_width=2,
        sample_height=2,
        sample_frames=9,
        patch_size=2,
        temporal_compression_ratio=4,
        max_text_seq_length=16,
        use_rotary_positional_embeddings=rope,
    )
    _seed(seed)
    vae = AutoencoderKLCogVideoX(
        in_channels=3,
        out_channels=3,
        down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=2,
        temporal_compression_ratio=4,
    )
    _seed(seed)
    text_encoder = _t5(tokenizer, seed)
    pipe = CogVideoXPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=DDIMScheduler()
    )
    return _save(pipe, out_dir)


def build_cogvideox(out_dir: str, seed: int = 0) -> str:
    """CogVideoX 1.0 (sincos positions).

    Traps: blocks return ``(hidden_states, encoder_hidden_states)`` (not
    reversed); the text length must equal ``max_text_seq_length`` (16, so
    call_args passes ``max_sequence_length=16``); non-persistent
    ``patch_embed.pos_embedding`` stays on meta under ``torch.device('meta')``.
    """
    return _cogvideox(out_dir, seed, rope=False)


def build_cogvideox_rope(out_dir: str, seed: int = 0) -> str:
    """CogVideoX with 3D RoPE.

    Traps: ``attention_head_dim % 16 == 0`` or ``get_1d_rotary_pos_embed``
    asserts; the rotary tables are computed by the *pipeline* and passed into
    ``transformer.forward`` as ``image_rotary_emb``.
    """
    return _cogvideox(out_dir, seed, rope=True)


def build_mochi(out_dir: str, seed: int = 0) -> str:
    """Mochi.

    Traps: blocks return ``(hidden_states, encoder_hidden_states)`` and the last
    block (context_pre_only) returns the very same ``encoder_hidden_states``
    object it got; ``MochiAttention`` is a plain nn.Module with a processor but no
    ``set_processor``; harmless "In CPU autocast" warning; bool attention mask.
    """
    from diffusers import AutoencoderKLMochi, FlowMatchEulerDiscreteScheduler, MochiPipeline, MochiTransformer3DModel

    tokenizer = _tok("t5")
    _seed(seed)
    transformer = MochiTransformer3DModel(
        patch_size=2,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=4,
        pooled_projection_dim=16,
        in_channels=12,
        out_channels=None,
        qk_norm="rms_norm",
        text_embed_dim=32,
        time_embed_dim=4,
        activation_fn="swiglu",
        max_sequence_length=16,
    )
    _seed(seed)
    vae = AutoencoderKLMochi(
        latent_channels=12,
        out_channels=3,
        encoder_block_out_channels=(32, 32, 32, 32),
        decoder_block_out_channels=(32, 32, 32, 32),
        layers_per_block=(1, 1, 1, 1, 1),
    )
    _seed(seed)
    text_encoder = _t5(tokenizer, seed)
    pipe = MochiPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    return _save(pipe, out_dir)


def build_hunyuan_video(out_dir: str, seed: int = 0) -> str:
    """HunyuanVideo: two stacks (3 double + 3 single) and a nested token refiner.

    Traps: both block types take 7 positional args (an int and a None land in
    ``*args``); the rotary parameter is ``freqs_cis`` in double blocks and
    ``image_rotary_emb`` in single blocks; ``num_refiner_layers`` sizes the nested
    ``context_embedder.token_refiner.refiner_blocks``; the Llama template needs
    ``prompt_template={"template": "{}", "crop_start": 0}``; ``guidance`` is a
    tensor (``guidance_embeds=True``); the pipeline reads ``hidden_states[-3]``:
    with 3 Llama layers, the first layer's output (an inner layer); real CFG only with ``true_cfg_scale``.
    """
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideoPipeline,
        HunyuanVideoTransformer3DModel,
    )
    from transformers import CLIPTextModel, LlamaConfig, LlamaModel

    tokenizer, tokenizer_2 = _tok("llama"), _tok("clip")
    _seed(seed)
    transformer = HunyuanVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=10,
        num_layers=3,
        num_single_layers=3,
        num_refiner_layers=1,
        patch_size=1,
        patch_size_t=1,
        guidance_embeds=True,
        text_embed_dim=16,
        pooled_projection_dim=8,
        rope_axes_dim=(2, 4, 4),
    )
    _seed(seed)
    vae = AutoencoderKLHunyuanVideo(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        act_fn="silu",
        norm_num_groups=4,
        scaling_factor=0.476986,
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
        mid_block_add_attention=True,
    )
    _seed(seed)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=7.0)
    _seed(seed)
    text_encoder = LlamaModel(
        LlamaConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            hidden_size=16,
            intermediate_size=37,
            num_attention_heads=4,
            num_hidden_layers=3,
            vocab_size=len(tokenizer),
            hidden_act="gelu",
        )
    )
    _seed(seed)
    text_encoder_2 = CLIPTextModel(_clip_config(tokenizer_2, hidden_size=8))
    pipe = HunyuanVideoPipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        vae=vae,
        scheduler=scheduler,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
    )
    return _save(pipe, out_dir)


def build_stable_audio(out_dir: str, seed: int = 0) -> str:
    """Stable Audio Open.

    Traps: the test's ``CosineDPMSolverMultistepScheduler`` needs torchsde; the
    rotary tables are computed by the *pipeline* (``rotary_embedding=``); the
    output is audio (B, channels, samples) and only this VAE has
    ``config.sampling_rate``; a global token is prepended to the 4 latent tokens;
    last bits depend on the thread count.
    """
    from diffusers import (
        AutoencoderOobleck,
        CosineDPMSolverMultistepScheduler,
        StableAudioDiTModel,
        StableAudioPipeline,
        StableAudioProjectionModel,
    )

    tokenizer = _tok("t5", model_max_length=25)
    _seed(seed)
    transformer = StableAudioDiTModel(
        sample_size=4,
        in_channels=3,
        num_layers=4,
        attention_head_dim=4,
        num_key_value_attention_heads=2,
        out_channels=3,
        cross_attention_dim=4,
        time_proj_dim=8,
        global_states_input_dim=8,
        cross_attention_input_dim=4,
    )
    scheduler = CosineDPMSolverMultistepScheduler(
        solver_order=2, prediction_type="v_prediction", sigma_data=1.0, sigma_schedule="exponential"
    )
    _seed(seed)
    vae = AutoencoderOobleck(
        encoder_hidden_size=6,
        downsampling_ratios=[1, 2],
        decoder_channels=3,
        decoder_input_channels=3,
        audio_channels=2,
        channel_multiples=[2, 4],
        sampling_rate=4,
    )
    text_encoder = _t5(tokenizer, seed)
    _seed(seed)
    projection_model = StableAudioProjectionModel(
        text_encoder_dim=text_encoder.config.d_model, conditioning_dim=4, min_value=0, max_value=32
    )
    pipe = StableAudioPipeline(
        vae=vae,
        text_encoder=text_encoder,
        projection_model=projection_model,
        tokenizer=tokenizer,
        transformer=transformer,
        scheduler=scheduler,
    )
    return _save(pipe, out_dir)


def build_qwenimage(out_dir: str, seed: int = 0) -> str:
    """QwenImage.

    Traps: rotary tables are *complex64* tuples; ``pos_embed.pos_freqs/neg_freqs``
    are plain tensor attributes (not buffers), so ``torch.device('meta')`` builds
    cannot be filled; CFG only with ``true_cfg_scale > 1`` and a negative prompt
    (separate calls, b=1); the pipeline drops the first 34 tokens of its chat
    template (the qwen word tokenizer keeps that count). The test suite's text
    encoder has a 152064-word vocabulary; here it is sized to the tokenizer.
    """
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = _tok("qwen")
    _seed(seed)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=4,
        attention_head_dim=16,
        num_attention_heads=3,
        joint_attention_dim=16,
        guidance_embeds=False,
        axes_dims_rope=(8, 4, 4),
    )
    _seed(seed)
    z_dim = 4
    vae = AutoencoderKLQwenImage(
        base_dim=z_dim * 6,
        z_dim=z_dim,
        dim_mult=[1, 2, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    )
    _seed(seed)
    vocab = 256  # > len(tokenizer); the image token ids below are never used for text
    config = Qwen2_5_VLConfig(
        text_config={
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "vocab_size": vocab,
            "bos_token_id": None,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
            "rope_theta": 1000000.0,
        },
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16},
        hidden_size=16,
        vocab_size=vocab,
        vision_start_token_id=vocab - 4,
        vision_end_token_id=vocab - 3,
        vision_token_id=vocab - 2,
        image_token_id=vocab - 1,
        video_token_id=vocab - 2,
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    return _save(pipe, out_dir)


# --------------------------------------------------------------------------- #
# extras: refusals and genericity


def build_sdxl(out_dir: str, seed: int = 0) -> str:
    """Stable Diffusion XL: the denoiser is a U-Net (skip connections cross
    resolutions; nothing is a chain of blocks), so Diffuse must refuse it.
    Last bits depend on the thread count."""
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    tokenizer, tokenizer_2 = _tok("clip"), _tok("clip")
    _seed(seed)
    unet = UNet2DConditionModel(
        block_out_channels=(2, 4),
        layers_per_block=2,
        sample_size=32,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        transformer_layers_per_block=(1, 2),
        projection_class_embeddings_input_dim=80,  # 6 * 8 + 32
        cross_attention_dim=64,
        norm_num_groups=1,
    )
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        steps_offset=1,
        beta_schedule="scaled_linear",
        timestep_spacing="leading",
    )
    _seed(seed)
    vae = AutoencoderKL(
        block_out_channels=[32, 64],
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
        up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"],
        latent_channels=4,
        sample_size=128,
    )
    _seed(seed)
    text_encoder = CLIPTextModel(_clip_config(tokenizer))
    _seed(seed)
    text_encoder_2 = CLIPTextModelWithProjection(_clip_config(tokenizer_2))
    pipe = StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        unet=unet,
        scheduler=scheduler,
        image_encoder=None,
        feature_extractor=None,
    )
    return _save(pipe, out_dir)


def _oddmodel():
    if _TESTS_DIR not in sys.path:
        sys.path.insert(0, _TESTS_DIR)
    import oddmodel

    return oddmodel


def _odd_pipeline(transformer, out_dir: str, seed: int) -> str:
    from diffusers import FlowMatchEulerDiscreteScheduler

    odd = _oddmodel()
    # 7 text tokens: never equal to an image-token count (a product of two
    # whole numbers (H/4)(W/4) equals 7 only at 4x28 px).
    tokenizer = _tok("t5", model_max_length=7)
    _seed(seed)
    text_encoder = odd.OddTextEncoder(vocab_size=len(tokenizer), dim=16)
    pipe = odd.OddPipeline(
        transformer=transformer,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )
    return _save(pipe, out_dir)


def build_odd(out_dir: str, seed: int = 0) -> str:
    """A DiT from outside diffusers (tests/oddmodel): stack nested at
    ``transformer.trunk.layers`` (4 blocks), blocks called with keywords in odd
    order with a float and a dict, returning a reversed ``(context, x)`` pair of
    streams with different token counts (7 text, 16 image at 16x16 px).

    Trap: loading needs ``import oddmodel`` first (FACTS, last section): the
    component library is looked up in sys.modules and must expose ModelMixin,
    and the pipeline class is resolved on ``diffusers``.
    """
    odd = _oddmodel()
    _seed(seed)
    return _odd_pipeline(odd.OddTransformer(num_blocks=4), out_dir, seed)


def build_no_stack(out_dir: str, seed: int = 0) -> str:
    """A denoiser with no ModuleList of repeated blocks (two Linear layers):
    nothing to split, so Diffuse must refuse it. Loads like ``odd``."""
    odd = _oddmodel()
    _seed(seed)
    return _odd_pipeline(odd.NoStackTransformer(), out_dir, seed)


def build_recurrent(out_dir: str, seed: int = 0) -> str:
    """A denoiser whose "stack" ``layers`` is one block object held 4 times
    (weights saved once, as ``block.*``): a list of repeated blocks by shape,
    but there are no separate blocks to hand out. Loads like ``odd``."""
    odd = _oddmodel()
    _seed(seed)
    return _odd_pipeline(odd.RecurrentTransformer(num_repeats=4), out_dir, seed)


_REMOTE_PIPELINE = '''
"""Custom pipeline shipped inside the checkpoint: loading it runs this file."""
import torch
from diffusers import DiffusionPipeline
from diffusers.pipelines.pipeline_utils import ImagePipelineOutput


class RemoteDiTPipeline(DiffusionPipeline):
    def __init__(self, transformer, scheduler):
        super().__init__()
        self.register_modules(transformer=transformer, scheduler=scheduler)

    @torch.no_grad()
    def __call__(self, prompt=None, num_inference_steps=2, generator=None, output_type="np"):
        latents = torch.randn((1, 4, 8, 8), generator=generator)
        self.scheduler.set_timesteps(num_inference_steps)
        for t in self.scheduler.timesteps:
            latents = self.scheduler.step(self.transformer(latents), t, latents).prev_sample
        images = (latents[:, :3].permute(0, 2, 3, 1) * 0.5 + 0.5).clamp(0, 1)
        return ImagePipelineOutput(images=images.numpy())
'''

_REMOTE_MODEL = '''
"""Custom denoiser shipped inside the checkpoint: loading it runs this file."""
import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config


class RemoteDiTTransformer(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, channels: int = 4, num_layers: int = 4):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Conv2d(channels, channels, 1) for _ in range(num_layers)])

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x
'''


def build_remote_code(out_dir: str, seed: int = 0) -> str:
    """A checkpoint whose model_index.json names a pipeline and a transformer
    class defined in .py files shipped inside it (``pipeline_remote.py``,
    ``transformer/modeling_remote.py``): loading it means running the
    checkpoint's code. Plain ``DiffusionPipeline.from_pretrained`` raises
    ValueError ("contains custom code ... Pass `trust_remote_code=True`"); with
    ``trust_remote_code=True`` it loads and runs. Diffuse must refuse it."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler
    from safetensors.torch import save_file

    out = Path(out_dir)
    (out / "transformer").mkdir(parents=True, exist_ok=True)
    (out / "pipeline_remote.py").write_text(_REMOTE_PIPELINE.lstrip())
    (out / "transformer" / "modeling_remote.py").write_text(_REMOTE_MODEL.lstrip())
    (out / "model_index.json").write_text(
        json.dumps(
            {
                "_class_name": ["pipeline_remote", "RemoteDiTPipeline"],
                "_diffusers_version": "0.42.1",
                "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
                "transformer": ["modeling_remote", "RemoteDiTTransformer"],
            },
            indent=2,
        )
    )
    (out / "transformer" / "config.json").write_text(
        json.dumps(
            {"_class_name": "RemoteDiTTransformer", "_diffusers_version": "0.42.1", "channels": 4, "num_layers": 4},
            indent=2,
        )
    )
    gen = torch.Generator("cpu").manual_seed(seed)
    weights = {}
    for i in range(4):
        weights[f"blocks.{i}.weight"] = torch.randn(4, 4, 1, 1, generator=gen) * 0.1
        weights[f"blocks.{i}.bias"] = torch.zeros(4)
    save_file(weights, str(out / "transformer" / "diffusion_pytorch_model.safetensors"))
    FlowMatchEulerDiscreteScheduler().save_pretrained(str(out / "scheduler"))
    return str(out)


_BUILDERS = {
    "wan": build_wan,
    "wan22": build_wan22,
    "wan_vace": build_wan_vace,
    "flux": build_flux,
    "sd3": build_sd3,
    "pixart_sigma": build_pixart_sigma,
    "sana": build_sana,
    "ltx": build_ltx,
    "cogvideox": build_cogvideox,
    "cogvideox_rope": build_cogvideox_rope,
    "mochi": build_mochi,
    "hunyuan_video": build_hunyuan_video,
    "stable_audio": build_stable_audio,
    "qwenimage": build_qwenimage,
    "sdxl": build_sdxl,
    "odd": build_odd,
    "remote_code": build_remote_code,
    "no_stack": build_no_stack,
    "recurrent": build_recurrent,
}


def build(name: str, out_dir: str, seed: int = 0) -> str:
    """Build tiny pipeline ``name`` (a FAMILIES or EXTRAS entry) into ``out_dir``."""
    if name not in _BUILDERS:
        raise KeyError(f"no tiny pipeline {name!r}; known: {', '.join(_BUILDERS)}")
    return _BUILDERS[name](str(out_dir), seed=seed)


# --------------------------------------------------------------------------- #
# call arguments and expected outputs

_VIDEO = dict(prompt="dance monkey", negative_prompt=_NEGATIVE, num_inference_steps=2, max_sequence_length=16)
_ODD = dict(prompt=_PROMPT, negative_prompt=_NEGATIVE, num_inference_steps=2, guidance_scale=4.0, height=16, width=16)

_CALL_ARGS: dict[str, dict] = {
    "wan": dict(_VIDEO, guidance_scale=6.0, height=32, width=32, num_frames=9),
    "wan22": dict(_VIDEO, guidance_scale=6.0, guidance_scale_2=4.0, height=32, width=32, num_frames=9),
    "wan_vace": dict(_VIDEO, guidance_scale=6.0, height=32, width=32, num_frames=9),
    # guidance_scale does nothing (guidance_embeds=False); true_cfg_scale is real CFG.
    "flux": dict(
        prompt=_PROMPT,
        negative_prompt=_NEGATIVE,
        true_cfg_scale=2.0,
        num_inference_steps=2,
        height=16,
        width=16,
        max_sequence_length=48,
    ),
    "sd3": dict(
        prompt=_PROMPT,
        negative_prompt=_NEGATIVE,
        num_inference_steps=2,
        guidance_scale=5.0,
        height=16,
        width=16,
        max_sequence_length=16,
    ),
    "pixart_sigma": dict(
        prompt=_PROMPT,
        negative_prompt=_NEGATIVE,
        num_inference_steps=2,
        guidance_scale=5.0,
        height=16,
        width=16,
        max_sequence_length=16,
        clean_caption=False,
        use_resolution_binning=False,
    ),
    "sana": dict(
        prompt=_PROMPT,
        negative_prompt=_NEGATIVE,
        num_inference_steps=2,
        guidance_scale=6.0,
        height=32,
        width=32,
        max_sequence_length=16,
        complex_human_instruction=None,
        use_resolution_binning=False,
    ),
    "ltx": dict(_VIDEO, guidance_scale=3.0, height=32, width=32, num_frames=9),
    "cogvideox": dict(_VIDEO, guidance_scale=6.0, height=16, width=16, num_frames=8),
    "cogvideox_rope": dict(_VIDEO, guidance_scale=6.0, height=16, width=16, num_frames=8),
    "mochi": dict(_VIDEO, guidance_scale=4.5, height=16, width=16, num_frames=7),
    # guidance_scale feeds the guidance embedding; true_cfg_scale is real CFG.
    "hunyuan_video": dict(
        _VIDEO,
        guidance_scale=4.5,
        true_cfg_scale=2.0,
        height=16,
        width=16,
        num_frames=9,
        prompt_template={"template": "{}", "crop_start": 0},
    ),
    "stable_audio": dict(
        prompt="a hammer hitting a wooden surface",
        negative_prompt=_NEGATIVE,
        num_inference_steps=2,
        guidance_scale=6.0,
        audio_end_in_s=1.5,
    ),
    "qwenimage": dict(
        prompt="dance monkey",
        negative_prompt=_NEGATIVE,
        true_cfg_scale=2.0,
        num_inference_steps=2,
        height=32,
        width=32,
        max_sequence_length=16,
    ),
    "sdxl": dict(
        prompt=_PROMPT, negative_prompt=_NEGATIVE, num_inference_steps=2, guidance_scale=5.0, height=32, width=32
    ),
    "odd": dict(_ODD),
    "no_stack": dict(_ODD),
    "recurrent": dict(_ODD),
    "remote_code": dict(prompt=_PROMPT, num_inference_steps=2),
}

_EXPECTED_SHAPES: dict[str, tuple] = {
    "wan": (1, 9, 32, 32, 3),
    "wan22": (1, 9, 32, 32, 3),
    "flux": (1, 16, 16, 3),
    "sd3": (1, 16, 16, 3),
    "pixart_sigma": (1, 16, 16, 3),
    "sana": (1, 32, 32, 3),
    "ltx": (1, 9, 32, 32, 3),
    "cogvideox": (1, 8, 16, 16, 3),
    "cogvideox_rope": (1, 8, 16, 16, 3),
    "mochi": (1, 7, 16, 16, 3),
    "hunyuan_video": (1, 9, 16, 16, 3),
    "stable_audio": (1, 2, 6),  # 1.5 s at sampling_rate 4, 2 channels
    "qwenimage": (1, 32, 32, 3),
    "sdxl": (1, 32, 32, 3),
    "odd": (1, 16, 16, 3),
    "no_stack": (1, 16, 16, 3),
    "recurrent": (1, 16, 16, 3),
}


def call_args(name: str) -> dict:
    """JSON-serializable ``__call__`` kwargs for a fast deterministic run of
    ``name`` with classifier-free guidance on wherever the family has it.
    Add ``generator=torch.Generator("cpu").manual_seed(seed)`` and
    ``output_type="np"``."""
    if name not in _CALL_ARGS:
        raise KeyError(f"no call arguments for {name!r}; known: {', '.join(_CALL_ARGS)}")
    return json.loads(json.dumps(_CALL_ARGS[name]))


def expected_shape(name: str) -> tuple:
    """Shape of the array a ``call_args(name)`` run returns with output_type="np":
    image (1, H, W, 3), video (1, F, H, W, 3), audio (1, channels, samples)."""
    return _EXPECTED_SHAPES[name]


def output_kind(name: str) -> str:
    """"image", "video" or "audio" (by the rank of the expected output)."""
    shape = expected_shape(name)
    return {3: "audio", 4: "image", 5: "video"}[len(shape)]


__all__ = ["FAMILIES", "EXTRAS", "build", "call_args", "expected_shape", "output_kind"]


if __name__ == "__main__":  # python tests/families.py NAME OUT_DIR
    print(build(sys.argv[1], sys.argv[2]))
