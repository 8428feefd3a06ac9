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
