"""Splitting changes nothing: at one patch the split output equals plain diffusers, byte for byte.

The reference is computed by tests/reference.py with diffusers alone; the split
run goes through real node processes over tcp loopback, sealed.
"""

from __future__ import annotations

import families
import numpy as np
import pytest

from conftest import Reference, run_reference, run_split

# (family, nodes): every family over 2 nodes; over 3 for models of other shapes (two stacks, so one node holds
# nothing of the shorter one and passes it on; a nested stack with two streams; a video model)
CASES = [(f, 2) for f in families.FAMILIES] + [("odd", 2)] + [(f, 3) for f in ("flux", "ltx", "odd")]


@pytest.mark.parametrize("family,nodes", CASES, ids=[f"{f}-{n}nodes" for f, n in CASES])
def test_split_output_is_byte_identical_to_plain_diffusers(family, nodes, models, tmp_path, diffuse_home,
                                                          standard_references):
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
    check_written_file(family, report["out"], split, model)


def check_written_file(family: str, path: str, array: np.ndarray, model: str) -> None:
    """Open the file the run wrote and check it against the array and the model's own declarations."""
    import json

    kind = families.output_kind(family)
    if kind == "image":
        from PIL import Image

        with Image.open(path) as im:
            assert path.endswith(".png") and im.format == "PNG"
            assert im.size == (array.shape[2], array.shape[1])
    elif kind == "video":
        import imageio.v3 as iio

        assert path.endswith(".mp4")
        frames = iio.imread(path)
        assert frames.shape[0] == array.shape[1]  # every frame is there
        fps = iio.immeta(path)["fps"]
        declared = {"ltx": 25}.get(family, 16)  # LTX's pipeline declares frame_rate=25; others fall back to 16
        assert abs(fps - declared) < 1e-6
    else:
        import soundfile

        info = soundfile.info(path)
        with open(f"{model}/vae/config.json") as f:
            assert info.samplerate == json.load(f)["sampling_rate"]
        assert info.channels == array.shape[1] and info.frames == array.shape[2]


def test_a_bf16_checkpoint_loads_on_nodes_as_from_pretrained_loads_it(models, tmp_path, diffuse_home):
    """Weights stored in bf16 are computed in float32 by a plain load; nodes must do the same."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    model = str(tmp_path / "wan-bf16")
    shutil.copytree(models("wan"), model)
    weights = f"{model}/transformer/diffusion_pytorch_model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})
    kwargs = families.call_args("wan")
    reference = Reference(model, kwargs, str(tmp_path / "reference.npy"))  # side by side with the split run
    split, _ = run_split(model, kwargs, tmp_path, nodes=2, home=diffuse_home)
    assert split.tobytes() == reference.result().tobytes()
