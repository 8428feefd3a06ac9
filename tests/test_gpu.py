"""On a CUDA device (``pytest -m gpu``; skipped, with the reason, where torch sees none): Wan and Flux (tiny)
and Qwen2 (tiny) split over 2 local nodes on the GPU against the same model run whole on the GPU by plain
diffusers / transformers in a subprocess: bytes and tokens equal. Then a mixed ring, one node on the GPU and
one on the CPU: its difference from the whole GPU run is measured and printed (``diffuse verify``), not
assumed. cuBLAS is asked for its deterministic workspace (``CUBLAS_WORKSPACE_CONFIG``) in every process.
The GPU nodes send their answers through the device's asynchronous path (``diffuse.plan.devices.Outgoing``: a copy
stream, sealed once the next pass is queued; pass times from CUDA events), so the equalities cover it. A
sampled run with the client on the GPU is refused in one line before any node starts (its draws would differ
from a whole GPU run's). ``scripts/gpu-check.sh`` runs this file from a fresh clone.
``DIFFUSE_TEST_GPU_DEVICE=cpu`` rehearses the file on the CPU (every "GPU" end on the CPU, the nodes taking
the asynchronous path with ``DIFFUSE_REHEARSE_ASYNC=1``), to check the tests themselves where no GPU is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import families
from conftest import TESTS, THREADS, node_process, run_cli, run_client, subprocess_env

DEVICE = os.environ.get("DIFFUSE_TEST_GPU_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                 reason=f"torch sees no CUDA device (torch {torch.__version__}, "
                                        f"{'built without CUDA' if torch.version.cuda is None else 'CUDA ' + torch.version.cuda})")]

PROMPT = "Tell me a story about the moon."


@pytest.fixture(scope="module", autouse=True)
def deterministic_cublas():
    """Every process this module starts (references, nodes) and this one: cuBLAS's deterministic workspace; in
    a rehearsal on the CPU, nodes on the asynchronous path a GPU node takes."""
    said = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", **({"DIFFUSE_REHEARSE_ASYNC": "1"} if DEVICE == "cpu" else {})}
    before = {k: os.environ.get(k) for k in said}
    os.environ.update(said)
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _whole_on_gpu(model: str, kwargs: dict, out) -> np.ndarray:
    proc = subprocess.run([sys.executable, os.path.join(TESTS, "reference.py"), "--model", model, "--kwargs",
                           json.dumps(kwargs), "--seed", "0", "--threads", str(THREADS), "--device", DEVICE,
                           "--out", str(out)], env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return np.load(out)


def _name() -> str:
    return torch.cuda.get_device_name(0) if DEVICE.startswith("cuda") else DEVICE


def _args(kwargs: dict) -> list[str]:
    return [x for k, v in kwargs.items() for x in ("--arg", f"{k}={json.dumps(v)}")]


@pytest.mark.parametrize("family", ["wan", "flux"])
def test_split_over_two_gpu_nodes_equals_plain_diffusers_whole_on_the_gpu(family, models, tmp_path, diffuse_home):
    model, kwargs = models(family), families.call_args(family)
    whole = _whole_on_gpu(model, kwargs, tmp_path / "whole.npy")
    save, report = tmp_path / "split.npy", tmp_path / "report.json"
    run = run_client(["--model", model, "--seed", "0", "--threads", str(THREADS), "--local-nodes", "2",
                      "--device", DEVICE, "--save-array", str(save), "--report", str(report), "--quiet",
                      "--timeout", "300", "--out", str(tmp_path / "out"), *_args(kwargs)], diffuse_home)
    assert run.returncode == 0, run.stderr[-3000:]
    split = np.load(save)
    print(f"{family}: whole vs split on {_name()}: max abs difference "
          f"{float(np.abs(whole.astype(np.float64) - split).max()):.3g}")
    assert split.tobytes() == whole.tobytes()


def test_qwen2_split_over_two_gpu_nodes_gives_the_tokens_of_plain_transformers_on_the_gpu(tmp_path, diffuse_home):
    import lm_models

    model = lm_models.build("qwen2", str(tmp_path / "qwen2"))
    ref, tokens, report = tmp_path / "ref.json", tmp_path / "tokens.json", tmp_path / "report.json"
    proc = subprocess.run([sys.executable, os.path.join(TESTS, "lm_reference.py"), "--model", model, "--prompt",
                           PROMPT, "--max-new-tokens", "8", "--threads", str(THREADS), "--device", DEVICE,
                           "--out", str(ref)], env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = run_client(["--model", model, "--prompt", PROMPT, "--max-new-tokens", "8", "--threads", str(THREADS),
                      "--local-nodes", "2", "--device", DEVICE, "--dtype", "float32", "--save-tokens", str(tokens),
                      "--report", str(report), "--quiet", "--timeout", "300"], diffuse_home)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(ref) as f, open(tokens) as g, open(report) as h:
        want, got, rep = json.load(f), json.load(g), json.load(h)
    assert got["new_tokens"] == want["new_tokens"]
    assert rep["top"] == want["top"]
    if DEVICE != "cpu":  # a seeded draw with the client on the GPU: refused before any node starts
        sampled = run_client(["--model", model, "--prompt", PROMPT, "--max-new-tokens", "8", "--temperature", "0.8",
                              "--local-nodes", "2", "--device", DEVICE, "--quiet"], diffuse_home)
        lines = [ln for ln in sampled.stderr.splitlines() if ln.strip()]
        assert sampled.returncode == 2 and len(lines) == 1, sampled.stderr[-2000:]
        assert "generate run whole there draws from" in lines[0] and "decode greedily" in lines[0], lines[0]


def test_a_mixed_ring_one_gpu_node_one_cpu_node_runs_and_its_difference_is_measured(models, tmp_path,
                                                                                     diffuse_home):
    """Each slice computes on its own device, so the bits differ from either whole run: the difference is what
    ``diffuse verify`` prints, measured here and shown (``-s``), with each node's device from its hello."""
    from conftest import hello_report

    model, kwargs = models("wan"), families.call_args("wan")
    procs, addresses = [], []
    try:
        for k, device in enumerate((DEVICE, "cpu")):
            procs.append(node_process(["--model", model, "--ephemeral-key", "--threads", str(THREADS), "--device",
                                       device, "--dtype", "float32", "--blocks", f"{k + 1}/2",
                                       "--log-level", "WARNING"]))
            ready = json.loads(procs[-1].stdout.readline())
            addresses.append(f"{ready['address']}#{ready['key']}")
        done = run_cli(["verify", model, "--seed", "0", "--threads", str(THREADS), "--device", DEVICE,
                        "--dtype", "float32", "--nodes", ",".join(addresses), "--timeout", "300", "--quiet",
                        *_args(kwargs)], diffuse_home)
        said = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
        print(f"mixed ring ({DEVICE} node, cpu node) against whole on {_name()}: {said}")
        assert "max abs difference, whole vs split" in said, said
        devices = [hello_report(a.split("#")[0]).device for a in addresses]
        assert devices[0].startswith(DEVICE) and devices[1] == "cpu", devices
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)
