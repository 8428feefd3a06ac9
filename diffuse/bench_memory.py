"""``python -m diffuse.bench memory``: peak memory per process at a real model's geometry, split against whole.

A causal language model is built from a config at a real geometry (``QWEN25_15B``: Qwen2.5-1.5B's, 28
layers, hidden 1536, vocabulary 151,936, tied embeddings) with seeded random bf16 weights, in a process of
its own, into a temp folder (not committed, not part of the test suite). Then, each in a process of its
own so that each peak is its own: the model run whole (loaded as transformers loads it, greedy
``generate``), and the same ``generate`` split over two local nodes holding half the layers each, its
client in a process of its own. Printed: each process's peak resident memory (the kernel's high-water
mark, VmHWM) against what it holds, from the safetensors headers: each node its slice (its layers; the last
node also the output head, a copy of the tied embedding), the client the ends (all that is not a layer:
the embedding table and the final norm); whole, everything; and whether the tokens split are the tokens
whole. Goals: each node within its slice + 0.5 GiB, the client within the ends + 0.6 GiB. Every process at
``THREADS`` torch threads. ``--quick``: a tiny geometry, for a smoke test (built and run whole in this
process, whose peak then says nothing).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

GIB = 1 << 30
QWEN25_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                  rms_norm_eps=1e-6)
QUICK = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=512, max_position_embeddings=512)
PROMPT, NEW, THREADS = 16, 6, 1
GOAL_NODE, GOAL_CLIENT = 0.5 * GIB, 0.6 * GIB


def build(path: str, geometry: dict) -> None:
    """The model at ``geometry`` with seeded random bf16 weights (norms at one), saved to ``path``."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    config = transformers.Qwen2Config(**geometry, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
                                      pad_token_id=None, torch_dtype="bfloat16")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # so that the empty weights are made in bf16 from the start
    try:
        with torch.device("meta"):
            model = transformers.Qwen2ForCausalLM(config)
        model = model.to_empty(device="cpu")
    finally:
        torch.set_default_dtype(default)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02, generator=g)
    model.tie_weights()  # made empty, the head is a tensor of its own: one table again, saved once
    model.save_pretrained(path, max_shard_size="2GB")


def _peak() -> int:
    """This process's peak resident bytes (VmHWM)."""
    return _hwm(os.getpid())


def _hwm(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _prompt(vocab: int):
    import torch

    return torch.randint(0, vocab, (1, PROMPT), generator=torch.Generator().manual_seed(0))


def role(argv: list[str]) -> int:
    """A process of the bench: ``build PATH QUICK``, ``whole PATH``, or ``client PATH NODES``; prints JSON."""
    import torch

    torch.set_num_threads(THREADS)
    what, path = argv[0], argv[1]
    if what == "build":
        build(path, QUICK if argv[2] == "1" else QWEN25_15B)
        print(json.dumps({"peak": _peak()}))
        return 0
    with open(os.path.join(path, "config.json")) as f:
        ids = _prompt(json.load(f)["vocab_size"])
    if what == "whole":
        from diffuse.api import ModelInfo
        from diffuse.planner import load_model

        model = load_model(path, ModelInfo.of(path).subject)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                                 do_sample=False)
    else:
        import diffuse

        model = diffuse.from_pretrained(path)
        with diffuse.split(model, nodes=argv[2], timeout=1800), torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                                 do_sample=False)
    print(json.dumps({"peak": _peak(), "tokens": out[0, PROMPT:].tolist()}))
    return 0


def _run(args: list[str]) -> dict:
    from diffuse.localnodes import node_env

    proc = subprocess.run([sys.executable, "-m", "diffuse.bench_memory", *args], env=node_env(),
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{args[0]} failed: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _in_process(args: list[str]) -> dict:
    """A role run in this process (``--quick``: its peak is this process's, which a smoke test does not read)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        role(args)
    return json.loads(out.getvalue().strip().splitlines()[-1])


def held_bytes(path: str, nodes: int) -> tuple[list[int], int, int]:
    """From the safetensors headers: each node's slice (even halves of the layers; the head with the last),
    the ends the client holds, and the whole."""
    from diffuse.analysis import ModelSubject
    from diffuse.placement import _header, block_costs
    from diffuse.plan import split_evenly
    from diffuse.planner import analyze

    subject, draft = analyze(path)
    costs = block_costs(ModelSubject.from_path(path), draft["stacks"], "bfloat16")
    whole = 0
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            whole += sum(h["data_offsets"][1] - h["data_offsets"][0] for k, h in
                         _header(os.path.join(path, name)).items() if k != "__metadata__")
    layers = sum(c.weight_bytes for c in costs)
    slices = [sum(c.weight_bytes + c.end_bytes for c in costs[a:b]) for a, b in split_evenly(len(costs), nodes)]
    return slices, whole - layers, whole


def main(argv: list[str] | None = None) -> int:
    from diffuse.cli import Parser
    from diffuse.text import plain

    ap = Parser(prog="diffuse bench memory", description=plain(__doc__.split("\n")[0]))
    ap.add_argument("--quick", action="store_true", help="a tiny geometry, for a smoke test")
    a = ap.parse_args(argv)

    from diffuse.localnodes import start_local_nodes

    geometry = QUICK if a.quick else QWEN25_15B
    tmp = tempfile.mkdtemp(prefix="diffuse-bench-memory-")
    path = os.path.join(tmp, "model")
    try:
        print(f"model: Qwen2ForCausalLM at {'a tiny' if a.quick else 'Qwen2.5-1.5B'}'s geometry "
              f"({geometry['num_hidden_layers']} layers, hidden {geometry['hidden_size']}, FFN "
              f"{geometry['intermediate_size']}, vocabulary {geometry['vocab_size']}, tied embeddings), random bf16 "
              f"weights; prompt {PROMPT} tokens, {NEW} new, greedy; every process at {THREADS} torch thread(s); "
              f"load average {os.getloadavg()[0]:.2f}", flush=True)
        built = _in_process(["build", path, "1"]) if a.quick else _run(["build", path, "0"])
        slices, ends, whole_bytes = held_bytes(path, 2)
        print(f"built in a process of its own (its peak {built['peak'] / GIB:.2f} GiB); {whole_bytes / GIB:.2f} GiB "
              "of weights", flush=True)
        whole = _in_process(["whole", path]) if a.quick else _run(["whole", path])
        nodes = start_local_nodes(path, 2, threads=THREADS, extra=["--log-level", "WARNING"])
        try:
            client = _run(["client", path, ",".join(f"{n.address}#{n.key}" for n in nodes)])
            peaks = [_hwm(n.proc.pid) for n in nodes]
        finally:
            nodes.stop()
        print("\npeak resident memory (VmHWM) against what each process holds (safetensors headers):")
        print(f"  whole, one process: {whole['peak'] / GIB:6.2f} GiB   holds {whole_bytes / GIB:.2f} GiB")
        ok = client["peak"] <= ends + GOAL_CLIENT
        print(f"  client:             {client['peak'] / GIB:6.2f} GiB   holds {ends / GIB:.2f} GiB (the ends)   "
              f"goal <= {(ends + GOAL_CLIENT) / GIB:.2f} GiB: {'met' if ok else 'not met'}")
        for i, (peak, held) in enumerate(zip(peaks, slices), 1):
            ok = peak <= held + GOAL_NODE
            what = "its layers and the output head" if i == len(slices) else "its layers"
            print(f"  node {i}:             {peak / GIB:6.2f} GiB   holds {held / GIB:.2f} GiB ({what})   "
                  f"goal <= {(held + GOAL_NODE) / GIB:.2f} GiB: {'met' if ok else 'not met'}")
        print(f"  tokens split equal tokens whole: {client['tokens'] == whole['tokens']} ({len(whole['tokens'])} "
              f"tokens); load average after {os.getloadavg()[0]:.2f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(role(sys.argv[1:]))
