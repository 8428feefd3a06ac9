"""Devices and dtypes on the CPU: ``--device`` explicit and ``auto``, weights loaded in the dtype asked, a
device torch does not see refused in one line, and a bfloat16 ring against plain diffusers and plain
transformers run whole in bfloat16 (bytes and tokens equal). The same on a GPU: tests/test_gpu.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import families
from conftest import TESTS, THREADS, node_process, run_cli, run_client, run_node, subprocess_env

PROMPT = "Tell me a story about the moon."
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device: nothing to refuse")


def _start(model: str, extra: list[str], env: dict | None = None, stderr=subprocess.DEVNULL) -> tuple:
    proc = node_process(["--model", model, "--ephemeral-key", "--threads", str(THREADS), "--log-level", "WARNING",
                         *extra], env=env, stderr=stderr)
    ready = json.loads(proc.stdout.readline())
    return proc, f"{ready['address']}#{ready['key']}"


def _reference(script: str, args: list[str]) -> None:
    proc = subprocess.run([sys.executable, os.path.join(TESTS, script), *args], env=subprocess_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@no_cuda
def test_a_device_torch_does_not_see_is_refused_in_one_line_before_anything_loads(models, diffuse_home):
    wan = models("wan")
    for argv, run in ((["--model", wan, "--device", "cuda"], run_node),
                      (["--model", wan, "--device", "cuda:1", "--prompt", "x"], run_client),
                      (["chat", "--model", wan, "--device", "cuda"], run_cli)):
        done = run(argv, diffuse_home)
        code, text = done.returncode, done.stderr
        lines = [ln for ln in text.splitlines() if ln.strip()]
        assert code == 2 and len(lines) == 1, text
        assert f"torch sees no CUDA device (torch {torch.__version__}" in lines[0], lines[0]
        assert "built without CUDA" in lines[0] or "0 CUDA devices visible" in lines[0], lines[0]
    done = run_client(["--model", wan, "--device", "tpu"], diffuse_home)
    assert done.returncode == 2 and "--device tpu: choose auto, cpu, cuda, cuda:N or mps" in done.stderr


def test_the_wire_on_the_cpu_is_untouched():
    from diffuse.plan.devices import Compute, resolve_device, to_device, to_host

    t = [torch.arange(6.0).reshape(2, 3), torch.ones(2, dtype=torch.bfloat16)]
    assert to_host(t) is t and to_device(t, torch.device("cpu")) is t  # the same objects: the same bytes
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        assert Compute.of("auto", "auto").dtype is None  # the dtype each client asks, as before devices


def test_bf16_ring_on_cpu_nodes_explicit_and_auto_equals_plain_diffusers_whole_in_bf16(models, tmp_path,
                                                                                       diffuse_home):
    """Two nodes, one started with --device cpu, one with --device auto (the CPU here), both --dtype bfloat16:
    they say so at hello and hold their blocks in bfloat16; the client in bfloat16 makes the bytes plain
    diffusers makes whole with torch_dtype=bfloat16 (Wan keeps its norms and modulation table in float32
    there, and so do the nodes). The second node rehearses a GPU node's asynchronous answers
    (``DIFFUSE_REHEARSE_ASYNC``: each answer copied, and sealed only once the next pass has run or the node
    has nothing else to do), so their order and bytes are checked here too."""
    from conftest import hello_report

    wan = models("wan")
    kwargs = families.call_args("wan")
    ref = tmp_path / "ref.npy"
    log = open(tmp_path / "node2.log", "w")
    nodes = [_start(wan, ["--device", "cpu", "--dtype", "bfloat16", "--blocks", "1/2"]),
             _start(wan, ["--device", "auto", "--dtype", "bfloat16", "--blocks", "2/2"],
                    env=dict(subprocess_env(), DIFFUSE_REHEARSE_ASYNC="1"), stderr=log)]
    try:
        _reference("reference.py", ["--model", wan, "--kwargs", json.dumps(kwargs), "--seed", "0", "--threads",
                                    str(THREADS), "--dtype", "bfloat16", "--out", str(ref)])
        save = tmp_path / "split.npy"
        argv = ["--model", wan, "--seed", "0", "--threads", str(THREADS), "--nodes", ",".join(a for _, a in nodes),
                "--dtype", "bfloat16", "--save-array", str(save), "--quiet", "--timeout", "120",
                "--out", str(tmp_path / "out.mp4"), *[x for k, v in kwargs.items() for x in ("--arg", f"{k}={json.dumps(v)}")]]
        run = run_client(argv, diffuse_home)
        assert run.returncode == 0, run.stderr[-3000:]
        assert np.load(save).tobytes() == np.load(ref).tobytes()
        float32 = run_client([*argv[:argv.index("--dtype")], *argv[argv.index("--dtype") + 2:]], diffuse_home)
        assert float32.returncode == 2
        assert "this node computes in bfloat16 (--dtype bfloat16); the client asks float32" in float32.stderr
        for _, address in nodes:
            seen = hello_report(address.split("#")[0])
            assert seen.device == "cpu" and seen.dtype == "bfloat16", seen
            assert seen.holds and {d for _, _, d in seen.holds} == {"bfloat16"}, seen.holds
    finally:
        for proc, _ in nodes:
            proc.terminate()
        for proc, _ in nodes:
            proc.wait(10)
        log.close()
    assert "rehearsing an accelerator's asynchronous answers" in (tmp_path / "node2.log").read_text()


def test_bf16_language_model_split_over_local_nodes_gives_the_tokens_of_plain_transformers_in_bf16(
        tmp_path, diffuse_home):
    import lm_models

    model = lm_models.build("qwen2", str(tmp_path / "qwen2"))
    ref, tokens, report = tmp_path / "ref.json", tmp_path / "tokens.json", tmp_path / "report.json"
    _reference("lm_reference.py", ["--model", model, "--prompt", PROMPT, "--max-new-tokens", "6", "--threads",
                                   str(THREADS), "--dtype", "bfloat16", "--out", str(ref)])
    run = run_client(["--model", model, "--prompt", PROMPT, "--max-new-tokens", "6", "--threads", str(THREADS),
                      "--local-nodes", "2", "--device", "cpu", "--dtype", "bfloat16", "--save-tokens", str(tokens),
                      "--report", str(report), "--quiet", "--timeout", "120"], diffuse_home)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(ref) as f, open(tokens) as g, open(report) as h:
        want, got, rep = json.load(f), json.load(g), json.load(h)
    assert got["new_tokens"] == want["new_tokens"] and got["input_ids"] == want["input_ids"]
    assert rep["top"] == want["top"]  # each step's best logits, the same bfloat16 values bit for bit


def test_a_node_holds_its_blocks_in_the_asked_dtype_as_plain_diffusers_loads_them(models):
    """What a node's store holds in bfloat16 on the CPU, tensor by tensor, against diffusers'
    from_pretrained(torch_dtype=bfloat16): the same values in the same dtypes, float32-kept modules included."""
    from diffusers import WanTransformer3DModel

    from diffuse.plan.analysis import ModelSubject
    from diffuse.node.blockstore import BlockStore
    from diffuse.plan.devices import Compute
    from diffuse.plan.contracts import Slice
    from diffuse.plan.planner import config_draft

    wan = models("wan")
    subject = ModelSubject.from_path(wan)
    stacks = config_draft(subject, wanted={"stacks"})["stacks"]
    store = BlockStore(wan, subject, stacks, Compute(torch.device("cpu"), torch.bfloat16, fixed=True))
    store.load([Slice("blocks", 0, 2)])
    whole = WanTransformer3DModel.from_pretrained(os.path.join(wan, "transformer"), torch_dtype=torch.bfloat16)
    kinds = set()
    for i, block in store.blocks_of(Slice("blocks", 0, 2)):
        want = whole.blocks[i].state_dict()
        got = block.state_dict()
        assert got.keys() == want.keys()
        for name, t in got.items():
            assert t.dtype == want[name].dtype and t.device.type == "cpu" and torch.equal(t, want[name]), name
            kinds.add(t.dtype)
    assert kinds == {torch.bfloat16, torch.float32}  # Wan's norms and modulation table stay float32, as diffusers keeps them
