"""PipeFusion (--patches P > 1): what is cut, what is borrowed, what is exact, what travels.

The client runs in this process (one torch thread, like the nodes and the
reference); nodes are real processes on loopback, sealed, started once per
model without a fixed share, so the same nodes serve rings of one, two or three.
"""

from __future__ import annotations

import json
import subprocess
import sys

import families
import numpy as np
import pytest
import torch

from conftest import THREADS, run_reference, split_command, subprocess_env

STEPS = 3  # step 1 runs whole, steps 2 and 3 are cut into patches


class Nodes:
    """Node processes per model, started on first use, stopped at the end of the module."""

    def __init__(self):
        self.procs: dict[str, list] = {}

    def __call__(self, model: str, n: int) -> list[tuple[str, str]]:
        procs = self.procs.setdefault(model, [])
        while len(procs) < n:
            cmd = [sys.executable, "-m", "diffuse.node", "--model", model, "--ephemeral-key",
                   "--threads", str(THREADS), "--log-level", "WARNING"]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                          env=subprocess_env()))
        out = []
        for p in procs[:n]:
            if not hasattr(p, "ready"):
                p.ready = json.loads(p.stdout.readline())
            out.append((p.ready["address"], p.ready["key"]))
        return out

    def stop(self):
        for procs in self.procs.values():
            for p in procs:
                p.terminate()
        for procs in self.procs.values():
            for p in procs:
                p.wait(10)


@pytest.fixture(scope="module")
def nodes():
    n = Nodes()
    yield n
    n.stop()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)


def split_run(model: str, kwargs: dict, addresses, patches: int, attention: str = "auto") -> tuple[np.ndarray, dict]:
    """The pipeline's own __call__ here, its stack on the given nodes; returns the array and what was seen."""
    from diffuse.patches import attention_paths
    from diffuse.planner import analyze, denoiser_dtype, load_pipeline, make_plan
    from diffuse.ring import Ring
    from diffuse.run import output_array
    from diffuse.standin import Splitter

    subject, draft = analyze(model)
    pipe = load_pipeline(model)
    denoiser = getattr(pipe, subject.denoiser)
    plan = make_plan(subject, draft, [a for a, _ in addresses], [k for _, k in addresses], denoiser_dtype(denoiser))
    ring = Ring(plan, timeout_s=60, attention=attention)
    ring.open()
    try:
        splitter = Splitter(denoiser, plan, ring, patches=patches)
        splitter.install()
        with torch.no_grad():
            result = pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(0), output_type="np")
    finally:
        ring.close()
    seen = {"messages": ring.stats.messages, "returns": ring.stats.returns, "node_stats": ring.node_stats,
            "attention": attention_paths(ring.node_stats), "whole_steps": dict(splitter.whole_steps),
            "calls": splitter.patcher.calls if splitter.patcher else None, "plan": plan}
    return output_array(result), seen


def args_for(family: str, steps: int = STEPS) -> dict:
    return dict(families.call_args(family), num_inference_steps=steps)


# --------------------------------------------------------------------------- exactness where promised


@pytest.mark.parametrize("patches", [2, 3])
def test_patched_output_is_the_same_on_one_two_or_three_nodes(patches, models, nodes, diffuse_home):
    model = models("wan")
    runs = [split_run(model, args_for("wan"), nodes(model, n), patches) for n in (1, 2, 3)]
    (one, seen), (two, _), (three, _) = runs
    assert seen["calls"]["patched"] > 0, "the run was never cut into patches"
    assert one.tobytes() == two.tobytes() == three.tobytes()


@pytest.mark.parametrize("family,patches", [("wan", 4), ("pixart_sigma", 3)])
def test_one_step_with_patches_is_the_whole_model_exactly(family, patches, models, nodes, diffuse_home, tmp_path):
    model = models(family)
    kwargs = args_for(family, steps=1)
    reference = run_reference(model, kwargs, str(tmp_path / "reference.npy"))
    split, seen = split_run(model, kwargs, nodes(model, 2), patches)
    assert seen["calls"] == {"whole": seen["calls"]["whole"], "patched": 0}
    assert split.tobytes() == reference.tobytes(), f"max abs diff {np.abs(split - reference).max()}"


def test_patches_change_the_output_only_after_the_first_step(models, nodes, diffuse_home):
    model = models("wan")
    exact, _ = split_run(model, args_for("wan"), nodes(model, 2), 1)
    patched, seen = split_run(model, args_for("wan"), nodes(model, 2), 2)
    assert seen["calls"]["patched"] == 2 * 2  # steps 2 and 3, two guidance branches each
    assert exact.tobytes() != patched.tobytes()  # stale activations are an approximation...
    assert np.abs(patched - exact).max() < 0.5 * np.abs(exact).max()  # ...not a different picture


# --------------------------------------------------------------------------- the two attention paths


@pytest.mark.parametrize("family", ["wan", "pixart_sigma", "ltx", "stable_audio"])
def test_quick_attention_is_kept_only_where_it_agrees_with_plain(family, models, nodes, diffuse_home):
    model = models(family)
    exact, _ = split_run(model, args_for(family), nodes(model, 2), 1)
    quick, seen = split_run(model, args_for(family), nodes(model, 2), 2)
    plain, seen_plain = split_run(model, args_for(family), nodes(model, 2), 2, attention="plain")
    paths = seen["attention"]
    assert len(paths) == 1
    (stack, m), = paths.items()
    assert m["path"] == "quick", m
    assert all(b["agreement"] <= 1e-4 for b in m["blocks"].values())
    assert seen_plain["attention"][stack]["path"] == "plain"
    # on the patch where both ran they computed the same thing; later they differ only in how stale the
    # other patches' keys are (last step's timestep, or last step's input under this step's timestep), and
    # neither strays further from the exact output than the other
    off_quick, off_plain = np.abs(quick - exact).max(), np.abs(plain - exact).max()
    assert off_quick <= 1.5 * off_plain + 1e-6, (off_quick, off_plain)


def test_sana_convolution_outside_attention_falls_back_to_plain(models, nodes, diffuse_home):
    model = models("sana")
    auto, seen = split_run(model, args_for("sana"), nodes(model, 2), 2)
    forced, _ = split_run(model, args_for("sana"), nodes(model, 2), 2, attention="plain")
    (stack, m), = seen["attention"].items()
    assert m["path"] == "plain" and len(m["blocks"]) == 4
    assert all(b["agreement"] is None or b["agreement"] > 1e-4 for b in m["blocks"].values())
    assert auto.tobytes() == forced.tobytes()


# --------------------------------------------------------------------------- guidance branches


def test_guidance_branches_keep_separate_buffers(models, nodes, diffuse_home, monkeypatch):
    model = models("wan")  # Wan runs guidance as two calls per step
    ours, seen = split_run(model, args_for("wan"), nodes(model, 2), 2)
    assert {m["branches"] for m in seen["attention"].values()} == {2}
    assert {msg["branch"] for msg in seen["messages"]} == {0, 1}
    monkeypatch.setenv("DIFFUSE_SHARE_BRANCHES", "1")
    shared, seen_shared = split_run(model, args_for("wan"), nodes(model, 2), 2)
    assert {m["branches"] for m in seen_shared["attention"].values()} == {1}
    assert ours.tobytes() != shared.tobytes()  # sharing would borrow the other branch's activations


def test_stale_buffers_go_with_the_session(models, nodes, diffuse_home):
    from diffuse.plugins import transport_for

    model = models("wan")
    addresses = nodes(model, 2)
    _, seen = split_run(model, args_for("wan"), addresses, 2)
    held = [ns["stale"]["blocks"]["buffer_bytes"] for ns in seen["node_stats"]]
    assert all(b > 0 for b in held)  # what each node held for the session until it closed
    transport = transport_for(addresses[0][0])
    for address, _ in addresses:
        assert transport.request(address, {"op": "status"}, 10.0)["sessions"] == 0


# --------------------------------------------------------------------------- two streams


@pytest.mark.parametrize("family,stacks", [("flux", "single_transformer_blocks, transformer_blocks"),
                                           ("odd", "trunk.layers")])
def test_two_stream_model_runs_whole_steps_and_says_so(family, stacks, models, diffuse_home, tmp_path):
    model = models(family)
    kwargs = args_for(family)
    reference = run_reference(model, kwargs, str(tmp_path / "reference.npy"))
    save = tmp_path / "split.npy"
    cmd = split_command(model, kwargs, str(save), nodes=2, extra=["--patches", "3", "--out", str(tmp_path / "o.png")])
    proc = subprocess.run(cmd, env=subprocess_env(diffuse_home), capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "two streams" in line and "whole steps" in line]
    assert len(said) == 1, proc.stderr
    assert said[0].startswith(f"{stacks}: ")
    assert "patches honoured: 1" in " ".join(proc.stderr.split())
    assert np.load(save).tobytes() == reference.tobytes()


# --------------------------------------------------------------------------- the wire


def test_after_the_first_step_only_patches_and_the_timestep_travel(models, nodes, diffuse_home):
    model = models("wan")
    _, seen = split_run(model, args_for("wan"), nodes(model, 3), 2)
    names = seen["plan"].call_plans["blocks"]["slots"]  # args[0] hidden states, args[2] timestep projection
    later = [m for m in seen["messages"] if m.get("step", 0) > 1]
    assert later and all(not m.get("whole") for m in later)
    for m in later:
        assert {names[i] for i in m["fresh_slots"]} <= {"args[2]"}, m
    # the timestep travels once per step: both branches of a step share it
    per_step = {}
    for m in later:
        per_step[m["step"]] = per_step.get(m["step"], 0) + bool(m["fresh_slots"])
    assert set(per_step.values()) == {1}
    # every hop: a patch of hidden states, the timestep where it is new, and under 1 KiB besides
    sent = {m["seq"]: m for m in later}
    hops = [dict(ns["hop_bytes"]) for ns in seen["node_stats"]] + [dict(seen["returns"])]
    assert len(hops) == 4
    for seq, m in sent.items():
        for k, hop in enumerate(hops):
            carried = m["stream_bytes"] + (m["fresh_bytes"] if k < 3 else 0)  # the answer carries no timestep
            assert 0 < hop[seq] - carried <= 1024, (k, seq, hop[seq], m)
