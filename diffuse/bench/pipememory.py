"""``python -m diffuse.bench memory --model wan2.1-14b|flux.1-dev``: a pipeline's client with its text encoders
on the client and on the ring, side by side.

The pipeline is built from configs at the real model's geometry with seeded random bf16 weights, into a temp
folder: its text encoders whole (Wan 2.1: UMT5-XXL's encoder, 24 layers, 10.6 GiB; Flux.1-dev: T5-v1.1-XXL's
encoder and CLIP-L's text model), its VAE whole, and the denoiser at its real width with its blocks cut to
``BLOCKS`` of each stack (Wan 2.1 14B has 40, Flux 19 double and 38 single): a client holds none of them, so
its figures are those of the real depth, and the nodes' are per block held. It is then run through
``diffuse.split`` over two local nodes, each client in a process of its own, two calls each (the first
learns what the stacks return; the second is timed): with ``--encoders client`` (the encoders whole on the
client; nodes holding the denoiser's blocks) and with ``--encoders ring`` (their layers split over nodes
started with ``--encoders ring``; the client keeps the tokenizer, the token table, mapped from the file, and
the final norm), alternating, ``ROUNDS`` rounds. Printed: each client's peak resident memory (VmHWM) and
each node's, each way's end-to-end time of a request with the ratio and its spread, and whether the images
or videos made each way are the same, bit for bit. Goals (issue 36): the client's peak with everything on the
ring <= 1.5 GiB at Wan 2.1 14B's geometry; end-to-end time within 5% of the encoder on the client.
Every process runs at ``THREADS`` torch threads. ``--quick``: tiny geometries, for a smoke test.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import time

from diffuse.bench.kit import peak_bytes, random_bf16, run_role

GIB = 1 << 30
THREADS, ROUNDS, BLOCKS = 1, 2, 2
GOAL_CLIENT, GOAL_TIME = 1.5 * GIB, 1.05
PROMPT = "a red fox runs through the snow at dawn"
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
                relative_attention_max_distance=128)
T5_XXL = dict(UMT5_XXL, vocab_size=32128)
CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              vocab_size=49408, max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu")
WAN_14B = dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40, text_dim=4096,
               freq_dim=256, in_channels=16, out_channels=16)
FLUX_DEV = dict(num_attention_heads=24, attention_head_dim=128, num_layers=19, num_single_layers=38,
                joint_attention_dim=4096, pooled_projection_dim=768, in_channels=64, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))
QUICK_TEXT = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8)
PIPELINES = ("wan2.1-14b", "flux.1-dev")
CALLS = {"wan2.1-14b": dict(height=64, width=64, num_frames=1, num_inference_steps=2, guidance_scale=5.0,
                            negative_prompt="blurry", max_sequence_length=32),
         "flux.1-dev": dict(height=64, width=64, num_inference_steps=2, guidance_scale=3.5, max_sequence_length=32)}


def build(path: str, name: str, quick: bool) -> None:
    """The pipeline ``name`` at its real geometry (``quick``: a tiny one), saved to ``path`` in bf16."""
    from diffuse.train.tokenizers import build_word_tokenizer

    if name == "wan2.1-14b":
        from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
        from transformers import UMT5Config, UMT5EncoderModel

        tok = build_word_tokenizer("t5")
        text = dict(QUICK_TEXT, vocab_size=len(tok)) if quick else UMT5_XXL
        geo = dict(WAN_14B, num_attention_heads=2, attention_head_dim=16, ffn_dim=64, text_dim=32) if quick else \
            dict(WAN_14B)
        geo["num_layers"] = BLOCKS
        pipe = WanPipeline(
            tokenizer=tok, text_encoder=random_bf16(lambda: UMT5EncoderModel(UMT5Config(**text, dropout_rate=0.0))),
            transformer=random_bf16(lambda: WanTransformer3DModel(
                patch_size=(1, 2, 2), cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, **geo)),
            vae=AutoencoderKLWan(base_dim=8 if quick else 96).to(_bf16()), scheduler=FlowMatchEulerDiscreteScheduler())
    else:
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
        from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

        tok, tok2 = build_word_tokenizer("clip"), build_word_tokenizer("t5")
        clip = dict(CLIP_L, num_hidden_layers=2, hidden_size=32, intermediate_size=37, num_attention_heads=4,
                    projection_dim=32) if quick else dict(CLIP_L)
        t5 = dict(QUICK_TEXT, vocab_size=len(tok2)) if quick else T5_XXL
        geo = dict(FLUX_DEV, num_attention_heads=2, attention_head_dim=16, joint_attention_dim=32,
                   pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)) if quick else dict(FLUX_DEV)
        geo.update(num_layers=BLOCKS, num_single_layers=BLOCKS)
        ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        pipe = FluxPipeline(
            tokenizer=tok, tokenizer_2=tok2, scheduler=FlowMatchEulerDiscreteScheduler(),
            text_encoder=random_bf16(lambda: CLIPTextModel(CLIPTextConfig(**clip, **ids))),
            text_encoder_2=random_bf16(lambda: T5EncoderModel(T5Config(**t5, dropout_rate=0.0))),
            transformer=random_bf16(lambda: FluxTransformer2DModel(**geo)),
            vae=AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, use_quant_conv=False,
                              use_post_quant_conv=False, down_block_types=("DownEncoderBlock2D",) * 4,
                              up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=1 if quick else 2,
                              block_out_channels=(8, 8, 8, 8) if quick else (128, 256, 512, 512),
                              norm_num_groups=8 if quick else 32, scaling_factor=0.3611,
                              shift_factor=0.1159).to(_bf16()),
            image_encoder=None, feature_extractor=None)
    pipe.save_pretrained(path, safe_serialization=True, max_shard_size="2GB")


def _bf16():
    import torch

    return torch.bfloat16


def client(path: str, name: str, encoders: str, nodes: str) -> dict:
    """A client process: the pipeline loaded as ``diffuse.split`` loads it, two requests through the nodes;
    its peak, the second request's seconds, a digest of its output."""
    import torch

    import diffuse

    pipe = diffuse.from_pretrained(path, dtype="bfloat16", encoders=encoders)
    seconds, out = [], None
    with diffuse.split(pipe, nodes=nodes, timeout=3600), torch.no_grad():
        for _ in range(2):
            t0 = time.perf_counter()
            out = pipe(PROMPT, generator=torch.Generator().manual_seed(0), output_type="np", **CALLS[name])
            seconds.append(time.perf_counter() - t0)
    array = out.frames if hasattr(out, "frames") else out.images
    return {"peak": peak_bytes(os.getpid()), "seconds": seconds[-1],
            "digest": hashlib.sha256(array.tobytes()).hexdigest()[:16]}


def _run(args: list[str]) -> dict:
    return run_role("diffuse.bench.pipememory", args, timeout=7200)


def measure(path: str, name: str, quick: bool) -> dict:
    """Build, then the rounds: each way's client against two nodes started for it; prints the table."""
    from diffuse.local.nodes import start_local_nodes

    t0 = time.perf_counter()
    built = _run(["build", path, name, "1" if quick else "0"])
    print(f"built in a process of its own in {time.perf_counter() - t0:.0f} s (its peak {built['peak'] / GIB:.2f} "
          f"GiB); load average {os.getloadavg()[0]:.2f}", flush=True)
    ways: dict = {"client": [], "ring": []}
    node_peaks: dict = {"client": [], "ring": []}
    extra = ["--log-level", "WARNING", "--device", "cpu", "--dtype", "bfloat16"]
    for _ in range(ROUNDS):
        for way, runs in ways.items():  # one way's nodes at a time: both ways' together would not fit beside a client
            nodes = start_local_nodes(path, 2, threads=THREADS, extra=extra + ["--encoders", way])
            try:
                runs.append(_run(["client", path, name, way, ",".join(f"{n.address}#{n.key}" for n in nodes)]))
                node_peaks[way] = [max(p, peak_bytes(n.proc.pid)) for p, n in zip(node_peaks[way] or [0, 0], nodes)]
            finally:
                nodes.stop()
    return report(ways, node_peaks)


def report(ways: dict, node_peaks: dict) -> dict:
    """Print each way's peaks and times, the ratio of times with its spread, and whether the outputs agree."""
    print("per process: peak resident memory (VmHWM); a request's end-to-end time (its second, after the first "
          "taught the stacks' return maps)")
    for way, runs in ways.items():
        peaks = [r["peak"] for r in runs]
        print(f"  --encoders {way:6}  client {max(peaks) / GIB:6.2f} GiB   nodes "
              f"{' / '.join(f'{p / GIB:.2f}' for p in node_peaks[way])} GiB   request "
              f"{statistics.mean(r['seconds'] for r in ways[way]):7.2f} s", flush=True)
    ratios = [r["seconds"] / c["seconds"] for r, c in zip(ways["ring"], ways["client"])]
    spread = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else 0.0
    ring_peak = max(r["peak"] for r in ways["ring"])
    same = len({r["digest"] for runs in ways.values() for r in runs}) == 1
    print(f"  client's peak with the encoders on the ring: {ring_peak / GIB:.2f} GiB, goal <= "
          f"{GOAL_CLIENT / GIB:.1f} GiB: {'met' if ring_peak <= GOAL_CLIENT else 'not met'}")
    ratio = statistics.mean(ratios)
    print(f"  request time, ring / client: {ratio:.3f} ± {spread:.3f} (mean ± standard error over {len(ratios)} "
          f"rounds), goal <= {GOAL_TIME:.2f}: {'met' if ratio <= GOAL_TIME else 'not met'}")
    print(f"  outputs the same bit for bit every way and round: {same}; load average {os.getloadavg()[0]:.2f}",
          flush=True)
    return {"ring_peak": ring_peak, "ratio": ratio, "same": same}


def run(name: str, quick: bool, tmp: str) -> dict:
    """``bench memory --model NAME`` for a pipeline: the heading, then ``measure``."""
    print(f"model: {name}'s pipeline at {'a tiny' if quick else 'its real'} geometry, random bf16 weights: its text "
          f"encoders and VAE whole, its denoiser's stacks cut to {BLOCKS} blocks each; a request "
          f"{', '.join(f'{k} {v}' for k, v in CALLS[name].items())}; two nodes, every process at {THREADS} torch "
          f"thread(s); load average {os.getloadavg()[0]:.2f}", flush=True)
    return measure(os.path.join(tmp, name), name, quick)


def role(argv: list[str]) -> int:
    """A process of the bench: ``build PATH NAME QUICK`` or ``client PATH NAME ENCODERS NODES``; prints JSON."""
    import torch

    torch.set_num_threads(THREADS)
    if argv[0] == "build":
        build(argv[1], argv[2], argv[3] == "1")
        print(json.dumps({"peak": peak_bytes(os.getpid())}))
    else:
        print(json.dumps(client(*argv[1:5])))
    return 0


if __name__ == "__main__":
    sys.exit(role(sys.argv[1:]))
