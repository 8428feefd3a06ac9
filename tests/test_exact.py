"""Splitting changes nothing: at one patch the split output equals plain diffusers, byte for byte.

The reference is computed by tests/reference.py with diffusers alone; the split
run goes through real node processes over tcp loopback, sealed.
"""

from __future__ import annotations

import families
import numpy as np
import pytest

from conftest import run_reference, run_split

# (family, nodes): every family over 2 nodes, and over 3 where its stacks give each node a block
CASES = [(f, 2) for f in families.FAMILIES] + [("odd", 2)] + [
    (f, 3) for f in ("wan", "flux", "sd3", "pixart_sigma", "ltx", "odd")
]


@pytest.mark.parametrize("family,nodes", CASES, ids=[f"{f}-{n}nodes" for f, n in CASES])
def test_split_output_is_byte_identical_to_plain_diffusers(family, nodes, models, tmp_path, diffuse_home):
    model = models(family)
    kwargs = families.call_args(family)
    reference = run_reference(model, kwargs, str(tmp_path / "reference.npy"))
    split, report = run_split(model, kwargs, tmp_path, nodes=nodes, home=diffuse_home)

    assert reference.dtype == np.float32 and split.dtype == np.float32
    assert split.shape == reference.shape == tuple(families.expected_shape(family))
    assert np.isfinite(reference).all()
    assert split.tobytes() == reference.tobytes(), f"max abs diff {np.abs(split - reference).max()}"
    # the ring really carried the stacks: one pass per stack per denoiser call
    assert report["calls"] >= 2 and report["bytes_sent"] > 0
    # the client holds none of the blocks it handed out
    assert report["client_block_params"] == 0
