"""What a user meets after the first run: sizes the model cannot take refused before work starts, errors
whose last line is the root cause, a command that is never long silent and ends with its last line, the
README's one-machine recipe run as written, and the command line's rough edges.

Real client and node processes on loopback, the shipped model.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

from conftest import run_cli, run_client, subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_CLIENT = ["--prompt", "a paper boat", "--steps", "30", "--height", "480", "--width", "832", "--frames", "33"]


def _command_env(home: str) -> dict:
    """The environment a user's shell gives ``diffuse``: the interpreter's scripts first on PATH."""
    env = subprocess_env(home)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    return env


class Timed:
    """A command's output lines (stdout and stderr together), each with the seconds since start."""

    def __init__(self, cmd: list[str], env: dict, cwd):
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     cwd=cwd, start_new_session=True)
        self.lines: list[tuple[float, str, bool]] = []  # (seconds, line, whether the process was still running)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic() - self.t0, line.rstrip("\n"), self.proc.poll() is None))

    def finish(self, timeout: float) -> float:
        """Waits; returns the seconds from the last line to the process's end."""
        self.proc.wait(timeout)
        ended = time.monotonic() - self.t0
        self.reader.join(10)
        return ended - self.lines[-1][0]

    @property
    def said(self) -> str:
        return "\n".join(line for _, line, _ in self.lines)


def test_a_size_the_model_cannot_take_is_refused_in_one_line_before_anything_starts(tmp_path, diffuse_home,
                                                                                   monkeypatch):
    """The README's cross-machine client flags on the shipped model (it takes up to 256 px a side), the model's
    kept verdict set aside: the denoiser's own forward, run weightless, refuses them; the last line says so and
    names what it takes, the bounds the kept verdict refuses by (that refusal, with no torch imported:
    tests/test_quick_answers.py)."""
    import diffuse.cli.check
    from diffuse.plan.shipped import default_model_dir
    from diffuse.cli.check import kept_refusal

    with open(os.path.join(default_model_dir(), diffuse.cli.check.VERDICT_FILE)) as f:
        kept = json.load(f)  # as shipped, whatever libraries are installed
    monkeypatch.setattr(diffuse.cli.check, "kept", lambda path: None)
    out = tmp_path / "boat.mp4"
    run = run_client([*README_CLIENT, "--out", str(out), "--quiet"], diffuse_home)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2, run.stderr
    assert lines[-1].startswith("error: tiny-wan-shapes cannot make 480 px high, 832 px wide, 33 frames"), run.stderr
    assert "the denoiser's own forward refuses these shapes" in lines[-1], lines[-1]
    assert "height up to 256" in lines[-1] and "width up to 256" in lines[-1], lines[-1]
    assert sum("error" in line for line in lines) == 1 and "Traceback" not in run.stderr
    assert "starting" not in run.stderr and not out.exists()
    from_kept = kept_refusal(kept["sizes"], {"height": 480, "width": 832, "num_frames": 33}, "tiny-wan-shapes")
    assert from_kept.split("; it takes ")[1] == lines[-1].split("; it takes ")[1], (from_kept, lines[-1])


def test_outside_what_the_shipped_model_knows_is_one_note_each(diffuse_home):
    import diffuse
    from diffuse.client.api import ModelInfo
    from diffuse.client.dryrun import notes

    info = ModelInfo.of("tiny-wan-shapes")
    pipe = diffuse.from_pretrained(info.path)
    said = notes(pipe, {"prompt": "a paper boat", "height": 64, "width": 64, "num_frames": 9}, info)
    assert len(said) == 2 and "made for 32 px high, 32 px wide, 9 frames" in said[0], said
    assert "'paper', 'boat'" in said[1], said
    assert notes(pipe, {"prompt": "a red circle moving right", "height": 32, "width": 32, "num_frames": 9}, info) == []
    assert "empty" in notes(pipe, {"prompt": " ", "height": 32, "width": 32, "num_frames": 9}, info)[0]


def test_a_taken_port_is_refused_in_one_line_before_the_node_loads(tmp_path, diffuse_home):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "diffuse.node", "--model", "tiny-wan-shapes", "--listen",
                              f"tcp://127.0.0.1:{port}", "--blocks", "1/2"], env=subprocess_env(diffuse_home),
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [f"error: --listen tcp://127.0.0.1:{port}: port {port} is already in "
                                               "use (another node, or another program): give another port, or stop "
                                               "what holds it"], run.stderr
    assert run.stdout == ""


def test_piped_output_shows_progress_lines_as_the_run_goes_and_the_command_ends_with_its_last_line(tmp_path,
                                                                                                   diffuse_home):
    run = Timed([sys.executable, "-m", "diffuse.cli", "query", "--prompt", "a red circle moving right", "--steps",
                 "40", "--local-nodes", "1", "--out", str(tmp_path / "c.gif")], subprocess_env(diffuse_home), tmp_path)
    lag = run.finish(timeout=300)
    assert run.proc.returncode == 0, run.said
    first_s, first, _ = run.lines[0]
    assert first.startswith("diffuse query: tiny-wan-shapes") and first_s < 5, (first_s, run.said)  # < 1 s idle
    steps = [(s, line, alive) for s, line, alive in run.lines if line.startswith("denoising: step")]
    assert len(steps) >= 10 and steps[-1][1].startswith("denoising: step 40/40"), run.said
    assert steps[0][2] and re.search(r"about \d+ s left", steps[0][1]), steps  # shown while the run went on
    assert "━" not in run.said  # no bar drawn into a pipe
    assert lag < 3, f"{lag:.1f} s from the last line to the end"  # within 1 s on an idle machine
    from PIL import Image

    with Image.open(tmp_path / "c.gif") as gif:
        assert gif.n_frames == 9 and gif.size == (32, 32)


def test_the_readme_one_machine_recipe_runs_as_written(tmp_path, diffuse_home):
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    block = re.search(r"<!-- one-machine recipe -->\n```\n(.*?)```", readme, re.S).group(1)
    run = subprocess.run(["bash", "-e", "-c", block], env=_command_env(str(tmp_path / "client")), cwd=tmp_path,
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "wrote circle.gif" in " ".join(run.stderr.split()), run.stderr[-3000:]
    from PIL import Image

    with Image.open(tmp_path / "circle.gif") as gif:
        assert gif.n_frames == 9 and gif.size == (32, 32)
    keys = [json.loads(next(line for line in open(tmp_path / f"node-{n}.log") if line.startswith("{")))["key"]
            for n in "ab"]
    for n, key in zip("ab", keys):  # each node had its own home, and so its own identity
        assert open(tmp_path / f"node-{n}" / "node.key", "rb").read()[:32].hex() == key
    assert keys[0] != keys[1]


def test_version_aliases_and_did_you_mean(tmp_path, diffuse_home):
    version = run_cli(["--version"], diffuse_home)
    assert version.returncode == 0 and re.fullmatch(r"diffuse \d+\.\d+\.\d+\S*\n", version.stdout)
    listed = run_cli(["--help"], diffuse_home).stdout
    assert all(f"  {name}" in listed for name in ("query", "chat", "node", "check", "verify", "bench", "key"))
    assert "generate" in listed and "run" in listed
    typo = run_cli(["generate", "--promt", "x"], diffuse_home)
    assert typo.returncode == 2 and "did you mean --prompt?" in typo.stderr, typo.stderr
    assert len(typo.stderr.strip().splitlines()) == 1
    command = run_cli(["qurey"], diffuse_home)
    assert command.returncode == 2 and "did you mean 'query'?" in command.stderr
    model = run_cli(["check", "tiny-wan-shape"], diffuse_home)
    assert model.returncode == 2 and "did you mean 'tiny-wan-shapes'?" in " ".join(model.stdout.split())
    assert "or a Hub id, ORG/NAME[@REVISION], fetched as it runs" in " ".join(model.stdout.split())


def test_every_flag_is_described_and_help_shows_no_markup(diffuse_home):
    from diffuse.cli import command
    from diffuse.cli import parsing

    for name in ("query", "chat", "node", "verify", "check", "plan", "key", "bench"):
        run = run_cli([name, "--help"], diffuse_home)
        assert run.returncode == 0, (name, run.stderr)
        assert "``" not in run.stdout, name
    bench_lm = run_cli(["bench", "lm", "--help"], diffuse_home)
    assert bench_lm.returncode == 0 and "`" not in bench_lm.stdout
    for parser in (parsing.query_parser(), parsing.chat_parser()):
        undescribed = [a.option_strings for a in parser._actions if a.option_strings and not a.help]
        assert undescribed == [], undescribed
