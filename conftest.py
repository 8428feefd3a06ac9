"""Fixtures shared by all tests: tiny pipelines saved to disk, reference and split runs.

Every model is built offline from a config with seeded random weights. The
reference is computed by tests/reference.py, which imports diffusers alone;
split runs go through real node processes on loopback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(ROOT, "tests")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# every client and node a test starts without --device computes on the CPU, as its reference does, on a machine with
# a GPU too (--device auto would take it); tests/test_gpu.py names its devices
os.environ.setdefault("DIFFUSE_DEVICE", "cpu")
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
# processes started from this one (nodes of a client run in-process, too) import the tests' model libraries
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)

THREADS = 1  # reference, client and nodes all run at one torch thread: equal thread counts, equal bits


def subprocess_env(tmp_home: str | None = None) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, env.get("PYTHONPATH")) if p)
    if tmp_home:
        env["DIFFUSE_HOME"] = tmp_home
    return env


def node_process(args: list[str], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env: dict | None = None):
    """``python -m diffuse.node ARGS`` for tests that need nodes, not the command line itself: forked from the
    pre-imported launcher, a process of its own all the same (a plain subprocess with DIFFUSE_LAUNCHER=0)."""
    from diffuse.local import launcher

    return launcher.POOL.spawn(["-m", "diffuse.node", *args], stdout=stdout, stderr=stderr,
                          env=env if env is not None else subprocess_env())


class Models:
    """Builds each tiny model once per test session."""

    def __init__(self, root):
        self.root = root
        self.dirs: dict[str, str] = {}

    def __call__(self, name: str) -> str:
        if name not in self.dirs:
            import families

            self.dirs[name] = families.build(name, str(self.root / name))
        return self.dirs[name]


@pytest.fixture(scope="session", autouse=True)
def scratch(tmp_path_factory) -> str:
    """Node logs, ipc sockets and other temporary files of this session (in-process and in every
    subprocess) go under pytest's own temporary folder, not loose in /tmp."""
    import tempfile

    path = str(tmp_path_factory.mktemp("scratch"))
    os.environ["TMPDIR"] = path
    tempfile.tempdir = path
    return path


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> Models:
    return Models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def diffuse_home(tmp_path_factory) -> str:
    home = str(tmp_path_factory.mktemp("diffuse-home"))
    os.environ["DIFFUSE_HOME"] = home  # known-nodes file and the like stay out of the user's home
    return home


@pytest.fixture
def quick_probes(monkeypatch) -> None:
    """The client's liveness probes (in this process) sooner and shorter than the product's defaults (a ping
    every 1.5 s while a pass is awaited, 2.5 s for each answer): a killed or frozen node is still named after
    two missed pings in a row, in about 3.5 s instead of 8. A node answers pings while its blocks compute,
    so 1.25 s is ample on a loaded machine."""
    import diffuse.client.channel
    import diffuse.client.handshake

    monkeypatch.setattr(diffuse.client.channel, "PROBE_EVERY_S", 0.5)
    monkeypatch.setattr(diffuse.client.handshake, "PROBE_TIMEOUT_S", 1.25)


_REFERENCES: dict[tuple, np.ndarray] = {}


def reference_loads(model: str, kwargs: dict, out: str, seed: int = 0, threads: int = THREADS) -> list[np.ndarray]:
    """The pipeline run whole by plain diffusers in a fresh process, loaded afresh twice (the second
    load shows the reference repeats itself); computed once per model and arguments for the whole
    session, so test_exact and test_families share it. ``threads`` 0: torch's own default."""
    return Reference(model, kwargs, out, seed, threads).loads()


class Reference:
    """``reference_loads`` started now and read later: its process runs while the test runs the split side."""

    def __init__(self, model: str, kwargs: dict, out: str, seed: int = 0, threads: int = THREADS):
        self.key = (model, json.dumps(kwargs, sort_keys=True), seed, threads)
        self.outs = [out, f"{os.path.splitext(out)[0]}.load2.npy"]
        self.proc = None
        if self.key not in _REFERENCES:
            cmd = [sys.executable, os.path.join(TESTS, "reference.py"), "--model", model, "--kwargs",
                   json.dumps(kwargs), "--seed", str(seed), "--threads", str(threads), "--out", self.outs[0],
                   "--out", self.outs[1]]
            self.proc = subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                         text=True)

    def loads(self) -> list[np.ndarray]:
        if self.key not in _REFERENCES:
            _, err = self.proc.communicate(timeout=600)
            assert self.proc.returncode == 0, err[-3000:]
            _REFERENCES[self.key] = [np.load(o) for o in self.outs]
        return [a.copy() for a in _REFERENCES[self.key]]

    def result(self) -> np.ndarray:
        """The reference array (the first load)."""
        return self.loads()[0]


@pytest.fixture(scope="session")
def standard_references(request, models, tmp_path_factory) -> None:
    """The whole-model reference of every family the selected tests compare with (test_exact's and
    test_families' cases, at each family's own call arguments, seed 0), computed up front by
    tests/reference.py --jobs in two processes side by side (one start-up each, not one per model) and
    kept where ``reference_loads`` finds them. A job that fails is left for ``reference_loads`` to run
    alone, so its error is reported where it is needed."""
    import families

    names = []
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        name = params.get("family") or params.get("model")
        if isinstance(name, str) and os.path.basename(str(item.fspath)) in ("test_exact.py", "test_families.py") \
                and name not in names and (name in families.FAMILIES or name == "odd"):
            names.append(name)
    root = tmp_path_factory.mktemp("standard-references")
    jobs = []
    for name in names:
        model, kwargs = models(name), families.call_args(name)  # built one after another (seeded builders)
        key = (model, json.dumps(kwargs, sort_keys=True), 0, THREADS)
        if key not in _REFERENCES:
            out = str(root / f"{name}.npy")
            jobs.append((key, {"model": model, "kwargs": kwargs, "seed": 0,
                               "out": [out, f"{os.path.splitext(out)[0]}.load2.npy"]}))
    halves = [jobs[0::2], jobs[1::2]]
    procs = []
    for k, half in enumerate(h for h in halves if h):
        with open(root / f"jobs{k}.json", "w") as f:
            json.dump([job for _, job in half], f)
        procs.append(subprocess.Popen([sys.executable, os.path.join(TESTS, "reference.py"), "--jobs",
                                       str(root / f"jobs{k}.json"), "--threads", str(THREADS)],
                                      env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True))
    for p in procs:
        p.communicate(timeout=1200)
    for key, job in jobs:
        if all(os.path.isfile(o) for o in job["out"]):
            _REFERENCES[key] = [np.load(o) for o in job["out"]]


def run_reference(model: str, kwargs: dict, out: str, seed: int = 0, threads: int = THREADS) -> np.ndarray:
    """The reference array (the first of ``reference_loads``)."""
    return reference_loads(model, kwargs, out, seed, threads)[0]


def split_command(model: str, kwargs: dict, save: str, nodes: int = 2, seed: int = 0, extra: list[str] = ()) -> list[str]:
    cmd = [sys.executable, "-m", "diffuse.run", "--model", model, "--seed", str(seed), "--threads", str(THREADS),
           "--local-nodes", str(nodes), "--save-array", save, "--quiet", "--timeout", "120"]
    for k, v in kwargs.items():
        cmd += ["--arg", f"{k}={json.dumps(v)}"]
    return cmd + list(extra)


class ClientRun:
    """What a client run said and how it ended (as ``subprocess.run`` would give them)."""

    def __init__(self, returncode: int, stderr: str, stdout: str = ""):
        self.returncode, self.stderr, self.stdout = returncode, stderr, stdout


def run_cli(argv: list[str], home: str | None = None) -> ClientRun:
    """``diffuse ARGV`` (``diffuse.cli.command.main``, the command's own code) in this process: its exit status and
    what it printed. ``home``: the DIFFUSE_HOME it sees."""
    from diffuse.cli.command import main

    return _in_process(main, argv, home)


def run_client(argv: list[str], home: str | None = None) -> ClientRun:
    """``python -m diffuse.run ARGV`` with its client in this process (``run.main``, the command's own code;
    a fresh interpreter per run would only add its start-up): its exit status and what it printed to stderr.
    ``home``: the DIFFUSE_HOME the run sees."""
    from diffuse.cli.query import main
    from diffuse.flags import quiet_libraries

    quiet_libraries()  # as run_main does first: what libraries say as they load is not the command's output
    return _in_process(main, argv, home)


def run_node(argv: list[str], home: str | None = None) -> ClientRun:
    """``python -m diffuse.node ARGV`` (``diffuse.node.command.main``) in this process, for what it refuses before
    it serves: its exit status and what it printed."""
    from diffuse.node.command import main

    return _in_process(main, argv, home)


def _in_process(main, argv: list[str], home: str | None) -> ClientRun:
    import contextlib
    import io

    before = os.environ.get("DIFFUSE_HOME")
    if home:
        os.environ["DIFFUSE_HOME"] = home
    said, printed = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(printed):
            try:
                code = main(list(argv))
            except SystemExit as exc:  # argparse's refusals, as the command would exit with them
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        if before is None:
            os.environ.pop("DIFFUSE_HOME", None)
        else:
            os.environ["DIFFUSE_HOME"] = before
    return ClientRun(code, said.getvalue(), printed.getvalue())


def reference_jobs(script: str, jobs: list[dict], root, timeout: float = 600) -> list[dict]:
    """``tests/SCRIPT --jobs``: every job run whole by the plain library in one fresh interpreter, at the tests'
    thread count (``root``: a folder for the jobs and results files); the results, in the jobs' order."""
    jobs_file, out = os.path.join(root, "jobs.json"), os.path.join(root, "results.json")
    with open(jobs_file, "w") as f:
        json.dump(jobs, f)
    cmd = [sys.executable, os.path.join(TESTS, script), "--jobs", jobs_file, "--threads", str(THREADS), "--out", out]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as f:
        return json.load(f)


def encdec_answer(model: str, clip: str, out: str, *args: str) -> dict:
    """What plain transformers' ``generate`` answers for ``model`` on ``clip`` (tests/encdec_reference.py in a fresh
    process, at the suite's thread count; ``args``: its further flags), read back from ``out``."""
    cmd = [sys.executable, os.path.join(TESTS, "encdec_reference.py"), "--model", model, "--audio", clip, *args,
           "--threads", str(THREADS), "--out", out]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as f:
        return json.load(f)


def run_split(model: str, kwargs: dict, tmp_path, nodes: int = 2, seed: int = 0, extra: list[str] = (),
              home: str | None = None) -> tuple[np.ndarray, dict]:
    """``python -m diffuse.run`` with local node processes, its client run in this process (``run.main``, the
    same code the command runs: what it saves and reports is compared; a fresh interpreter per run would
    only add its start-up). ``home``: the DIFFUSE_HOME the run sees."""
    save, report, out = tmp_path / "split.npy", tmp_path / "report.json", tmp_path / "out"
    argv = split_command(model, kwargs, str(save), nodes, seed,
                         ["--report", str(report), "--out", str(out) + _suffix(model), *extra])[3:]
    run = run_client(argv, home)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(report) as f:
        return np.load(save), json.load(f)


def _suffix(model: str) -> str:
    from diffuse.plan.planner import analyze
    from diffuse.client.writers import DEFAULT_SUFFIX

    return DEFAULT_SUFFIX[analyze(model)[1].get("output_kind", "image")]


def hello_report(address: str):
    """What a node's hello says of it now, read as the client reads it (``NodeReport``)."""
    from diffuse.client.heard import Heard

    return Heard().ask(address)
