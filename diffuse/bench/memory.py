"""``python -m diffuse.bench memory``: peak memory per process at real models' geometries, split against whole.

Two models, each built from a config at a real geometry with seeded random bf16 weights, in a process of
its own, into a temp folder (not committed, not part of the test suite):

- a causal language model at Qwen2.5-1.5B's geometry (``QWEN25_15B``: 28 layers, hidden 1536, vocabulary
  151,936, tied embeddings), run greedy (``generate``);
- a diffusion transformer at Wan2.1-T2V-1.3B's (``diffuse.bench.device.WAN_1_3B``: 30 blocks, hidden 1536,
  FFN 8960, text 4096 wide), the transformer alone, driven as a guided pipeline drives it (two calls a step,
  ``WAN_STEPS`` steps) on fixed inputs: a small latent (``WAN_LATENT``), so that the peaks are the weights'
  rather than one video's activations, and the text encoder's output as random 4096-wide states. The text
  encoder (UMT5-XXL's, about 10.6 GiB in bf16) and the VAE are not built: the client holds them split or whole
  alike by default, and with them a whole run would not fit this machine beside the split one (the encoders on
  the ring instead: ``--model wan2.1-14b``, ``diffuse.bench.pipememory``).

Then, each in a process of its own so that each peak is its own: the model run whole (loaded as transformers or
diffusers loads it), and the same run split over two local nodes holding half the blocks each, its client in a
process of its own (holding the denoiser without its blocks, as ``diffuse.split`` loads it). Printed: each
process's peak resident memory (the kernel's high-water mark, VmHWM) against what it holds, from the safetensors
headers: each node its slice (its blocks; a language model's last node also the output head, a copy of the tied
embedding), the client the ends (all that is not a block); whole, everything; and whether the split run's output
is the whole one's (the tokens; the latent, bit for bit). Goals: each node within its slice + 0.5 GiB, the client
within the ends + 0.6 GiB. Every process at ``THREADS`` torch threads. ``--model`` runs one of the two.
``--quick``: tiny geometries, for a smoke test (built, run whole and the client run in this process, whose peak
then says nothing).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile

from diffuse.bench import pipememory
from diffuse.bench.kit import peak_bytes, random_bf16, run_role
from diffuse.bench.pipememory import PIPELINES

GIB = 1 << 30
QWEN25_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                  rms_norm_eps=1e-6)
QUICK = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=512, max_position_embeddings=512)
PROMPT, NEW, THREADS = 16, 6, 1
WAN_LATENT = dict(frames=1, size=16)  # a latent of 16 x 1 x 16 x 16: 64 tokens (the text: 512 tokens)
WAN_STEPS = 2
MODELS = ("qwen2.5-1.5b", "wan2.1-1.3b")
GOAL_NODE, GOAL_CLIENT = 0.5 * GIB, 0.6 * GIB


def build(path: str, geometry: dict) -> None:
    """The model at ``geometry`` with seeded random bf16 weights (norms at one), saved to ``path``."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    config = transformers.Qwen2Config(**geometry, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
                                      pad_token_id=None, torch_dtype="bfloat16")
    model = random_bf16(lambda: transformers.Qwen2ForCausalLM(config))  # the head tied to the table again
    model.save_pretrained(path, max_shard_size="2GB")


def _peak() -> int:
    """This process's peak resident bytes (VmHWM)."""
    return peak_bytes(os.getpid())


def _prompt(vocab: int):
    import torch

    return torch.randint(0, vocab, (1, PROMPT), generator=torch.Generator().manual_seed(0))


def role(argv: list[str]) -> int:
    """A process of the bench: ``build PATH QUICK``, ``whole PATH``, or ``client PATH NODES`` for the language
    model; ``wan-build PATH QUICK``, ``wan-whole PATH QUICK``, ``wan-client PATH QUICK NODES`` for the diffusion
    transformer; prints JSON."""
    import torch

    torch.set_num_threads(THREADS)
    what, path = argv[0], argv[1]
    if what.startswith("wan-"):
        return wan_role(what[4:], path, argv[2] == "1", argv[3:])
    if what == "build":
        build(path, QUICK if argv[2] == "1" else QWEN25_15B)
        print(json.dumps({"peak": _peak()}))
        return 0
    with open(os.path.join(path, "config.json")) as f:
        ids = _prompt(json.load(f)["vocab_size"])
    if what == "whole":
        from diffuse.client.api import ModelInfo
        from diffuse.plan.planner import load_model

        model = load_model(path, ModelInfo.of(path).subject)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                                 do_sample=False)
    else:
        import diffuse

        model = diffuse.from_pretrained(path)
        with diffuse.split(model, nodes=argv[2], timeout=1800, speculate="off"), torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                                 do_sample=False)
    print(json.dumps({"peak": _peak(), "tokens": out[0, PROMPT:].tolist()}))
    return 0


def wan_geometry(quick: bool) -> dict:
    from diffuse.bench.device import QUICK as WAN_QUICK, WAN_1_3B

    return dict(WAN_QUICK if quick else WAN_1_3B, **WAN_LATENT, steps=WAN_STEPS)


def wan_role(what: str, path: str, quick: bool, rest: list[str]) -> int:
    """The diffusion transformer's processes: ``build`` (random weights, saved in bf16), ``whole`` (loaded as
    diffusers loads it) and ``client`` (the denoiser without its blocks, split over the nodes ``rest[0]``); the
    last two print their peak and a digest of the latent they end with."""
    import torch

    from diffuse.bench import device as bench_device
    from diffuse.bench.kit import inputs

    cpu, cfg = torch.device("cpu"), wan_geometry(quick)
    if what == "build":
        bench_device.build(path, cfg, cpu, torch.bfloat16)
        print(json.dumps({"peak": _peak()}))
        return 0
    x = inputs(cfg)
    if what == "whole":
        _, out = bench_device.denoise(bench_device.load(path, cpu, torch.bfloat16), x, cfg["steps"], cpu,
                                      torch.bfloat16)
    else:
        import diffuse
        from diffuse.client.api import ModelInfo
        from diffuse.plan.planner import load_denoiser_shell

        info = ModelInfo.of(path)
        shell = load_denoiser_shell(path, info.subject, info.draft["stacks"], torch.bfloat16)
        with diffuse.split(shell, nodes=rest[0], timeout=1800, model=path):
            _, out = bench_device.denoise(shell, x, cfg["steps"], cpu, torch.bfloat16)
    digest = hashlib.sha256(out.contiguous().numpy().tobytes()).hexdigest()
    print(json.dumps({"peak": _peak(), "tokens": digest}))
    return 0


def _run(args: list[str]) -> dict:
    return run_role("diffuse.bench.memory", args)


def _in_process(args: list[str]) -> dict:
    """A role run in this process (``--quick``: its peak is this process's, which a smoke test does not read)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        role(args)
    return json.loads(out.getvalue().strip().splitlines()[-1])


def held_bytes(path: str, nodes: int) -> tuple[list[int], int, int]:
    """From the safetensors headers: each node's slice (even halves of the blocks; a language model's head with
    the last), the ends the client holds (a diffusion client loaded without its blocks reads none of them, the
    first included: it learns a stack's return map with the first block weightless), and the whole."""
    from diffuse.plan.analysis import ModelSubject
    from diffuse.plan.needs import _header, block_costs
    from diffuse.plan.contracts import split_evenly
    from diffuse.plan.planner import analyze

    subject, draft = analyze(path)
    costs = block_costs(ModelSubject.from_path(path), draft["stacks"], "bfloat16")
    whole = 0
    for folder, _, names in os.walk(path):
        for name in names:
            if name.endswith(".safetensors"):
                whole += sum(h["data_offsets"][1] - h["data_offsets"][0] for k, h in
                             _header(os.path.join(folder, name)).items() if k != "__metadata__")
    layers = sum(c.weight_bytes for c in costs)
    slices = [sum(c.weight_bytes + c.end_bytes for c in costs[a:b]) for a, b in split_evenly(len(costs), nodes)]
    return slices, whole - layers, whole


def measure(path: str, quick: bool, wan: bool) -> None:
    """Build the model at ``path``, run it whole and split over two local nodes, and print the peaks."""
    from diffuse.local.nodes import start_local_nodes

    pre, flag = ("wan-", ["1" if quick else "0"]) if wan else ("", [])
    one = _in_process if quick else _run
    built = one([pre + "build", path, "1" if quick else "0"])
    slices, ends, whole_bytes = held_bytes(path, 2)
    where = "in this process" if quick else "in a process of its own"
    print(f"built {where} (its peak {built['peak'] / GIB:.2f} GiB); {whole_bytes / GIB:.2f} GiB "
          f"of weights; load average {os.getloadavg()[0]:.2f}", flush=True)
    whole = one([pre + "whole", path, *flag])
    dtype = ["--device", "cpu", "--dtype", "bfloat16"] if wan else []  # Wan's float32 modules stay float32
    nodes = start_local_nodes(path, 2, threads=THREADS, extra=["--log-level", "WARNING", *dtype])
    try:
        client = one([pre + "client", path, *flag, ",".join(f"{n.address}#{n.key}" for n in nodes)])
        peaks = [peak_bytes(n.proc.pid) for n in nodes]
    finally:
        nodes.stop()
    print("peak resident memory (VmHWM) against what each process holds (safetensors headers):")
    print(f"  whole, one process: {whole['peak'] / GIB:6.2f} GiB   holds {whole_bytes / GIB:.2f} GiB")
    ok = client["peak"] <= ends + GOAL_CLIENT
    print(f"  client:             {client['peak'] / GIB:6.2f} GiB   holds {ends / GIB:.2f} GiB (the ends)   "
          f"goal <= {(ends + GOAL_CLIENT) / GIB:.2f} GiB: {'met' if ok else 'not met'}")
    for i, (peak, held) in enumerate(zip(peaks, slices), 1):
        ok = peak <= held + GOAL_NODE
        what = "its layers and the output head" if i == len(slices) and not wan else "its blocks" if wan \
            else "its layers"
        print(f"  node {i}:             {peak / GIB:6.2f} GiB   holds {held / GIB:.2f} GiB ({what})   "
              f"goal <= {(held + GOAL_NODE) / GIB:.2f} GiB: {'met' if ok else 'not met'}")
    same = client["tokens"] == whole["tokens"]
    said = (f"latent split equals latent whole, bit for bit: {same}" if wan else
            f"tokens split equal tokens whole: {same} ({len(whole['tokens'])} tokens)")
    print(f"  {said}; load average after {os.getloadavg()[0]:.2f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    from diffuse.flags import Parser
    from diffuse.text import plain

    ap = Parser(prog="diffuse bench memory", description=plain(__doc__.split("\n")[0]))
    ap.add_argument("--quick", action="store_true", help="tiny geometries, for a smoke test")
    ap.add_argument("--model", choices=MODELS + PIPELINES,
                    help="only this one of the two (default: both); or a pipeline's client with its text encoders "
                         "on the client and on the ring (diffuse.bench.pipememory)")
    a = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="diffuse-bench-memory-")
    try:
        if a.model in PIPELINES:
            pipememory.run(a.model, a.quick, tmp)
        if a.model in (None, MODELS[0]):
            g = QUICK if a.quick else QWEN25_15B
            print(f"model: Qwen2ForCausalLM at {'a tiny' if a.quick else 'Qwen2.5-1.5B'}'s geometry "
                  f"({g['num_hidden_layers']} layers, hidden {g['hidden_size']}, FFN {g['intermediate_size']}, "
                  f"vocabulary {g['vocab_size']}, tied embeddings), random bf16 weights; prompt {PROMPT} tokens, "
                  f"{NEW} new, greedy; every process at {THREADS} torch thread(s); load average "
                  f"{os.getloadavg()[0]:.2f}", flush=True)
            measure(os.path.join(tmp, "lm"), a.quick, wan=False)
        if a.model in (None, MODELS[1]):
            g = wan_geometry(a.quick)
            print(f"\nmodel: WanTransformer3DModel at {'a tiny' if a.quick else 'Wan2.1-T2V-1.3B'}'s geometry "
                  f"({g['layers']} blocks, hidden {g['heads'] * g['head_dim']}, FFN {g['ffn']}, text {g['text_dim']} "
                  f"wide), random bf16 weights, the transformer alone (no text encoder, no VAE); latent 16 x "
                  f"{g['frames']} x {g['size']} x {g['size']}, text {g['text_len']} tokens, {g['steps']} guided "
                  f"steps; every process at {THREADS} torch thread(s); load average {os.getloadavg()[0]:.2f}",
                  flush=True)
            measure(os.path.join(tmp, "wan"), a.quick, wan=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(role(sys.argv[1:]))
