"""Many clients, one pair of nodes: three runs at once while a fourth peer floods hello and status, then
a hundred sessions opened and closed. Real node processes on loopback, bounded in time."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import families
import numpy as np
import pytest
import torch

from conftest import THREADS, subprocess_env
from test_hardening import _nodes, _stop

SEEDS = (0, 1, 2)


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def pair(models, diffuse_home):
    model = models("wan")
    nodes = _nodes(model, ["1/2", "2/2"])
    try:
        yield model, nodes
    finally:
        _stop(*(p for p, _ in nodes))


def _pipe(model: str):
    import diffuse

    pipe = diffuse.from_pretrained(model)  # loading builds on meta tensors process-wide: never in parallel
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _generate(pipe, addresses: list[str], seed: int) -> np.ndarray:
    import diffuse

    torch.set_num_threads(THREADS)  # a new thread starts from the library's default count
    with diffuse.split(pipe, nodes=addresses, timeout=120):
        with torch.no_grad():
            return pipe(**families.call_args("wan"), generator=torch.Generator("cpu").manual_seed(seed),
                        output_type="np").frames[0]


FLOOD = """
import select, sys, cbor2, zmq
ctx, ok, lost, said = zmq.Context(), 0, 0, False
while not select.select([sys.stdin], [], [], 0)[0]:  # until the test closes our stdin
    for address in sys.argv[1:]:
        for op in ({"op": "hello", "wire": [1, 2]}, {"op": "status"}):
            s = ctx.socket(zmq.REQ)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(address)
            s.send(cbor2.dumps(op))
            if s.poll(2000):
                s.recv()
                ok += 1
            else:
                lost += 1
            s.close()
    if not said:
        print("flooding", flush=True)
        said = True
print(ok, lost)
"""


def _flood(addresses: list[str]) -> subprocess.Popen:
    """A peer with no key of its own asking hello and status as fast as the nodes answer."""
    return subprocess.Popen([sys.executable, "-c", FLOOD, *addresses], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=subprocess_env())


def test_three_clients_at_once_under_a_flood_each_get_their_solo_answer(pair):
    model, nodes = pair
    pinned = [f"{r['address']}#{r['key']}" for _, r in nodes]
    controls = [r["address"] for _, r in nodes]
    pipes = {seed: _pipe(model) for seed in SEEDS}
    solo = {seed: _generate(pipes[seed], pinned, seed) for seed in SEEDS}

    together: dict[int, np.ndarray] = {}
    failures: list[BaseException] = []

    def client(seed):
        try:
            together[seed] = _generate(pipes[seed], pinned, seed)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    flooder = _flood(controls)
    assert flooder.stdout.readline().strip() == "flooding"  # under way before any client starts
    clients = [threading.Thread(target=client, args=(seed,)) for seed in SEEDS]
    try:
        for c in clients:
            c.start()
        for c in clients:
            c.join(300)
    finally:
        answered, lost = map(int, flooder.communicate(timeout=30)[0].split())
    print(f"\nflood: {answered} hello/status answered, {lost} unanswered within 2 s")
    assert not failures, failures
    assert answered >= 20, (answered, lost)  # the flood really ran while the clients did
    for seed in SEEDS:
        assert np.array_equal(together[seed], solo[seed]), seed


def test_a_hundred_sessions_leave_node_memory_bounded(pair):
    """Each session opens on both nodes, makes one pass (so it holds slot caches), and closes."""
    import diffuse

    model, nodes = pair
    pinned = [f"{r['address']}#{r['key']}" for _, r in nodes]
    pipe = _pipe(model)
    args = dict(families.call_args("wan"), num_inference_steps=1)

    def session():
        with diffuse.split(pipe, nodes=pinned, timeout=60):
            with torch.no_grad():
                pipe(**args, generator=torch.Generator("cpu").manual_seed(0), output_type="np")

    for _ in range(5):  # allocator pools and lazily built kernels settle first
        session()
    before = [_rss_kib(p.pid) for p, _ in nodes]
    t0 = time.monotonic()
    for _ in range(100):
        session()
    after = [_rss_kib(p.pid) for p, _ in nodes]
    print(f"\n100 sessions in {time.monotonic() - t0:.1f} s; node RSS before {before} KiB, after {after} KiB")
    for b, a in zip(before, after):
        assert a < b * 1.10, (before, after)
