"""Models that cannot be split are refused loudly and early: before any node is contacted."""

from __future__ import annotations

import json
import os

import pytest

from conftest import run_cli, run_client

REFUSALS = {
    "sdxl": "a multi-resolution U-Net whose skip connections cross resolutions is not a chain",
    "remote_code": "trust_remote_code",
    "no_stack": "no ModuleList of repeated blocks",
    "recurrent": "recurrent stack",
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_unsplittable_model_is_refused_before_any_node_is_contacted(name, models, tmp_path):
    """``python -m diffuse.run``'s own code (``run_client``), in this process."""
    model = models(name)
    # a node address where nothing listens: a refusal must come first, not a connection timeout
    run = run_client(["--model", model, "--prompt", "a cat", "--nodes", "tcp://127.0.0.1:9", "--timeout", "5",
                      "--out", str(tmp_path / "x.png")], str(tmp_path))
    assert run.returncode == 2
    assert f"cannot split {model}" in run.stderr
    assert REFUSALS[name] in run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "known_nodes.json").exists()  # no hello was ever sent


def test_verify_reports_zero_difference_at_one_patch(models, tmp_path, monkeypatch):
    """``diffuse verify`` through the command's own code, in this process."""
    import families

    model = models("pixart_sigma")
    argv = ["verify", model, "--threads", "1"]
    for k, v in families.call_args("pixart_sigma").items():
        argv += ["--arg", f"{k}={__import__('json').dumps(v)}"]
    monkeypatch.chdir(tmp_path)
    run = run_cli(argv, str(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    assert "max abs difference, whole vs split (1 patch): 0  (byte-identical)" in run.stdout


def test_stacks_the_denoiser_works_between_are_refused_before_any_node_starts(models, tmp_path):
    """Wan VACE: its side stack's every block's output is kept (hints), and the hints are added to the hidden
    state after chosen main blocks, so neither stack is a chain one pass through the nodes can stand for. The
    analysis sees it from the config (``vace_layers`` sizes ``vace_blocks``, one position in ``blocks`` each): the
    run, ``diffuse check``, ``diffuse plan`` and ``diffuse.split`` all refuse it in the same one line, exit 2,
    before any node is started or dialled; and so does the check with two such experts."""
    from diffusers import WanVACEPipeline

    import diffuse
    from diffuse.errors import RefusedModel

    model = models("wan_vace")
    run = run_client(["--model", model, "--prompt", "dance monkey", "--steps", "2", "--height", "32", "--width", "32",
                      "--frames", "9", "--nodes", "tcp://127.0.0.1:9", "--timeout", "5", "--quiet",
                      "--out", str(tmp_path / "x.mp4")], str(tmp_path))
    assert run.returncode == 2
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, run.stderr
    refusal = lines[0].removeprefix("error: ")
    assert refusal.startswith(f"cannot split {model}: vace_blocks (2 blocks, one per entry of the config's "
                              "vace_layers) feeds hints into blocks after blocks[0], blocks[2]"), refusal
    assert "not a plain chain" in refusal and "nothing was started" in refusal and "Traceback" not in run.stderr
    check = run_cli(["check", model], str(tmp_path))
    assert check.returncode == 2 and check.stdout.splitlines()[0] == "refused: " + refusal.split(": ", 1)[1], \
        check.stdout
    plan = run_cli(["plan", model, "--nodes", "2"], str(tmp_path))
    assert plan.returncode == 2 and [ln for ln in plan.stderr.splitlines() if ln.strip()] == [lines[0]], plan.stderr
    pipe = WanVACEPipeline.from_pretrained(model)  # loaded by plain diffusers, whole
    with pytest.raises(RefusedModel) as refused:
        diffuse.split(pipe, local_nodes=2)  # refused as it is made: no node started
    assert str(refused.value) == refusal
    assert not (tmp_path / "known_nodes.json").exists()  # no hello was ever sent
    # two VACE experts (transformer and transformer_2, as Wan 2.2's VACE pipelines have): each is judged alike
    two = tmp_path / "two-experts"
    two.mkdir()
    for name in os.listdir(model):
        if name != "model_index.json":
            os.symlink(os.path.join(model, name), two / name)
    os.symlink(os.path.join(model, "transformer"), two / "transformer_2")
    with open(os.path.join(model, "model_index.json")) as f:
        index = json.load(f)
    with open(two / "model_index.json", "w") as f:
        json.dump({**index, "transformer_2": index["transformer"], "boundary_ratio": 0.875}, f)
    check = run_cli(["check", str(two)], str(tmp_path))
    assert check.returncode == 2 and check.stdout.startswith(
        "refused: transformer.vace_blocks (2 blocks, one per entry of the config's transformer.vace_layers) feeds "
        "hints into transformer.blocks"), check.stdout
