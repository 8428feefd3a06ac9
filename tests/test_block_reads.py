"""A model that reads a block outside its stack's loop (tests/oddmodel: ``PeekingTransformer``,
``ValueReadingTransformer``): what the client's weightless copy answers exactly is served, and the split
output is byte-identical to plain diffusers; a read of a weight's values is refused in one line, exit 2,
before any node is contacted."""

from __future__ import annotations

import families
import numpy as np
import pytest

from conftest import run_client, run_reference, run_split


@pytest.fixture(scope="module")
def readers(tmp_path_factory) -> dict[str, str]:
    """The odd pipeline around each reading transformer, saved once."""
    odd = families._oddmodel()
    root = tmp_path_factory.mktemp("block-reads")
    built = {}
    for name in ("PeekingTransformer", "ValueReadingTransformer"):
        families._seed(0)
        built[name] = families._odd_pipeline(getattr(odd, name)(num_blocks=4), str(root / name), 0)
    return built


def test_attributes_and_shapes_read_outside_the_loop_split_byte_identical(readers, tmp_path, diffuse_home):
    model, kwargs = readers["PeekingTransformer"], families.call_args("odd")
    reference = run_reference(model, kwargs, str(tmp_path / "reference.npy"))
    split, report = run_split(model, kwargs, tmp_path, nodes=2, home=diffuse_home)
    assert split.shape == reference.shape == tuple(families.expected_shape("odd")) and np.isfinite(split).all()
    assert split.tobytes() == reference.tobytes(), f"max abs diff {np.abs(split - reference).max()}"
    assert report["calls"] >= 2 and report["client_block_params"] == 0


def test_weights_values_read_outside_the_loop_are_refused_before_any_node_is_contacted(readers, tmp_path):
    model = readers["ValueReadingTransformer"]
    run = run_client(["--model", model, "--prompt", "a cat", "--nodes", "tcp://127.0.0.1:9", "--timeout", "5",
                      "--quiet", "--out", str(tmp_path / "x.png")], str(tmp_path))
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert lines[0] == (f"error: cannot split {model}: the model reads the values of trunk.layers[0].gate outside "
                        "the loop over trunk.layers: the blocks' weights are on the nodes, not here, so it cannot be "
                        "split; nothing was started"), lines[0]
    assert not (tmp_path / "known_nodes.json").exists()  # no hello was ever sent
