"""Transformers checkpoints saved quantized (a ``quantization_config`` in config.json) read as they are: a tiny
Qwen2 quantized by plain transformers with torchao's int8 weight-only config and saved by ``save_pretrained``, split
over two nodes (each given a copy whose other layers' bytes are spoilt; the last node reads the final norm and
the head), says token for token and logit for logit
what plain transformers says loading the same checkpoint whole (tests/lm_reference.py in a subprocess, which
imports nothing of Diffuse's); other methods and ``--quantize`` over it are refused in one line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import TESTS, THREADS, node_process, run_cli, run_client, subprocess_env

PROMPT = "Tell me a story about the moon."
SLICES = ("model.layers[0:2]", "model.layers[2:4]")


@pytest.fixture(scope="module")
def saved_int8(tmp_path_factory) -> dict:
    """The tiny Qwen2, as built (plain) and saved quantized int8 by transformers (its tokenizer beside it)."""
    import lm_models
    import torch
    import torchao.quantization as q
    from transformers import AutoModelForCausalLM, TorchAoConfig

    root = tmp_path_factory.mktemp("prequant")
    plain = lm_models.build("qwen2", str(root / "plain"))
    model = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32,
                                                 quantization_config=TorchAoConfig(q.Int8WeightOnlyConfig()))
    saved = str(root / "int8")
    model.save_pretrained(saved)
    for name in os.listdir(plain):  # the tokenizer and chat template, as they are
        if name not in os.listdir(saved):
            shutil.copy(os.path.join(plain, name), saved)
    with open(os.path.join(saved, "config.json")) as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "torchao"
    return {"plain": plain, "saved": saved, "root": root}


def spoilt_but(folder: str, dest: str, keep) -> str:
    """A copy of ``folder`` whose safetensors tensors ``keep(name)`` does not keep are overwritten (0xFF)."""
    from safetensors import safe_open

    shutil.copytree(folder, dest)
    path = os.path.join(dest, "model.safetensors")
    with open(path, "rb") as f:
        start = 8 + int.from_bytes(f.read(8), "little")
        f.seek(8)
        header = json.loads(f.read(start - 8))
    with safe_open(path, "pt") as f:
        names = list(f.keys())
    spoilt = 0
    with open(path, "r+b") as f:
        for name in names:
            if not keep(name):
                a, b = header[name]["data_offsets"]
                f.seek(start + a)
                f.write(b"\xff" * (b - a))
                spoilt += 1
    assert spoilt
    return dest


def _layer(name: str):
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") else None


def test_a_checkpoint_saved_quantized_splits_as_plain_transformers_runs_it_whole(saved_int8, tmp_path, diffuse_home):
    jobs = tmp_path / "jobs.json"
    with open(jobs, "w") as f:  # the saved checkpoint, and the plain model it was made from, in one process
        json.dump([{"model": saved_int8["saved"], "prompt": PROMPT, "max_new_tokens": 6},
                   {"model": saved_int8["plain"], "prompt": PROMPT, "max_new_tokens": 6}], f)
    ref = subprocess.Popen([sys.executable, os.path.join(TESTS, "lm_reference.py"), "--jobs", str(jobs), "--threads",
                            str(THREADS), "--out", str(tmp_path / "references.json")],
                           env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    nodes = []
    try:
        for n, blocks in enumerate(SLICES):
            lo, hi = (int(x) for x in blocks[blocks.index("[") + 1:-1].split(":"))
            copy = spoilt_but(saved_int8["saved"], str(tmp_path / f"node{n}"),
                              lambda name, lo=lo, hi=hi: _layer(name) is None or lo <= _layer(name) < hi)
            nodes.append(node_process(["--model", copy, "--blocks", blocks, "--ephemeral-key", "--threads",
                                       str(THREADS), "--log-level", "WARNING"]))
        ready = [json.loads(p.stdout.readline()) for p in nodes]
        pinned = ",".join(f"{r['address']}#{r['key']}" for r in ready)
        tokens, report = tmp_path / "tokens.json", tmp_path / "report.json"
        run = run_client(["--model", saved_int8["saved"], "--prompt", PROMPT, "--max-new-tokens", "6", "--threads",
                          str(THREADS), "--nodes", pinned, "--save-tokens", str(tokens), "--report", str(report),
                          "--quiet", "--timeout", "120"], diffuse_home)
        assert run.returncode == 0, run.stderr[-3000:]
    finally:
        for p in nodes:
            p.terminate()
            p.wait(30)
    _, err = ref.communicate(timeout=600)
    assert ref.returncode == 0, err[-3000:]
    with open(tmp_path / "references.json") as f, open(tokens) as g, open(report) as h:
        (expected, plain), said, report = json.load(f), json.load(g), json.load(h)
    assert said["input_ids"] == expected["input_ids"]
    assert said["new_tokens"] == expected["new_tokens"]
    assert report["top"] == expected["top"]  # ids and the float32 bits of each step's best logits
    assert report["top"] != plain["top"], "the split gave the unquantized model's logits: nothing was quantized"
    assert report["client_layer_params"] == 0


def test_other_methods_and_quantize_over_it_are_refused_in_one_line(saved_int8, diffuse_home):
    other = str(saved_int8["root"] / "bnb")
    shutil.copytree(saved_int8["saved"], other)
    with open(os.path.join(other, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    with open(os.path.join(other, "config.json"), "w") as f:
        json.dump(config, f)
    for argv, run, said in (
            (["--model", other, "--prompt", "x", "--quiet"], run_client, "quantized by bitsandbytes"),
            (["--model", saved_int8["saved"], "--prompt", "x", "--quantize", "int8", "--quiet"], run_client,
             "saved quantized already (torchao)"),
            (["plan", saved_int8["saved"], "--quantize", "int4"], run_cli, "saved quantized already (torchao)")):
        done = run(argv, diffuse_home)
        lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
        assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
        assert said in lines[0], lines[0]
