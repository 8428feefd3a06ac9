"""The diffuse command's plan and check verbs, as a user calls them."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import subprocess_env


def _diffuse(*args, home):
    return subprocess.run([sys.executable, "-m", "diffuse.cli", *args], env=subprocess_env(home),
                          capture_output=True, text=True, timeout=180)


def test_plan_prints_json_that_round_trips_unchanged(models, tmp_path):
    from diffuse.plan import SlicingPlan

    run = _diffuse("plan", models("flux"), "--nodes", "3", home=str(tmp_path))
    assert run.returncode == 0, run.stderr
    plan = SlicingPlan.from_json(run.stdout)
    assert plan.to_json() == run.stdout.strip()
    assert [s.path for s in plan.stacks] == ["transformer_blocks", "single_transformer_blocks"]
    # three stages, each holding a contiguous range of every stack, together covering it once
    assert len(plan.route) == 3
    for st in plan.stacks:
        ranges = [stage.slice_of(st.path) for stage in plan.route]
        assert ranges[0].start == 0 and ranges[-1].stop == st.length
        assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))


def test_check_reads_config_alone_and_states_the_verdict(models, tmp_path):
    model = models("wan")
    with open(f"{model}/transformer/config.json") as f:
        layers = json.load(f)["num_layers"]
    run = _diffuse("check", model, home=str(tmp_path))
    assert run.returncode == 0, run.stderr
    first, rest = run.stdout.splitlines()[0], run.stdout
    assert "splittable" in first
    assert "blocks" in rest and str(layers) in rest and "num_layers" in rest and "video" in rest
    refused = _diffuse("check", models("sdxl"), home=str(tmp_path))
    assert refused.returncode == 2 and "refused" in refused.stdout.splitlines()[0]
