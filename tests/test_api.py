"""The Python API: ``diffuse.from_pretrained`` and ``diffuse.split``, against plain diffusers.

The snippet the README shows runs here on tiny pipelines saved to disk, through
two real local nodes, and must equal plain diffusers run whole in a subprocess
byte for byte. The README's own example runs as written, at torch's default
thread count: a default split run is exact without asking for it.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys

import families
import numpy as np
import pytest
import torch

from conftest import ROOT, THREADS, Reference, subprocess_env


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("family", ["wan", "flux"])
def test_the_readme_snippet_is_byte_identical_to_plain_diffusers(family, models, tmp_path, diffuse_home, one_thread):
    import diffuse

    model = models(family)
    kwargs = dict(families.call_args(family), prompt="a paper boat")
    reference = Reference(model, kwargs, str(tmp_path / "reference.npy"), seed=7)  # side by side with the split

    pipe = diffuse.from_pretrained(model)
    with diffuse.split(pipe, local_nodes=2) as ring:
        out = pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(7), output_type="np")
    split = np.asarray(out[0])
    reference = reference.result()
    assert split.tobytes() == reference.tobytes(), f"max abs diff {np.abs(split - reference).max()}"
    # the client held none of the blocks; the nodes did the passes and say how long they were busy
    held = [p for stack in ring.splitter.originals.values() for p in stack.parameters()]
    assert held and all(p.device.type == "meta" for p in held)
    stats = ring.stats
    assert stats.passes > 0 and stats.bytes_sent > 0 and len(stats.nodes) == 2
    assert all(n.messages == stats.passes and n.busy_s > 0 for n in stats.nodes)
    assert f"{stats.passes} passes" in str(stats)


def test_a_pipeline_from_diffusers_itself_splits_and_can_be_split_again(models, tmp_path, diffuse_home, one_thread):
    import diffusers

    import diffuse

    model = models("wan")
    kwargs = families.call_args("wan")
    reference = Reference(model, kwargs, str(tmp_path / "reference.npy"))  # side by side with the splits
    from test_release import hooks_of, model_layout, only_refusals_added, reloaded

    pipe = diffusers.DiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    layout, hooks = model_layout(pipe.transformer), hooks_of(pipe.transformer)
    saved = {k: v.detach().clone() for k, v in pipe.transformer.state_dict().items()}
    runs = []
    for _ in range(2):  # a second split of the same pipeline: new nodes, new session, the same answer
        with diffuse.split(pipe, local_nodes=2):
            runs.append(pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(0), output_type="np")[0])
        # released: its own modules again, no hook left but the refusals of the blocks handed out
        assert model_layout(pipe.transformer) == layout and only_refusals_added(pipe.transformer, hooks)
    reference = reference.result()
    assert runs[0].tobytes() == runs[1].tobytes() == reference.tobytes()
    # the blocks it handed out are freed here (meta), and outside a split the pipeline says why it cannot run
    assert all(p.device.type == "meta" for p in pipe.transformer.blocks.parameters())
    with pytest.raises(diffuse.DiffuseError, match="inside `with diffuse.split"):
        pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(0), output_type="np")
    # its blocks loaded again, it is the pipeline it was: it runs whole, to the same bytes
    reloaded(pipe.transformer, saved)
    whole = pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(0), output_type="np")[0]
    assert whole.tobytes() == reference.tobytes()
    assert model_layout(pipe.transformer) == layout and hooks_of(pipe.transformer) == hooks


def _readme_example() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "diffuse.split(" in b]
    assert len(blocks) == 1, "the README shows one diffuse.split example"
    return blocks[0]


def test_the_readme_example_runs_as_written_and_is_exact_at_default_threads(tmp_path, diffuse_home):
    example = _readme_example()
    # the example as written, plus one line that saves what it made
    script = example + "\nimport numpy as np\nnp.save(%r, np.asarray(frames))\n" % str(tmp_path / "split.npy")
    # the same call, whole, by plain diffusers in a fresh process at torch's default thread count, side by side
    call = next(n for n in ast.walk(ast.parse(example)) if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Name) and n.func.id == "pipe")
    kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg != "generator"}
    model = ast.literal_eval(next(n for n in ast.walk(ast.parse(example)) if isinstance(n, ast.Call)
                                  and getattr(n.func, "attr", "") == "from_pretrained").args[0])
    from diffuse.plan.resolve import resolve_model

    reference = Reference(resolve_model(model), kwargs, str(tmp_path / "reference.npy"), seed=7, threads=0)
    run = subprocess.run([sys.executable, "-c", script], env=subprocess_env(diffuse_home), capture_output=True,
                         text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "passes" in run.stdout  # print(ring.stats)
    reference = reference.result()
    split = np.load(tmp_path / "split.npy")
    assert split.tobytes() == reference.tobytes(), f"max abs diff {np.abs(split - reference).max()}"


def test_a_default_run_on_sana_equals_plain_diffusers_at_default_settings(models, tmp_path, diffuse_home):
    """Sana's last bits change with the thread count (identical at equal threads, not by default before
    local nodes took the client's count): ``python -m diffuse.run`` with no ``--threads`` must be exact."""
    model = models("sana")
    kwargs = families.call_args("sana")
    cmd = [sys.executable, "-m", "diffuse.run", "--model", model, "--quiet", "--save-array", str(tmp_path / "split.npy"),
           "--out", str(tmp_path / "out.png")]
    for k, v in kwargs.items():
        cmd += ["--arg", f"{k}={json.dumps(v)}"]
    reference = Reference(model, kwargs, str(tmp_path / "reference.npy"), threads=0)  # side by side with the run
    run = subprocess.run(cmd, env=subprocess_env(diffuse_home), capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    reference = reference.result()
    split = np.load(tmp_path / "split.npy")
    assert split.tobytes() == reference.tobytes(), f"max abs diff {np.abs(split - reference).max()}"


def test_two_splits_in_one_process_hear_only_their_own_nodes(models, diffuse_home, one_thread):
    """What a client hears of its nodes (their hellos, the links it measured) belongs to the split that heard
    it: two splits open at once in one process, each over its own local node, never plan from the other's."""
    import diffuse

    model = models("wan")
    with diffuse.split(diffuse.from_pretrained(model), local_nodes=1) as first, \
            diffuse.split(diffuse.from_pretrained(model), local_nodes=1) as second:
        mine, theirs = [s.address for s in first.plan.route], [s.address for s in second.plan.route]
        assert mine and theirs and not set(mine) & set(theirs)
        assert first.repair.heard is not second.repair.heard
        for heard, own, other in ((first.repair.heard, mine, theirs), (second.repair.heard, theirs, mine)):
            assert all(heard.report_of(a) is not None for a in own)  # its own nodes' hellos, for placement
            assert all(heard.report_of(a) is None for a in other)  # and nothing of the other split's
            assert all(heard.link("client", a) is not None for a in own)
            assert all(heard.link("client", a) is None for a in other)
