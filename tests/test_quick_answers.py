"""Answers that need no torch: a refused size on the shipped model, a folder that is no model, a shipped model's
check, and the first status line of a run all come before torch, diffusers or transformers is imported.

What is shown is which modules the command imported before it answered (each command run in a fresh
interpreter, ``sys.modules`` read as it ends or as its first line appears), not how many seconds it took: the
seconds follow from the imports and vary with the machine's load. The kept verdicts these answers read
(``diffuse_verdict.json`` in each shipped model's folder) are compared here with a verdict worked out afresh and
with the weightless call itself.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from conftest import subprocess_env

HEAVY = ("torch", "diffusers", "transformers")
README_CLIENT = ["--prompt", "a paper boat", "--steps", "30", "--height", "480", "--width", "832", "--frames", "33"]
# runs ``diffuse ARGV`` as the command does, then says on stderr which heavy libraries it imported
RUN_AND_SAY_IMPORTS = (
    "import sys\n"
    "from diffuse import flags\n"
    "from diffuse.cli import command\n"
    "code = command.dispatch(sys.argv[1:])\n"
    f"print('imported:', *[m for m in {HEAVY!r} if m in sys.modules], file=sys.stderr)\n"
    "flags.exit_now(code)\n"
)
# marks on stderr the moment torch starts being imported, then runs ``diffuse ARGV``
MARK_TORCH = (
    "import sys\n"
    "class Mark:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'torch':\n"
    "            print('importing torch', file=sys.stderr, flush=True)\n"
    "            sys.meta_path.remove(self)\n"
    "sys.meta_path.insert(0, Mark())\n"
    "from diffuse import flags\n"
    "from diffuse.cli import command\n"
    "flags.exit_now(command.dispatch(sys.argv[1:]))\n"
)


@pytest.fixture(autouse=True)
def shipped_verdicts_current():
    """The shipped verdicts hold only for the libraries they were made with (their key includes the versions):
    with other versions installed they are rightly unused, and these tests say so rather than fail."""
    import json

    from diffuse.cli.check import VERDICT_FILE, library_versions
    from diffuse.plan.shipped import shipped_models

    for name, path in shipped_models().items():
        with open(os.path.join(path, VERDICT_FILE)) as f:
            made_with = json.load(f).get("libraries")
        if made_with != library_versions():
            pytest.skip(f"{name}'s kept verdict was made with {made_with}, these libraries are {library_versions()}: "
                        f"python -m diffuse.cli.check keep {' '.join(shipped_models())} makes them anew")


def _diffuse(argv: list[str], home: str, program: str = RUN_AND_SAY_IMPORTS, columns: int = 400):
    env = dict(subprocess_env(home), COLUMNS=str(columns))
    env.pop("DIFFUSE_DEVICE", None)  # as a user's shell has it: a device named there is checked with torch
    run = subprocess.run([sys.executable, "-c", program, *argv], env=env, capture_output=True, text=True,
                         timeout=300)
    said = run.stderr.strip().splitlines()
    imported = said.pop().split()[1:] if said and said[-1].startswith("imported:") else None
    return run, said, imported


def test_refusals_and_checks_answer_before_torch_is_imported(tmp_path):
    """The README's cross-machine client flags on the shipped model, a folder that is no model, and the shipped
    models' first check (a home with no stored verdicts): each answers, in full, with none of torch, diffusers
    or transformers imported. The check's lines stay whole in a narrow terminal."""
    home = str(tmp_path / "home")
    run, said, imported = _diffuse(["query", *README_CLIENT, "--out", str(tmp_path / "boat.mp4")], home)
    assert run.returncode == 2 and imported == [], run.stderr
    assert len(said) == 1 and said[0].startswith("error: tiny-wan-shapes cannot make 480 px high, 832 px wide, "
                                                  "33 frames"), said
    assert "height up to 256" in said[0] and "width up to 256" in said[0] and "nothing was started" in said[0]
    assert not (tmp_path / "boat.mp4").exists()

    run, said, imported = _diffuse(["query", "--model", str(tmp_path), "--prompt", "x"], home)
    assert run.returncode == 2 and imported == [], run.stderr
    assert said == [f"error: {tmp_path} is neither a diffusers pipeline folder (no model_index.json) nor a "
                    "transformers model folder (no config.json naming its architectures)"], said

    for model, first_stack in (("tiny-wan-shapes", "  blocks: 4 x WanTransformerBlock"),
                                ("tiny-qwen-chat", "  model.layers: ")):
        run, said, imported = _diffuse(["check", model], home, columns=40)
        lines = run.stdout.splitlines()
        assert run.returncode == 0 and imported == [], run.stderr
        assert lines[0] == "splittable" and "), checked in" in lines[1] and "(cached)" in lines[1], lines
        assert any(line.startswith(first_stack) for line in lines), lines
    assert not os.path.exists(os.path.join(home, "cache"))  # answered from the folders' kept verdicts


def test_a_check_stored_under_the_home_answers_the_next_one_before_torch_is_imported(tmp_path, monkeypatch):
    """A model with no kept verdict of its own: its first check (here, in this process) stores the verdict under
    $DIFFUSE_HOME; the next one, in a fresh process, answers from it with nothing heavy imported."""
    from diffuse.cli.check import VERDICT_FILE, check
    from diffuse.plan.shipped import default_model_dir

    model = tmp_path / "model"
    shutil.copytree(default_model_dir(), model, ignore=shutil.ignore_patterns("*.safetensors", VERDICT_FILE))
    home = str(tmp_path / "home")
    monkeypatch.setenv("DIFFUSE_HOME", home)
    first = check(str(model), cache=True)
    assert "cached" not in first and first["verdict"] == "splittable"
    run, said, imported = _diffuse(["check", str(model)], home, columns=40)
    lines = run.stdout.splitlines()
    assert run.returncode == 0 and imported == [], run.stderr
    assert lines[0] == "splittable" and "(transformer: WanTransformer3DModel), checked in" in lines[1], lines
    assert "(cached)" in lines[1] and "blocks: 4 x WanTransformerBlock" in lines[3], lines


def test_the_first_status_line_comes_before_torch_is_imported(tmp_path):
    """``diffuse query`` says what it loads and from where before it imports anything heavy."""
    proc = subprocess.Popen([sys.executable, "-c", MARK_TORCH, "query", "--prompt", "a red circle moving right",
                             "--whole", "--out", str(tmp_path / "c.gif")],
                            env={k: v for k, v in subprocess_env(str(tmp_path)).items() if k != "DIFFUSE_DEVICE"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("importing torch"):
                break
    finally:
        proc.kill()
        proc.wait(30)
    assert lines[0].startswith("diffuse query: tiny-wan-shapes; reading its config"), lines
    assert lines[-1] == "importing torch", lines


@pytest.mark.parametrize("name", ["tiny-wan-shapes", "tiny-qwen-chat"])
def test_each_shipped_verdict_is_the_one_worked_out_afresh(name, tmp_path):
    """The kept verdict holds for the installed libraries (else ``python -m diffuse.cli.check keep NAME`` makes it
    anew), equals the check run now, and its size bounds are where the weightless call turns: the largest size
    it keeps goes through, the next one the pipeline's input check takes is refused by the denoiser's forward.
    Copied elsewhere the folder keeps its verdict; changed, it loses it."""
    from diffuse.cli.check import _check, kept
    from diffuse.plan.shipped import shipped_models

    path = shipped_models()[name]
    verdict = kept(path)
    assert verdict is not None, f"{path}: its diffuse_verdict.json was made for other files or libraries"
    fresh = _check(path, 0.0)
    assert verdict["check"] == {k: v for k, v in fresh.items() if k not in ("model", "seconds")}
    if name == "tiny-wan-shapes":
        _sizes_turn_where_kept(path, verdict["sizes"])
    else:
        assert "sizes" not in verdict
    copy = tmp_path / name
    shutil.copytree(path, copy)
    assert kept(str(copy)) == verdict
    config = copy / ("transformer/config.json" if name == "tiny-wan-shapes" else "config.json")
    config.write_text(config.read_text().replace('"', '"', 1) + " ")
    assert kept(str(copy)) is None


def _sizes_turn_where_kept(path: str, sizes: dict) -> None:
    import diffuse
    from diffuse.client.dryrun import _input_check_takes
    from diffuse.client.weightless import DryPipeline, _Refused

    pipe = diffuse.from_pretrained(path)
    info = pipe._diffuse
    assert sizes["made_for"] == {k: v for k, v in info.call_defaults().items() if k in sizes["made_for"]}
    base = dict(info.call_defaults(), prompt=sizes["prompt"], output_type="np")
    dry = DryPipeline(pipe, info.subject.denoiser)
    for name, largest in sizes["largest"].items():
        dry.run(dict(base, **{name: largest}))
        above = next(v for v in range(largest + 1, 4 * largest) if _input_check_takes(pipe, dict(base, **{name: v})))
        with pytest.raises(_Refused):
            dry.run(dict(base, **{name: above}))
