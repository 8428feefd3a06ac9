"""A long language-model session stays flat in memory on the client and the nodes, and its cache is capped
at the model's ``max_position_embeddings``.

The tiny Qwen2 of tests/lm_models.py, saved again with a chosen ``max_position_embeddings``, split over two
real node processes on loopback; one greedy ``generate`` runs pass after pass until the nodes refuse the
pass that would take the session's cache beyond the model's positions. Resident memory (``/proc/PID/status``)
of this client process and of both nodes is read after a warm-up and again many passes later; a node's
growth is counted less the key/value bytes it reports holding (its ``status``), which grow with the
positions by design. The CI form runs ``PASSES`` passes against a client's growth of 5 MiB per 2,000 passes
and the nodes' of 5 MiB; the ``soak`` form (``DIFFUSE_SOAK_PASSES=2000 python -m pytest -m soak tests/test_long_sessions.py``; left out of
the suite otherwise) against 5 MiB whole.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch

from conftest import THREADS, run_client
from test_lm import lm_models  # noqa: F401  (the session's tiny models, built once)

WARM = 60  # passes before the first reading: allocator pools and lazily built kernels settle
PASSES = 200  # passes between the readings in the CI form
SOAK = int(os.environ.get("DIFFUSE_SOAK_PASSES") or 0)  # the soak form runs only when this is set
FLAT = 5 << 20  # bytes of growth allowed per 2,000 passes


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def capped_model(lm_models, root, positions: int) -> str:
    """The tiny Qwen2 (the one test_lm builds) saved again with ``max_position_embeddings`` = ``positions``
    (its rotary embedding does not depend on it): a model made for that many positions."""
    out = root / f"qwen2-{positions}"
    if not out.exists():
        shutil.copytree(lm_models("qwen2"), out)
        with open(out / "config.json") as f:
            config = json.load(f)
        config["max_position_embeddings"] = positions
        with open(out / "config.json", "w") as f:
            json.dump(config, f)
    return str(out)


class Readings:
    """A streamer that reads this process's and the nodes' memory at two token counts."""

    def __init__(self, at: tuple[int, int], nodes, status):
        self.at, self.nodes, self.status = at, nodes, status
        self.count, self.read = 0, {}

    def put(self, value) -> None:
        self.count += 1
        if self.count in self.at:
            state = [s["state_bytes"] for s in self.status()]
            self.read[self.count] = (time.monotonic(), _rss(os.getpid()), [_rss(n.proc.pid) for n in self.nodes], state)

    def end(self) -> None:
        pass


def long_session(model_dir: str, passes: int, tmp_path) -> dict:
    """One generate through two local nodes until the cap refuses it; the readings and the refusal."""
    import diffuse
    from diffuse.errors import DiffuseError, NodeError
    from diffuse.plan.kvcache import max_positions
    from diffuse.local.nodes import start_local_nodes
    from diffuse.wire.transport import transport_for

    torch.set_num_threads(THREADS)
    model = diffuse.from_pretrained(model_dir)
    cap = max_positions(model.config)
    nodes = start_local_nodes(model_dir, 2, THREADS)
    try:
        def status():
            return [transport_for(n.address).request(n.address, {"op": "status"}, 10.0) for n in nodes]

        # one token a pass (no drafts): the readings come at pass counts
        with diffuse.split(model, nodes=[f"{n.address}#{n.key}" for n in nodes], timeout=60, speculate="off") as split:
            with pytest.raises(DiffuseError) as early:  # refused by the client before any pass
                model.generate(torch.ones(1, cap + 1, dtype=torch.long), max_new_tokens=2)
            passes_before = split.ring.channel_stats.passes
            readings = Readings((WARM, WARM + passes), nodes, status)
            ids = torch.tensor([[5, 6, 7, 8]])
            t0 = time.monotonic()
            with pytest.raises(NodeError) as late:  # refused by a node at the cap
                with torch.no_grad():
                    model.generate(ids, max_new_tokens=cap + 10, min_new_tokens=cap + 10, do_sample=False,
                                   streamer=readings)
            took = time.monotonic() - t0
            history = len(split.ring._history)
            messages = len(split.ring.channel_stats.messages)
    finally:
        nodes.stop()
    return {"cap": cap, "early": str(early.value), "passes_before": passes_before, "late": str(late.value),
            "read": readings.read, "tokens": readings.count, "took": took, "history": history,
            "messages": messages}


def check_flat(said: dict, passes: int, allowed: int) -> None:
    (t0, client0, nodes0, state0), (t1, client1, nodes1, state1) = (said["read"][WARM], said["read"][WARM + passes])
    grown = [(b - a) - (d - c) for a, b, c, d in zip(nodes0, nodes1, state0, state1)]  # less their caches' growth
    print(f"\n{passes} passes in {t1 - t0:.1f} s ({said['tokens']} tokens before the cap of {said['cap']}); client RSS "
          f"{(client1 - client0) / 1024:+.0f} KiB (allowed {allowed / 1024:.0f} KiB); nodes "
          f"{[f'{(b - a) / 1024:+.0f} KiB' for a, b in zip(nodes0, nodes1)]}, of which their key/value caches "
          f"{[f'{(d - c) / 1024:+.0f} KiB' for c, d in zip(state0, state1)]}")
    assert client1 - client0 < allowed, (client0, client1)
    # a node's records are bounded whatever the passes: 5 MiB each, less what its cache holds by design
    assert max(grown) < FLAT, (nodes0, nodes1, state0, state1)


def check_capped(said: dict) -> None:
    cap = said["cap"]
    assert f"max_position_embeddings ({cap})" in said["early"] and "prompt holds" in said["early"], said["early"]
    assert said["passes_before"] == 0  # nothing went to the nodes
    late = said["late"]
    assert f"would hold {cap + 1} positions, over the model's max_position_embeddings ({cap})" in late, late
    assert "\n" not in late
    assert said["history"] <= cap and said["messages"] <= cap + 1


def test_a_long_session_stays_flat_and_its_cache_stops_at_the_models_positions(lm_models, tmp_path_factory,
                                                                              tmp_path, diffuse_home):
    root = tmp_path_factory.mktemp("capped")
    said = long_session(capped_model(lm_models, root, WARM + PASSES + 20), PASSES, tmp_path)
    check_capped(said)
    check_flat(said, PASSES, FLAT * PASSES // 2000)
    # the command line refuses a prompt beyond the positions in one line, before any node starts
    run = run_client(["--model", capped_model(lm_models, root, 64), "--prompt", "the moon " * 80, "--no-template",
                      "--local-nodes", "2", "--threads", str(THREADS), "--quiet"], diffuse_home)
    assert run.returncode == 2, run.stderr[-2000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "max_position_embeddings (64)" in lines[0], run.stderr
    assert "local nodes" not in run.stderr + run.stdout


@pytest.mark.soak
@pytest.mark.skipif(not SOAK, reason="a soak: set DIFFUSE_SOAK_PASSES (e.g. 2000) to run it")
def test_a_two_thousand_pass_session_stays_flat(lm_models, tmp_path_factory, tmp_path, diffuse_home):
    said = long_session(capped_model(lm_models, tmp_path_factory.mktemp("soak"), WARM + SOAK + 20), SOAK, tmp_path)
    check_capped(said)
    check_flat(said, SOAK, FLAT)
