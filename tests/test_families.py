"""Every tiny pipeline builds offline, and its reference run is reproducible byte
for byte: across two fresh loads in one process, and across processes.

The reference runs (tests/reference.py, two loads each) are conftest's
``standard_references``, computed once for the whole session in two processes
side by side; any left over run here, two at a time.
"""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import families  # noqa: E402

SEED = 0
THREADS = 1
RUN_PARALLEL = 2  # reference subprocesses at once (the CI machine has 2 cores)
# Families plus the one non-diffusers model: reference.py must import its library.
REFERENCE_MODELS = [*families.FAMILIES, "odd"]


@dataclass
class ReferenceRun:
    model_dir: str
    returncode: int
    stderr: str
    arrays: list  # one np.ndarray per fresh load, in order


def _selected_models(session) -> list[str]:
    wanted = set()
    for item in session.items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and Path(str(item.fspath)).name == Path(__file__).name:
            wanted.add(callspec.params.get("model"))
    return [m for m in REFERENCE_MODELS if m in wanted] or list(REFERENCE_MODELS)


@pytest.fixture(scope="session")
def reference_runs(request, models, tmp_path_factory, standard_references) -> dict[str, ReferenceRun]:
    """Each needed model (the session's shared builds) run by tests/reference.py with two fresh loads; the
    runs are conftest's, so a model test_exact already compared is not run again."""
    from conftest import reference_loads

    root = tmp_path_factory.mktemp("families")
    names = _selected_models(request.session)
    dirs = {name: models(name) for name in names}  # built one after another: builders seed torch's global RNG

    def run(name: str) -> ReferenceRun:
        try:
            arrays = reference_loads(dirs[name], families.call_args(name), str(root / f"{name}.npy"), SEED, THREADS)
        except AssertionError as exc:
            return ReferenceRun(dirs[name], 1, str(exc)[-4000:], [])
        return ReferenceRun(dirs[name], 0, "", arrays)

    with ThreadPoolExecutor(RUN_PARALLEL) as pool:
        return dict(zip(names, pool.map(run, names)))


def _run(reference_runs, model: str) -> ReferenceRun:
    run = reference_runs[model]
    assert run.returncode == 0 and len(run.arrays) == 2, f"reference.py failed on {model}:\n{run.stderr}"
    return run


@pytest.mark.parametrize("model", REFERENCE_MODELS)
def test_reference_output_has_the_expected_shape_and_is_finite(reference_runs, model):
    array = _run(reference_runs, model).arrays[0]
    assert array.dtype == np.float32
    assert array.shape == families.expected_shape(model)
    assert np.isfinite(array).all()


@pytest.mark.parametrize("model", REFERENCE_MODELS)
def test_reference_is_byte_identical_across_fresh_loads(reference_runs, model):
    first, second = _run(reference_runs, model).arrays
    assert first.tobytes() == second.tobytes()


# the first field of a diffusers pipeline output names what it made (ImagePipelineOutput.images, ...)
_FIELD_KINDS = {"images": "image", "frames": "video", "audios": "audio"}


@pytest.mark.parametrize("model", REFERENCE_MODELS)
def test_in_process_run_repeats_the_subprocess_and_fills_the_expected_kind(reference_runs, model):
    """The same run in this (pytest) process gives the subprocess's bytes; and the kind the tests expect
    (families, by rank) and the one ``diffuse check`` reads from config are both the field the
    pipeline's own output carries."""
    import torch
    from diffusers import DiffusionPipeline

    import reference
    from diffuse.cli.check import check

    run = _run(reference_runs, model)
    reference.import_component_libraries(run.model_dir)
    pipe = DiffusionPipeline.from_pretrained(run.model_dir)
    pipe.set_progress_bar_config(disable=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        with torch.no_grad():
            out = pipe(**families.call_args(model), generator=torch.Generator("cpu").manual_seed(SEED),
                       output_type="np")
    finally:
        torch.set_num_threads(threads)
    field = next(iter(out.keys()))
    here = out[field].cpu().numpy() if isinstance(out[field], torch.Tensor) else np.asarray(out[field])
    assert here.tobytes() == run.arrays[0].tobytes()
    assert field in _FIELD_KINDS, f"{type(pipe).__name__} returned {type(out).__name__} with fields {list(out.keys())}"
    assert families.output_kind(model) == _FIELD_KINDS[field]
    assert check(run.model_dir)["output_kind"] == _FIELD_KINDS[field]


def test_call_args_are_json_and_carry_no_generator():
    for name in [*families.FAMILIES, *families.EXTRAS]:
        args = families.call_args(name)
        assert json.loads(json.dumps(args)) == args
        assert "generator" not in args and "output_type" not in args


def test_odd_model_nests_its_stack_and_returns_two_reversed_streams(reference_runs):
    import torch
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(_run(reference_runs, "odd").model_dir)
    transformer = pipe.transformer
    assert type(transformer.trunk).__name__ == "OddTrunk"
    assert list(dict(transformer.trunk.named_children())) == ["layers"]
    seen = []
    transformer.trunk.layers[0].register_forward_hook(
        lambda m, args, kwargs, out: seen.append((kwargs, out)), with_kwargs=True
    )
    with torch.no_grad():
        pipe(**dict(families.call_args("odd"), num_inference_steps=1, guidance_scale=1.0), output_type="np")
    kwargs, (context_out, x_out) = seen[0]
    assert list(kwargs) == ["scale", "context", "opts", "x", "cond"]
    assert isinstance(kwargs["scale"], float) and kwargs["opts"] == {"gate": True}
    assert context_out.shape == kwargs["context"].shape and x_out.shape == kwargs["x"].shape
    assert kwargs["context"].shape[1] != kwargs["x"].shape[1]


def test_recurrent_model_holds_one_block_many_times(tmp_path):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(families.build("recurrent", tmp_path / "recurrent"))
    layers = pipe.transformer.layers
    assert len(layers) == 4 and all(block is pipe.transformer.block for block in layers)


def test_no_stack_model_has_no_module_list(tmp_path):
    import torch
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(families.build("no_stack", tmp_path / "no_stack"))
    assert not any(isinstance(m, torch.nn.ModuleList) for m in pipe.transformer.modules())


def test_remote_code_checkpoint_names_classes_shipped_inside_it(tmp_path):
    model_dir = Path(families.build("remote_code", tmp_path / "remote"))
    index = json.loads((model_dir / "model_index.json").read_text())
    module, _ = index["_class_name"]
    assert (model_dir / f"{module}.py").is_file()
    library, _ = index["transformer"]
    assert (model_dir / "transformer" / f"{library}.py").is_file()


def test_sdxl_denoiser_is_a_unet(tmp_path):
    index = json.loads((Path(families.build("sdxl", tmp_path / "sdxl")) / "model_index.json").read_text())
    assert index["unet"] == ["diffusers", "UNet2DConditionModel"] and "transformer" not in index


def test_default_model_is_the_shipped_trained_model_with_its_call_defaults():
    from diffuse.plan.shipped import SHIPPED_MODEL_NAME, default_model_dir

    path = Path(default_model_dir())
    assert path.name == SHIPPED_MODEL_NAME and (path / "model_index.json").is_file()
    index = json.loads((path / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    defaults = json.loads((path / "diffuse_defaults.json").read_text())
    assert defaults["height"] == defaults["width"] == 32 and defaults["num_frames"] == 9
