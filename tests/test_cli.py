"""The diffuse command's plan and check verbs, as a user calls them."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import run_cli, subprocess_env


def _diffuse(*args, home):
    """``diffuse ARGS`` run by the command's own code in this process (``conftest.run_cli``)."""
    return run_cli(list(args), home)


def test_plan_prints_json_that_round_trips_unchanged(models, tmp_path):
    from diffuse.plan.contracts import SlicingPlan

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


def _fake_hub_cache(root, repo_id: str, source: str) -> str:
    """A Hugging Face cache as ``hf download`` leaves it: models--org--name/snapshots/<commit>/ and refs/main.

    Two snapshots, refs/main naming the second: the one a resolver must pick is not the first it would list."""
    import shutil

    repo = root / f"models--{repo_id.replace('/', '--')}"
    for commit in ("a" * 40, "b" * 40):
        shutil.copytree(source, repo / "snapshots" / commit, ignore=shutil.ignore_patterns("*.safetensors"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("b" * 40)
    return str(repo / "snapshots" / ("b" * 40))


def _resolve_in(env: dict, *models: str) -> subprocess.CompletedProcess:
    """resolve_model for each model, and for a Hub id diffusers' own resolver too (what from_pretrained loads
    from), in one fresh process: huggingface_hub reads HF_HUB_CACHE once, at import."""
    code = ("import sys; from diffusers import DiffusionPipeline; from diffuse.plan.resolve import resolve_model\n"
            "for model in sys.argv[1:]:\n"
            "    print(resolve_model(model))\n"
            "    if '/' in model: print(DiffusionPipeline.download(model))\n")
    return subprocess.run([sys.executable, "-c", code, *models], env=env, capture_output=True, text=True,
                          timeout=180)


def test_a_shipped_model_by_name_and_a_hub_id_in_the_local_cache_resolve_offline(tmp_path):
    """The shipped model by its name (a Hub cache beside it that does not hold it), and a Hub id in the local cache
    where diffusers finds it; ``diffuse check`` takes both."""
    from diffuse.plan.shipped import SHIPPED_MODEL_NAME, default_model_dir

    snapshot = _fake_hub_cache(tmp_path / "hub", "tiny-org/tiny-wan", default_model_dir())
    env = dict(subprocess_env(str(tmp_path)), HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1", COLUMNS="400")
    run = _resolve_in(env, SHIPPED_MODEL_NAME, "tiny-org/tiny-wan")
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == [default_model_dir(), snapshot, snapshot], run.stdout
    for model, path in ((SHIPPED_MODEL_NAME, default_model_dir()), ("tiny-org/tiny-wan", snapshot)):
        check = subprocess.run([sys.executable, "-m", "diffuse.cli.command", "check", model], env=env,
                               capture_output=True, text=True, timeout=180)
        assert check.returncode == 0 and check.stdout.splitlines()[0] == "splittable", check.stderr[-2000:]
        assert f"model {path} (transformer: WanTransformer3DModel)" in check.stdout


def test_an_unknown_model_names_what_was_tried_and_what_ships(tmp_path):
    env = dict(subprocess_env(str(tmp_path)), HF_HUB_CACHE=str(tmp_path / "empty-hub"), COLUMNS="400")
    run = subprocess.run([sys.executable, "-m", "diffuse.cli.command", "check", "no-org/no-model"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 2
    said = " ".join((run.stdout + run.stderr).split())
    assert f"no folder {tmp_path / 'no-org' / 'no-model'}" in said and "shipped: tiny-wan-shapes" in said
    assert f"not fetched here nor in the Hugging Face cache {tmp_path / 'empty-hub'}" in said
    assert "the Hub may not be reached (HF_HUB_OFFLINE is set)" in said


def test_check_remembers_a_verdict_until_the_model_changes(tmp_path, monkeypatch):
    import shutil

    from rich.console import Console

    from diffuse.cli.check import print_check
    from diffuse.plan.shipped import default_model_dir

    monkeypatch.setenv("DIFFUSE_HOME", str(tmp_path / "home"))
    model = tmp_path / "model"
    shutil.copytree(default_model_dir(), model, ignore=shutil.ignore_patterns("*.safetensors"))

    def lines():
        console = Console(record=True, width=400)
        assert print_check(str(model), console, cache=True) == 0
        return console.export_text().splitlines()

    first, again = lines(), lines()
    assert "(cached)" not in first[1] and "(cached)" in again[1]
    assert first[0] == again[0] == "splittable" and first[2:] == again[2:]
    config = model / "transformer" / "config.json"
    config.write_text(config.read_text().replace('"num_layers": 4', '"num_layers": 3'))
    changed = lines()
    assert "(cached)" not in changed[1] and "blocks: 3 x WanTransformerBlock" in changed[3]


def test_every_subcommand_and_benchmark_names_a_function_that_exists():
    """The tables the commands dispatch from (``diffuse COMMAND``, ``python -m diffuse.bench NAME``) name their
    modules as strings, imported only when one runs: each must import and give a function."""
    import importlib

    from diffuse.bench.command import SUBCOMMANDS
    from diffuse.cli.command import COMMANDS

    targets = [c.target.partition(":")[::2] for c in COMMANDS.values()] + list(SUBCOMMANDS.values())
    assert len(targets) >= 15
    missing = [f"{m}:{f}" for m, f in targets if not callable(getattr(importlib.import_module(m), f, None))]
    assert not missing, f"a command names what is not there: {missing}"
