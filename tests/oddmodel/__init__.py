"""A diffusion transformer unlike any diffusers family, shipped as its own package.

It proves that nothing in Diffuse knows family names:

- ``OddTransformer`` keeps its repeated blocks in a nested attribute,
  ``trunk.layers`` (``trunk`` is a plain container holding only that list);
- it calls each block with keyword arguments in an odd order, among them a
  python float and a dict:
  ``block(scale=0.5, context=enc, opts={"gate": True}, x=hidden, cond=temb)``;
- each block returns a reversed pair of two updated streams,
  ``(context_out, x_out)``; the text stream (``OddPipeline``: 7 tokens) and the
  image stream (16 tokens at 16x16 px) have different token counts.

Two deliberately unsplittable denoisers share the pipeline: ``NoStackTransformer``
(no list of repeated blocks at all) and ``RecurrentTransformer`` (one block
object applied N times, held N times in one ModuleList). Two read their first
block outside the loop: ``PeekingTransformer`` its plain attributes and weights'
shapes (served exactly by a split), ``ValueReadingTransformer`` a weight's values
(refused).

Importing this package registers ``OddPipeline`` on ``diffusers`` so that
``DiffusionPipeline.from_pretrained(dir)`` resolves a saved checkpoint, whose
model_index.json names this package (``["oddmodel", "OddTransformer"]``) as the
component library; the package exposes ``ModelMixin`` at module level because
diffusers looks up the load method there.

This module imports only torch, numpy and diffusers.
"""

from __future__ import annotations

import math

import diffusers
import numpy as np
import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, DiffusionPipeline, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.models.embeddings import TimestepEmbedding, Timesteps
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.pipelines.pipeline_utils import ImagePipelineOutput
from diffusers.utils.torch_utils import randn_tensor
from torch import nn

__all__ = [
    "ModelMixin",
    "OddBlock",
    "OddTrunk",
    "OddTransformer",
    "OddTextEncoder",
    "NoStackTransformer",
    "RecurrentTransformer",
    "PeekingTransformer",
    "ValueReadingTransformer",
    "OddPipeline",
]


class OddTextEncoder(ModelMixin, ConfigMixin):
    """Token embedding, one projection, a norm: (B, L) ids -> (B, L, dim)."""

    @register_to_config
    def __init__(self, vocab_size: int = 256, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        return self.norm(h + self.proj(F.gelu(h)))


class OddBlock(nn.Module):
    """Joint attention over (text, image) tokens, then one MLP per stream.

    Modulated by ``cond`` (the timestep embedding); ``scale`` (a float) scales
    the attention update, ``opts["gate"]`` switches a learned sigmoid gate on the
    image stream. Returns ``(context, x)``: text first, image second.
    """

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.mod = nn.Linear(dim, 4 * dim)
        self.norm_x = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.norm_c = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.gate = nn.Parameter(torch.zeros(dim))
        self.mlp_x = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.mlp_c = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, context, cond, scale: float = 1.0, opts: dict | None = None):
        opts = opts or {}
        shift_x, gain_x, shift_c, gain_c = self.mod(F.silu(cond)).chunk(4, dim=-1)
        hx = self.norm_x(x) * (1 + gain_x[:, None]) + shift_x[:, None]
        hc = self.norm_c(context) * (1 + gain_c[:, None]) + shift_c[:, None]
        joint = torch.cat([hc, hx], dim=1)
        b, n, d = joint.shape
        q, k, v = self.qkv(joint).view(b, n, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        attn_c, attn_x = self.out(attn).split([context.shape[1], x.shape[1]], dim=1)
        if opts.get("gate"):
            attn_x = attn_x * torch.sigmoid(self.gate)
        x = x + scale * attn_x
        context = context + scale * attn_c
        x = x + self.mlp_x(x)
        context = context + self.mlp_c(context)
        return context, x


class OddTrunk(nn.Module):
    """A plain container: the stack sits one attribute deeper than usual."""

    def __init__(self, num_blocks: int, dim: int, num_heads: int):
        super().__init__()
        self.layers = nn.ModuleList([OddBlock(dim, num_heads) for _ in range(num_blocks)])


def _patchify(latents: torch.Tensor, p: int) -> torch.Tensor:
    b, c, h, w = latents.shape
    x = latents.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // p) * (w // p), c * p * p)


def _unpatchify(tokens: torch.Tensor, c: int, h: int, w: int, p: int) -> torch.Tensor:
    b = tokens.shape[0]
    x = tokens.reshape(b, h // p, w // p, c, p, p).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)


def _token_positions(n: int, dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Sin/cos table over token index, (1, n, dim), on the tokens' device (as real models build theirs, so
    a weightless dry call on the meta device runs through): cheap, no buffers to save."""
    pos = torch.arange(n, dtype=torch.float32, device=device)[:, None]
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    table = torch.cat([torch.sin(pos * freq), torch.cos(pos * freq)], dim=-1)
    return table[None].to(dtype)


class _OddIO:
    """Patch embedding, timestep and text conditioning, output head (a mixin)."""

    def _init_io(self, in_channels: int, patch_size: int, dim: int, text_dim: int):
        self.patch_embed = nn.Linear(in_channels * patch_size * patch_size, dim)
        self.time_proj = Timesteps(64, flip_sin_to_cos=True, downscale_freq_shift=0)
        self.time_embed = TimestepEmbedding(64, dim)
        self.context_in = nn.Linear(text_dim, dim)
        self.norm_out = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.proj_out = nn.Linear(dim, in_channels * patch_size * patch_size)

    def _embed(self, hidden_states, encoder_hidden_states, timestep):
        p = self.config.patch_size
        x = self.patch_embed(_patchify(hidden_states, p))
        x = x + _token_positions(x.shape[1], x.shape[2], x.dtype, x.device)
        temb = self.time_embed(self.time_proj(timestep * 1000.0).to(x.dtype))
        enc = self.context_in(encoder_hidden_states)
        return x, enc, temb

    def _head(self, x, hidden_states, return_dict):
        b, c, h, w = hidden_states.shape
        out = _unpatchify(self.proj_out(self.norm_out(x)), c, h, w, self.config.patch_size)
        return Transformer2DModelOutput(sample=out) if return_dict else (out,)


class OddTransformer(ModelMixin, ConfigMixin, _OddIO):
    """Latents (B, C, H, W), text (B, L, text_dim), timestep in [0, 1] (B,) -> velocity."""

    @register_to_config
    def __init__(
        self,
        in_channels: int = 4,
        patch_size: int = 2,
        dim: int = 32,
        num_heads: int = 2,
        num_blocks: int = 4,
        text_dim: int = 16,
        block_scale: float = 0.5,
    ):
        super().__init__()
        self._init_io(in_channels, patch_size, dim, text_dim)
        self.trunk = OddTrunk(num_blocks, dim, num_heads)

    def forward(self, hidden_states, encoder_hidden_states, timestep, return_dict: bool = True):
        x, enc, temb = self._embed(hidden_states, encoder_hidden_states, timestep)
        for block in self.trunk.layers:
            enc, x = block(scale=self.config.block_scale, context=enc, opts={"gate": True}, x=x, cond=temb)
        return self._head(x, hidden_states, return_dict)


class PeekingTransformer(OddTransformer):
    """``OddTransformer`` reading its first block outside the loop, as models do to size or condition something:
    a plain attribute (``num_heads``), a submodule's (``qkv.in_features``), weights' shapes and dtype."""

    def forward(self, hidden_states, encoder_hidden_states, timestep, return_dict: bool = True):
        first = self.trunk.layers[0]
        heads, width = first.num_heads, first.qkv.in_features
        if tuple(first.qkv.weight.shape) != (3 * width, width) or first.gate.size(0) != width:
            raise ValueError("the first block is not the shape it was built with")
        x, enc, temb = self._embed(hidden_states.to(first.out.weight.dtype), encoder_hidden_states, timestep)
        temb = temb * (1.0 + heads / width)  # conditioned by what was read
        for block in self.trunk.layers:
            enc, x = block(scale=self.config.block_scale, context=enc, opts={"gate": True}, x=x, cond=temb)
        return self._head(x, hidden_states, return_dict)


class ValueReadingTransformer(OddTransformer):
    """``OddTransformer`` adding its first block's ``gate`` weights to the hidden state before the loop: values
    a split's client does not hold."""

    def forward(self, hidden_states, encoder_hidden_states, timestep, return_dict: bool = True):
        x, enc, temb = self._embed(hidden_states, encoder_hidden_states, timestep)
        x = x + self.trunk.layers[0].gate
        for block in self.trunk.layers:
            enc, x = block(scale=self.config.block_scale, context=enc, opts={"gate": True}, x=x, cond=temb)
        return self._head(x, hidden_states, return_dict)


class NoStackTransformer(ModelMixin, ConfigMixin, _OddIO):
    """No ModuleList of repeated blocks anywhere: two Linear layers do the work."""

    @register_to_config
    def __init__(self, in_channels: int = 4, patch_size: int = 2, dim: int = 32, text_dim: int = 16):
        super().__init__()
        self._init_io(in_channels, patch_size, dim, text_dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, hidden_states, encoder_hidden_states, timestep, return_dict: bool = True):
        x, enc, temb = self._embed(hidden_states, encoder_hidden_states, timestep)
        h = x + temb[:, None] + enc.mean(dim=1, keepdim=True)
        x = x + self.fc2(F.gelu(self.fc1(h)))
        return self._head(x, hidden_states, return_dict)


class RecurrentTransformer(ModelMixin, ConfigMixin, _OddIO):
    """One block applied ``num_repeats`` times. ``layers`` is a ModuleList that
    holds the very same block object ``num_repeats`` times: it looks like a stack
    but has one block's weights, so there is nothing to hand out in ranges."""

    @register_to_config
    def __init__(
        self,
        in_channels: int = 4,
        patch_size: int = 2,
        dim: int = 32,
        num_heads: int = 2,
        num_repeats: int = 4,
        text_dim: int = 16,
    ):
        super().__init__()
        self._init_io(in_channels, patch_size, dim, text_dim)
        self.block = OddBlock(dim, num_heads)
        self.layers = nn.ModuleList([self.block] * num_repeats)

    def state_dict(self, *args, **kwargs):
        # The aliases would make safetensors refuse to save shared tensors.
        sd = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        for key in [k for k in sd if k.startswith(prefix + "layers.")]:
            del sd[key]
        return sd

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        # A strict load walks layers.i.* too: give it the aliases of block.*.
        state_dict = dict(state_dict)
        for key in [k for k in state_dict if k.startswith("block.")]:
            for i in range(len(self.layers)):
                state_dict.setdefault(f"layers.{i}.{key[len('block.'):]}", state_dict[key])
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def forward(self, hidden_states, encoder_hidden_states, timestep, return_dict: bool = True):
        x, enc, temb = self._embed(hidden_states, encoder_hidden_states, timestep)
        for block in self.layers:
            enc, x = block(x=x, context=enc, cond=temb, scale=1.0, opts={})
        return self._head(x, hidden_states, return_dict)


def _decode_matrix(channels: int, patch: int) -> torch.Tensor:
    """A fixed (channels, 3 * patch * patch) map from latent to pixels: the 'VAE'."""
    idx = torch.arange(channels * 3 * patch * patch, dtype=torch.float32)
    return (torch.sin(idx * 0.7 + 0.3) * 0.25).reshape(channels, 3 * patch * patch)


class OddPipeline(DiffusionPipeline):
    """Text to image with any of this package's transformers.

    Classifier-free guidance runs as two separate transformer calls (cond, then
    uncond), each with batch 1. Latents are (1, C, H/2, W/2); a fixed linear map
    turns each latent pixel into a 2x2 block of RGB pixels.
    """

    model_cpu_offload_seq = "text_encoder->transformer"
    vae_scale_factor = 2

    def __init__(self, transformer, text_encoder, tokenizer, scheduler):
        super().__init__()
        self.register_modules(
            transformer=transformer, text_encoder=text_encoder, tokenizer=tokenizer, scheduler=scheduler
        )

    def encode_prompt(self, prompt: str | list[str]) -> torch.Tensor:
        prompt = [prompt] if isinstance(prompt, str) else list(prompt)
        ids = self.tokenizer(
            prompt,
            padding="max_length",
            max_length=self.tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        return self.text_encoder(ids.to(self.device))

    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        b, c, h, w = latents.shape
        s = self.vae_scale_factor
        weight = _decode_matrix(c, s).to(latents.device, latents.dtype)
        rgb = torch.einsum("bchw,ck->bhwk", latents, weight).reshape(b, h, w, 3, s, s)
        rgb = rgb.permute(0, 3, 1, 4, 2, 5).reshape(b, 3, h * s, w * s)
        return (rgb * 0.5 + 0.5).clamp(0, 1)

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str],
        negative_prompt: str | list[str] | None = None,
        num_inference_steps: int = 4,
        guidance_scale: float = 4.0,
        height: int = 16,
        width: int = 16,
        generator: torch.Generator | None = None,
        output_type: str = "np",
        return_dict: bool = True,
    ):
        multiple = self.vae_scale_factor * self.transformer.config.patch_size
        if height % multiple or width % multiple:
            raise ValueError(f"height and width must be multiples of {multiple}, got {height}x{width}")
        cond = self.encode_prompt(prompt)
        batch = cond.shape[0]
        do_cfg = guidance_scale > 1.0
        if do_cfg:
            negative_prompt = negative_prompt if negative_prompt is not None else ""
            if isinstance(negative_prompt, str):
                negative_prompt = [negative_prompt] * batch
            uncond = self.encode_prompt(negative_prompt)

        channels = self.transformer.config.in_channels
        shape = (batch, channels, height // self.vae_scale_factor, width // self.vae_scale_factor)
        latents = randn_tensor(shape, generator=generator, device=self.device, dtype=torch.float32)
        self.scheduler.set_timesteps(num_inference_steps, device=self.device)
        for t in self.progress_bar(self.scheduler.timesteps):
            timestep = (t / 1000.0).expand(batch).to(latents.dtype)
            velocity = self.transformer(hidden_states=latents, encoder_hidden_states=cond, timestep=timestep).sample
            if do_cfg:
                velocity_uncond = self.transformer(
                    hidden_states=latents, encoder_hidden_states=uncond, timestep=timestep
                ).sample
                velocity = velocity_uncond + guidance_scale * (velocity - velocity_uncond)
            latents = self.scheduler.step(velocity, t, latents, return_dict=False)[0]

        if output_type == "latent":
            images = latents
        else:
            images = self.decode_latents(latents)
            if output_type == "np":
                images = images.permute(0, 2, 3, 1).float().cpu().numpy().astype(np.float32)
            elif output_type == "pil":
                images = self.numpy_to_pil(images.permute(0, 2, 3, 1).float().cpu().numpy())
        self.maybe_free_model_hooks()
        if not return_dict:
            return (images,)
        return ImagePipelineOutput(images=images)


# DiffusionPipeline.from_pretrained resolves model_index.json's _class_name on diffusers.
setattr(diffusers, "OddPipeline", OddPipeline)
