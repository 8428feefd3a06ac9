"""Transformers checkpoints saved quantized (a ``quantization_config`` in config.json) read as they are: a tiny
Qwen2 quantized by plain transformers (torchao's int8 weight-only config; bitsandbytes' 4-bit nf4 with its scales
quantized again, and its LLM.int8) and saved by ``save_pretrained``, split over two nodes (each given a copy whose
other layers' bytes are spoilt; the last node reads the final norm and the head), says token for token and logit
for logit what plain transformers says loading the same checkpoint whole (tests/lm_reference.py in a subprocess,
which imports nothing of Diffuse's); passes through LLM.int8 layers are never batched nor drafted by default,
through 4-bit ones they are; other methods, bitsandbytes missing, and ``--quantize`` over a checkpoint saved quantized are refused in one
line.
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
def tiny(tmp_path_factory) -> dict:
    """The tiny Qwen2 at hidden 64 (bitsandbytes' 4-bit CPU kernel takes no narrower layer), as built (plain),
    and the folder the checkpoints saved quantized from it go in."""
    import lm_models

    root = tmp_path_factory.mktemp("prequant")
    return {"plain": lm_models.build_qwen2_wide(str(root / "plain")), "root": root}


def save_quantized(tiny: dict, name: str, config, method: str) -> str:
    """The tiny Qwen2 loaded by plain transformers with ``config`` and saved (its tokenizer beside it)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny["plain"], dtype=torch.float32, quantization_config=config)
    saved = str(tiny["root"] / name)
    model.save_pretrained(saved)
    for file in os.listdir(tiny["plain"]):  # the tokenizer and chat template, as they are
        if file not in os.listdir(saved):
            shutil.copy(os.path.join(tiny["plain"], file), saved)
    with open(os.path.join(saved, "config.json")) as f:
        assert json.load(f)["quantization_config"]["quant_method"] == method
    return saved


@pytest.fixture(scope="module")
def saved_int8(tiny) -> dict:
    """The tiny Qwen2, as built (plain) and saved quantized int8 by transformers with torchao."""
    import torchao.quantization as q
    from transformers import TorchAoConfig

    return dict(tiny, saved=save_quantized(tiny, "int8", TorchAoConfig(q.Int8WeightOnlyConfig()), "torchao"))


@pytest.fixture(scope="module")
def saved_bnb(tiny) -> dict[str, str]:
    """The tiny Qwen2 saved quantized by transformers with bitsandbytes: 4-bit nf4 with its scales quantized again
    ("nf4"), and LLM.int8 at its default outlier threshold ("int8")."""
    import torch
    from safetensors import safe_open
    from transformers import BitsAndBytesConfig

    out = {"nf4": save_quantized(tiny, "bnb-nf4", BitsAndBytesConfig(
               load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
               bnb_4bit_compute_dtype=torch.float32), "bitsandbytes"),
           "int8": save_quantized(tiny, "bnb-int8", BitsAndBytesConfig(load_in_8bit=True), "bitsandbytes")}
    layer = "model.layers.3.mlp.down_proj"
    for name, parts in (("nf4", {"weight", "weight.absmax", "weight.nested_absmax", "weight.quant_state."
                                 "bitsandbytes__nf4"}), ("int8", {"weight", "SCB"})):
        with safe_open(os.path.join(out[name], "model.safetensors"), "pt") as f:
            assert {f"{layer}.{p}" for p in parts} <= set(f.keys()), name
    return out


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


def split_against_whole(saved: list[str], plain: str, tmp_path, diffuse_home) -> None:
    """Each checkpoint of ``saved`` split over two nodes, each given a copy whose other layers' bytes are spoilt,
    says token for token and logit for logit what plain transformers says loading it whole (all in one
    subprocess, beside the plain model they were made from, whose logits none may give)."""
    jobs = tmp_path / "jobs.json"
    with open(jobs, "w") as f:  # the saved checkpoints, and the plain model they were made from, in one process
        json.dump([{"model": m, "prompt": PROMPT, "max_new_tokens": 6} for m in [*saved, plain]], f)
    ref = subprocess.Popen([sys.executable, os.path.join(TESTS, "lm_reference.py"), "--jobs", str(jobs), "--threads",
                            str(THREADS), "--out", str(tmp_path / "references.json")],
                           env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    nodes, said = [], []
    try:
        for k, model in enumerate(saved):  # every checkpoint's nodes start at once
            for n, blocks in enumerate(SLICES):
                lo, hi = (int(x) for x in blocks[blocks.index("[") + 1:-1].split(":"))
                copy = spoilt_but(model, str(tmp_path / f"node{k}-{n}"),
                                  lambda name, lo=lo, hi=hi: _layer(name) is None or lo <= _layer(name) < hi)
                nodes.append(node_process(["--model", copy, "--blocks", blocks, "--ephemeral-key", "--threads",
                                           str(THREADS), "--log-level", "WARNING"]))
        ready = [json.loads(p.stdout.readline()) for p in nodes]
        for k, model in enumerate(saved):
            pinned = ",".join(f"{r['address']}#{r['key']}" for r in ready[2 * k:2 * k + 2])
            tokens, report = tmp_path / f"tokens{k}.json", tmp_path / f"report{k}.json"
            run = run_client(["--model", model, "--prompt", PROMPT, "--max-new-tokens", "6", "--threads",
                              str(THREADS), "--nodes", pinned, "--save-tokens", str(tokens), "--report",
                              str(report), "--quiet", "--timeout", "120"], diffuse_home)
            assert run.returncode == 0, f"{model}: {run.stderr[-3000:]}"
            with open(tokens) as g, open(report) as h:
                said.append((json.load(g), json.load(h)))
    finally:
        for p in nodes:
            p.terminate()
            p.wait(30)
    _, err = ref.communicate(timeout=600)
    assert ref.returncode == 0, err[-3000:]
    with open(tmp_path / "references.json") as f:
        *expected, unquantized = json.load(f)
    for model, want, (tokens, report) in zip(saved, expected, said):
        assert tokens["input_ids"] == want["input_ids"], model
        assert tokens["new_tokens"] == want["new_tokens"], model
        assert report["top"] == want["top"], model  # ids and the float32 bits of each step's best logits
        assert report["top"] != unquantized["top"], f"{model}: the split gave the unquantized model's logits"
        assert report["client_layer_params"] == 0, model


def test_a_checkpoint_saved_quantized_splits_as_plain_transformers_runs_it_whole(saved_int8, tmp_path, diffuse_home):
    split_against_whole([saved_int8["saved"]], saved_int8["plain"], tmp_path, diffuse_home)


def test_checkpoints_saved_by_bitsandbytes_split_as_plain_transformers_runs_them_whole(tiny, saved_bnb, tmp_path,
                                                                                     diffuse_home):
    split_against_whole([saved_bnb["nf4"], saved_bnb["int8"]], tiny["plain"], tmp_path, diffuse_home)


def test_llm_int8_passes_are_never_batched_nor_drafted_by_default_4bit_ones_are(saved_bnb):
    """Decoding passes of two sessions through the same layers of bitsandbytes' (transformers' own, loaded whole):
    LLM.int8 ones (their outlier columns come from every row of a call) get no batch key, a node runs each
    alone; 4-bit ones (each row apart, as plain layers) batch as plain layers do (tests/test_lm_batch.py), each
    session's next token its lone pass's. Likewise a session drafts by default (several positions a pass) over
    4-bit layers and not over LLM.int8 ones."""
    import bitsandbytes as bnb
    import torch
    from test_lm_batch import decoding_passes, lone

    from diffuse.lm.client_drafts import Drafting
    from diffuse.lm.node_batching import batch_key, run_batch

    model, passes = decoding_passes(saved_bnb["int8"], [3, 9])
    assert isinstance(model.model.layers[0].mlp.up_proj, bnb.nn.Linear8bitLt)
    assert model.model.layers[0].mlp.up_proj.state.threshold > 0
    assert [batch_key(torch.float32, p) for p in passes] == [None, None]
    assert Drafting(auto=True).arguments({}, 1, model.generation_config, model) == {}
    model, passes = decoding_passes(saved_bnb["nf4"], [3, 9])
    assert isinstance(model.model.layers[0].mlp.up_proj, bnb.nn.Linear4bit)
    assert Drafting(auto=True).arguments({}, 1, model.generation_config, model) == {"prompt_lookup_num_tokens": 8}
    keys = [batch_key(torch.float32, p) for p in passes]
    assert keys[0] is not None and keys[0] == keys[1]
    alone = [lone(p) for p in passes]  # and batched, each session's next token is its lone pass's
    with torch.no_grad():
        for out, (ref, _) in zip(run_batch(passes), alone):
            assert (out - ref).abs().max().item() < 1e-4
            assert torch.equal(model.lm_head(model.model.norm(out)).argmax(-1),
                               model.lm_head(model.model.norm(ref)).argmax(-1))


def test_other_methods_and_quantize_over_it_are_refused_in_one_line(saved_int8, saved_bnb, diffuse_home,
                                                                   monkeypatch):
    other = str(saved_int8["root"] / "gptq")
    shutil.copytree(saved_int8["saved"], other)
    with open(os.path.join(other, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    with open(os.path.join(other, "config.json"), "w") as f:
        json.dump(config, f)
    fp16 = str(saved_int8["root"] / "bnb-fp16-weights")  # LLM.int8 set to keep 16-bit weights (for training)
    shutil.copytree(saved_bnb["int8"], fp16)
    with open(os.path.join(fp16, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["llm_int8_has_fp16_weight"] = True
    with open(os.path.join(fp16, "config.json"), "w") as f:
        json.dump(config, f)
    for argv, run, said in (
            (["--model", other, "--prompt", "x", "--quiet"], run_client, "quantized by gptq"),
            (["--model", fp16, "--prompt", "x", "--quiet"], run_client, "with llm_int8_has_fp16_weight"),
            (["--model", saved_int8["saved"], "--prompt", "x", "--quantize", "int8", "--quiet"], run_client,
             "saved quantized already (torchao)"),
            (["plan", saved_int8["saved"], "--quantize", "int4"], run_cli, "saved quantized already (torchao)"),
            (["--model", saved_bnb["nf4"], "--prompt", "x", "--quantize", "int8", "--quiet"], run_client,
             "saved quantized already (bitsandbytes)")):
        done = run(argv, diffuse_home)
        lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
        assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
        assert said in lines[0], lines[0]
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if it were not installed (find_spec says None)
    done = run_client(["--model", saved_bnb["int8"], "--prompt", "x", "--quiet"], diffuse_home)
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert "quantized by bitsandbytes, which is not installed: pip install 'diffuse[bnb]'" in lines[0], lines[0]
