"""Models that cannot be split are refused loudly and early: before any node is contacted."""

from __future__ import annotations

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
    weightless dry call sees it before any node is dialled: one line, exit 2."""
    from conftest import run_client

    model = models("wan_vace")
    run = run_client(["--model", model, "--prompt", "dance monkey", "--steps", "2", "--height", "32", "--width", "32",
                      "--frames", "9", "--nodes", "tcp://127.0.0.1:9", "--timeout", "5", "--quiet",
                      "--out", str(tmp_path / "x.mp4")], str(tmp_path))
    assert run.returncode == 2
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, run.stderr
    assert f"cannot split {model}" in lines[0] and "vace_blocks[1]" in lines[0] and "not a plain chain" in lines[0]
    assert "nothing was started" in lines[0] and "Traceback" not in run.stderr
    assert not (tmp_path / "known_nodes.json").exists()  # no hello was ever sent
