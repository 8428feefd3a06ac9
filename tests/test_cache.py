"""The first-block cache across the ring (``--cache-threshold``), against plain diffusers with the same rule.

tests/cache_reference.py runs the tiny Wan whole in a subprocess, its blocks wrapped by a small hook that
applies the rule by itself (block 0's residual compared with the last full step's, per branch; below the
threshold the other blocks' residual of that step is added instead of running them). Split over two real
nodes, each node adds its own slice's residual, so a skipped step is summed in two parts rather than one:
measured 9.2e-7 at most on the array (values in [0, 1]), against a change of 0.089 that skipping makes.
"""

from __future__ import annotations

import json
import subprocess
import sys

import families
import numpy as np
import pytest
import torch

from conftest import TESTS, THREADS, run_client, subprocess_env

STEPS = 6
THRESHOLD = 0.12  # the tiny Wan's first block changes by 11-14% a step: some steps skip, others not
ROUNDING = 1e-5  # residuals summed per node, not in one sum (measured 9.2e-7)


@pytest.fixture(scope="module")
def cached(models, tmp_path_factory, diffuse_home):
    """The reference (whole, and with the cache at THRESHOLD) computed in a subprocess while two local nodes
    start; a pipeline loaded by plain diffusers here; ``run(threshold, nodes)`` splits it over them."""
    import diffusers

    import diffuse
    from diffuse.local.nodes import start_local_nodes

    model = models("wan")
    kwargs = dict(families.call_args("wan"), num_inference_steps=STEPS)
    root = tmp_path_factory.mktemp("cache")
    outs = [str(root / "whole.npy"), str(root / "cached.npy")]
    reference = subprocess.Popen(
        [sys.executable, f"{TESTS}/cache_reference.py", "--model", model, "--kwargs", json.dumps(kwargs),
         "--threads", str(THREADS), "--threshold", "0", "--out", outs[0], "--threshold", str(THRESHOLD),
         "--out", outs[1]], env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    torch.set_num_threads(THREADS)
    nodes = start_local_nodes(model, 2, THREADS)
    pinned = [f"{n.address}#{n.key}" for n in nodes]
    pipe = diffusers.DiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)

    def run(threshold: float, groups: bool = False):
        # groups: each a whole ring of the same two nodes, in a session of its own
        with diffuse.split(pipe, nodes=[pinned, pinned] if groups else pinned, timeout=30,
                           cache_threshold=threshold) as split, torch.no_grad():
            out = pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(0), output_type="np")[0]
        return np.asarray(out), split

    try:
        said, err = reference.communicate(timeout=300)
        assert reference.returncode == 0, err[-3000:]
        counts = [json.loads(line) for line in said.splitlines() if line.startswith("{")]
        yield run, [np.load(o) for o in outs], counts
    finally:
        nodes.stop()


def test_skipped_steps_equal_the_rule_applied_to_plain_diffusers(cached):
    run, (whole, reference), counts = cached
    out, split = run(THRESHOLD)
    assert counts[1]["skipped"] > 0 and counts[1]["skipped"] < counts[1]["calls"], counts
    assert (split.cache_skipped, split.cache_calls) == (counts[1]["skipped"], counts[1]["calls"]), split.cache
    assert np.abs(out - reference).max() < ROUNDING
    assert np.abs(out - whole).max() > 10 * ROUNDING  # skipping changed the picture, as the rule does
    # each node kept one residual set per branch (guidance: two), and said how many steps it skipped
    reports = [r["first_block_cache"] for r in split.node_reports]
    assert all(r["skipped"] == counts[1]["skipped"] and r["bytes"] > 0 for r in reports), reports


def test_branches_on_two_groups_decide_each_for_itself(cached):
    """Two groups: every branch's calls go to its own group's session (the second sent ahead), which keeps
    that branch's residuals; the decisions are those of one ring."""
    run, (_, reference), counts = cached
    out, split = run(THRESHOLD, groups=True)
    assert split.cache_skipped == counts[1]["skipped"], split.cache
    assert split.ring.ahead_used == STEPS - 1 and split.ring.ahead_dropped == 0
    assert np.abs(out - reference).max() < ROUNDING


def test_a_threshold_that_skips_nothing_changes_no_bit(cached):
    run, (whole, _), counts = cached
    out, split = run(1e-9)  # every call tagged, residuals kept on the nodes, none used
    assert split.cache_calls == counts[0]["calls"] and split.cache_skipped == 0
    assert out.tobytes() == whole.tobytes()
    out, split = run(0)  # off: nothing tagged
    assert split.cache_calls == 0 and out.tobytes() == whole.tobytes()


def test_refused_with_patches_and_for_language_models(models, tmp_path, diffuse_home):
    import lm_models

    import diffuse
    from diffuse.errors import DiffuseError

    wan = models("wan")
    lm = lm_models.build("qwen2", str(tmp_path / "qwen2"))
    for argv, why in ((["--model", wan, "--patches", "2", "--cache-threshold", "0.1", "--prompt", "x"],
                       "--cache-threshold and --patches 2 do not go together"),
                      (["--model", lm, "--cache-threshold", "0.1", "--prompt", "x"],
                       "--cache-threshold applies to diffusion pipelines"),
                      (["--model", wan, "--cache-threshold", "-1", "--prompt", "x"], "a number of 0 or more")):
        run = run_client([*argv, "--quiet", "--out", str(tmp_path / "o.mp4")], diffuse_home)
        assert run.returncode == 2 and why in run.stderr, run.stderr[-1500:]
        assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
    with pytest.raises(DiffuseError, match="applies to diffusion pipelines"):
        diffuse.split(object(), model=lm, cache_threshold=0.1)
    with pytest.raises(DiffuseError, match="do not go together"):
        diffuse.split(object(), model=wan, patches=2, cache_threshold=0.1)
    torch.set_num_threads(THREADS)
