"""Quantized slices (``--quantize``): exact against plain diffusers and transformers loading the same torchao config
whole, counted quantized by placement, refused in one line where they cannot run.

The references are tests/quant_reference.py, run whole in a fresh process at the suite's thread count; it writes its
torchao configs out itself and imports nothing of Diffuse's. The split runs go through real node processes on
loopback, sealed, each node quantizing its own blocks as it loads them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import cbor2
import families
import numpy as np
import pytest

from conftest import (TESTS, THREADS, node_process, run_cli, run_client, run_node, run_reference, run_split,
                      split_command, subprocess_env)

PROMPT = "Tell me a story about the moon."
# the block stacks of each family, as the reference is told which linear layers a split run's nodes hold (the
# test's own knowledge of the model, not Diffuse's analysis)
STACKS = {"wan": ["blocks."], "wan22": ["blocks."], "flux": ["transformer_blocks.", "single_transformer_blocks."],
          "qwen2": ["model.layers."]}
DENOISERS = {"wan22": ["transformer", "transformer_2"]}  # a pipeline with two experts, each a stack of its own


def reference(mode: str, model: str, out: str, **what) -> subprocess.Popen:
    """tests/quant_reference.py started now (it runs while the test runs the split side)."""
    family = what.pop("family")
    cmd = [sys.executable, os.path.join(TESTS, "quant_reference.py"), "--mode", mode, "--model", model,
           "--threads", str(THREADS), "--out", out]
    for prefix in STACKS[family]:
        cmd += ["--only", prefix]
    for k, v in what.items():
        for one in v if isinstance(v, list) else [v]:
            cmd += [f"--{k.replace('_', '-')}", *([str(one)] if one != "" else [])]
    return subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finished(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]


# (family, mode, nodes, and the client's own parts quantized too: --quantize-client); Wan 2.2's two experts name
# their stacks from their components (transformer.blocks, transformer_2.blocks)
CASES = [("wan", "int4", 2, False), ("flux", "int8", 3, False), ("wan22", "int8", 2, True)]


@pytest.mark.parametrize("family,mode,nodes,client", CASES,
                         ids=[f"{f}-{m}-{n}nodes{'-client' if c else ''}" for f, m, n, c in CASES])
def test_quantized_split_is_byte_identical_to_plain_diffusers_with_the_same_torchao_config(
        family, mode, nodes, client, models, tmp_path, diffuse_home):
    model, kwargs = models(family), families.call_args(family)
    ref = reference(mode, model, str(tmp_path / "reference.npy"), family=family,
                    component=DENOISERS.get(family, ["transformer"]),
                    kwargs=json.dumps(kwargs), seed=0, **({"everything": ""} if client else {}))
    extra = ["--quantize", mode, *(["--quantize-client", mode] if client else [])]
    split, report = run_split(model, kwargs, tmp_path, nodes=nodes, extra=extra, home=diffuse_home)
    finished(ref)
    expected = np.load(tmp_path / "reference.npy")
    assert split.shape == expected.shape and np.isfinite(expected).all()
    assert split.tobytes() == expected.tobytes(), f"max abs diff {np.abs(split - expected).max()}"
    plain = run_reference(model, kwargs, str(tmp_path / "plain.npy"))  # unquantized, whole
    assert np.abs(split - plain).max() > 0, "the quantized run gave the unquantized output: nothing was quantized"
    assert report["client_block_params"] == 0
    if client:  # run whole here (--whole), the blocks and the client's parts quantized alike: the same bytes
        argv = split_command(model, kwargs, str(tmp_path / "whole.npy"), extra=extra)[3:]
        argv = [*argv[:argv.index("--local-nodes")], *argv[argv.index("--local-nodes") + 2:], "--whole"]
        whole = run_client(argv, diffuse_home)
        assert whole.returncode == 0, whole.stderr[-3000:]
        assert np.load(tmp_path / "whole.npy").tobytes() == expected.tobytes()


LM_CASES = [("int4", 2), ("fp8", 3)]


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> str:
    import lm_models

    return lm_models.build("qwen2", str(tmp_path_factory.mktemp("quant-lm") / "qwen2"))


@pytest.mark.parametrize("mode,nodes", LM_CASES, ids=[f"{m}-{n}nodes" for m, n in LM_CASES])
def test_quantized_split_language_model_says_what_plain_transformers_says_with_it(mode, nodes, qwen2, tmp_path,
                                                                                  diffuse_home):
    out = tmp_path / "reference.json"
    ref = reference(mode, qwen2, str(out), family="qwen2", prompt=PROMPT, max_new_tokens=6)
    tokens, report = tmp_path / "tokens.json", tmp_path / "report.json"
    run = run_client(["--model", qwen2, "--prompt", PROMPT, "--max-new-tokens", "6", "--threads", str(THREADS),
                      "--local-nodes", str(nodes), "--save-tokens", str(tokens), "--report", str(report), "--quiet",
                      "--timeout", "120", "--quantize", mode], diffuse_home)
    assert run.returncode == 0, run.stderr[-3000:]
    finished(ref)
    with open(out) as f, open(tokens) as g, open(report) as h:
        expected, said, report = json.load(f), json.load(g), json.load(h)
    assert said["input_ids"] == expected["input_ids"]
    assert said["new_tokens"] == expected["new_tokens"]
    assert report["top"] == expected["top"]  # ids and the float32 bits of each step's best logits
    assert report["client_layer_params"] == 0


def _ready(proc) -> dict:
    line = proc.stdout.readline()
    assert line, "the node ended before it was ready"
    return json.loads(line)


def test_a_node_says_its_mode_and_a_client_asking_another_is_refused_at_open(models, tmp_path, diffuse_home):
    from test_bounds import ask_raw

    model, kwargs = models("wan"), families.call_args("wan")
    proc = node_process(["--model", model, "--ephemeral-key", "--threads", str(THREADS), "--quantize", "int8",
                         "--log-level", "WARNING"])
    try:
        ready = _ready(proc)
        pinned = f"{ready['address']}#{ready['key']}"
        status = ask_raw(ready["address"], cbor2.dumps({"op": "status"}), 10)
        assert status is not None and status["quantize"] == "int8", status
        argv = ["--model", model, "--nodes", pinned, "--threads", str(THREADS), "--quiet", "--timeout", "60",
                "--save-array", str(tmp_path / "a.npy")]
        for k, v in kwargs.items():
            argv += ["--arg", f"{k}={json.dumps(v)}"]
        refused = run_client(argv, diffuse_home)  # no --quantize: the blocks asked for unquantized
        lines = [ln for ln in refused.stderr.splitlines() if ln.strip()]
        assert refused.returncode == 2, refused.stderr[-2000:]
        said = " ".join(lines)
        assert "quantized int8" in said and "unquantized" in said and "--quantize int8" in said, said
        served = run_client([*argv, "--quantize", "int8"], diffuse_home)
        assert served.returncode == 0, served.stderr[-2000:]
        assert proc.poll() is None  # the refusal cost the node nothing
    finally:
        proc.terminate()
        proc.wait(30)


def test_bad_quantize_input_is_one_line_and_exit_2(models, diffuse_home, monkeypatch):
    wan = models("wan")
    unknown = run_client(["--model", wan, "--quantize", "int3"], diffuse_home)
    assert unknown.returncode == 2 and len(unknown.stderr.strip().splitlines()) == 1, unknown.stderr
    assert "int3" in unknown.stderr and "int8" in unknown.stderr
    monkeypatch.setitem(sys.modules, "torchao", None)  # as on a machine without it: import torchao fails
    for argv, run in ((["--model", wan, "--quantize", "int8"], run_node),
                      (["--model", wan, "--quantize", "int4", "--prompt", "x"], run_client),
                      (["plan", wan, "--memory", "1,1", "--quantize", "fp8"], run_cli)):
        done = run(argv, diffuse_home)
        code, text = done.returncode, done.stderr
        lines = [ln for ln in text.splitlines() if ln.strip()]
        assert code == 2 and len(lines) == 1, text
        assert "needs torchao, which is not installed" in lines[0] and "diffuse[quant]" in lines[0], lines[0]
    monkeypatch.delitem(sys.modules, "torchao")
    from diffuse.errors import DiffuseError
    from diffuse.plan.quantize import check_mode

    with pytest.raises(DiffuseError, match="run on the CPU and CUDA, not on mps"):
        check_mode("int8", "mps")


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> str:
    """A language model wide enough that its blocks, not the planner's margin, decide how many nodes it needs: 8
    layers of 3.8 M parameters (15 MB each in float32), random weights (placement reads only the headers)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=320, max_position_embeddings=256, tie_word_embeddings=True)
    path = str(tmp_path_factory.mktemp("quant-wide") / "wide")
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


def test_placement_counts_each_block_as_torchao_stores_it_quantized(wide, diffuse_home):
    import torch
    import torchao.quantization as q
    from torchao.quantization import quantize_
    from torchao.quantization.granularity import PerGroup
    from transformers import AutoModelForCausalLM

    from diffuse.plan.analysis import ModelSubject
    from diffuse.plan.needs import block_costs
    from diffuse.plan.planner import analyze

    subject, draft = analyze(wide)
    model = AutoModelForCausalLM.from_pretrained(wide, dtype=torch.float32)
    configs = {"int8": q.Int8WeightOnlyConfig(), "fp8": q.Float8WeightOnlyConfig(),
               "int4": q.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))}
    for mode, config in configs.items():
        block = model.model.layers[3]
        quantize_(block, config, filter_fn=lambda m, _: isinstance(m, torch.nn.Linear))
        stored = sum(s.nbytes() for s in {id(s): s for s in _storages(block)}.values())
        counted = block_costs(ModelSubject.from_path(wide), draft["stacks"], "float32", quantize=mode)[3]
        assert counted.weight_bytes == stored, (mode, counted.weight_bytes, stored)
        model = AutoModelForCausalLM.from_pretrained(wide, dtype=torch.float32)  # afresh for the next mode
    # four nodes of 0.1 GiB: float32 needs them all, every mode fits on one; two such nodes are refused in one
    # line that names the modes that would fit
    shown = run_cli(["plan", wide, "--memory", "0.1,0.1,0.1,0.1"], diffuse_home)
    assert shown.returncode == 0, shown.stderr
    rows = {ln.split()[0]: ln for ln in shown.stdout.splitlines() if ln.startswith("  ") and "node(s)" in ln}
    assert "4 node(s)" in rows["none"] and "this plan" in rows["none"]
    assert all("1 node(s)" in rows[m] for m in ("int8", "int4", "fp8")), rows
    short = run_cli(["plan", wide, "--memory", "0.1,0.1"], diffuse_home)
    lines = [ln for ln in short.stderr.splitlines() if ln.strip()]
    assert short.returncode == 2 and len(lines) == 1, short.stderr
    assert "does not fit" in lines[0] and "--quantize int8 on 1" in lines[0], lines[0]
    fits = run_cli(["plan", wide, "--memory", "0.1,0.1", "--quantize", "int8"], diffuse_home)
    assert fits.returncode == 0 and "held int8 (--quantize)" in fits.stdout, fits.stderr


def _storages(module):
    """Every storage behind ``module``'s parameters and buffers, a quantized weight's inner tensors included."""
    for t in list(module.parameters()) + list(module.buffers()):
        t = getattr(t, "data", t)
        names = t.__tensor_flatten__()[0] if hasattr(t, "__tensor_flatten__") and type(t).__name__ != "Tensor" else None
        if names:
            for n in names:
                if getattr(t, n, None) is not None:
                    yield getattr(t, n).untyped_storage()
        else:
            yield t.untyped_storage()
