"""A lost node costs a retry, not the answer: replicas take over, and the run says so.

Real node processes on loopback. A node is killed (SIGKILL) or frozen (SIGSTOP) in the middle of a
run; the client notices, opens the session on a route through another holder of that node's range,
resends the pass in flight (for a language model, replays the answer so far to rebuild the caches)
and the result is byte-identical to an undisturbed run.
"""

from __future__ import annotations

import os
import signal
import time

import families
import numpy as np
import pytest
import torch

from test_hardening import _node, _nodes, _stop

WAN_ARGS = dict(families.call_args("wan"), num_inference_steps=5)
pytestmark = pytest.mark.usefixtures("quick_probes")  # a killed or frozen node is named in about 3 s, not 8


@pytest.fixture(scope="module")
def replicas(models, diffuse_home):
    """Two holders of each half of tiny Wan, listed first-half, first-half, second-half, second-half."""
    model = models("wan")
    nodes = _nodes(model, ["1/2", "1/2", "2/2", "2/2"])
    try:
        yield model, nodes
    finally:
        for proc, _ in nodes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
        _stop(*(p for p, _ in nodes))


def _run(pipe, addresses, lines, on_step=None, patches=1, calls=None, repair=None):
    import diffuse

    with diffuse.split(pipe, nodes=addresses, timeout=60, patches=patches, repair=repair) as split:
        split.ring.say = lines.append
        route = [s.address for s in split.plan.route]
        kwargs = dict(WAN_ARGS, generator=torch.Generator("cpu").manual_seed(0), output_type="np")
        if on_step is not None:
            kwargs["callback_on_step_end"] = lambda p, i, t, kw: (on_step(i, route), kw)[1]
        with torch.no_grad():
            out = pipe(**kwargs).frames[0]
        if calls is not None:
            calls.update(split.patch_calls or {})
        return out, route, list(split.plan.route), split.ring.repairs


def test_killed_then_frozen_replicas_leave_the_result_unchanged(replicas):
    import diffuse
    from diffuse.client.repair import AVOIDED

    model, nodes = replicas
    addresses = [f"{r['address']}#{r['key']}" for _, r in nodes]
    by_address = {r["address"]: p for p, r in nodes}
    pipe = diffuse.from_pretrained(model)
    undisturbed, first_route, _, repairs = _run(pipe, addresses, [])
    assert first_route == [nodes[0][1]["address"], nodes[2][1]["address"]]  # one holder per half
    assert repairs == []

    hit = []

    def strike(i, route):
        if i == 1:  # step 2 of 5 ends: the first half's holder dies
            hit.append(route[0])
            by_address[route[0]].send_signal(signal.SIGKILL)
        elif i == 2:  # step 3 ends: the second half's holder freezes
            hit.append(route[1])
            by_address[route[1]].send_signal(signal.SIGSTOP)

    lines: list[str] = []
    try:
        disturbed, _, final_route, repairs = _run(pipe, addresses, lines, strike)
    finally:
        AVOIDED.clear()  # other tests in this process may use these addresses' successors
    print("\n".join(repairs))
    assert np.array_equal(disturbed, undisturbed)  # byte for byte
    assert len(repairs) == 2 and lines == repairs, lines
    assert hit[0] in repairs[0] and "dead or frozen" in repairs[0]
    assert hit[1] in repairs[1]
    assert [s.address for s in final_route] == [nodes[1][1]["address"], nodes[3][1]["address"]]
    assert [str(s) for st in final_route for s in st.slices] == ["blocks[0:2]", "blocks[2:4]"]


def test_a_patched_step_cut_short_by_a_repair_runs_again_whole(models, diffuse_home):
    """With patches the new holder has none of the stale buffers of earlier steps: after the repair
    each branch's next step runs whole (as its first did), then patches resume."""
    import diffuse
    from diffuse.client.repair import AVOIDED

    model = models("wan")
    nodes = _nodes(model, ["1/2", "2/2", "2/2"])
    pipe = diffuse.from_pretrained(model)
    addresses = [f"{r['address']}#{r['key']}" for _, r in nodes]
    lines, calls, quiet = [], {}, {}
    try:
        exact, _, _, _ = _run(pipe, addresses[:2], [])
        steady, _, _, _ = _run(pipe, addresses[:2], [], patches=2, calls=quiet)
        kill = lambda i, route: i == 1 and nodes[1][0].send_signal(signal.SIGKILL)  # noqa: E731
        patched, _, route, repairs = _run(pipe, addresses, lines, kill, patches=2, calls=calls)
    finally:
        AVOIDED.clear()
        _stop(*(p for p, _ in nodes))
    assert len(repairs) == 1 and nodes[1][1]["address"] in repairs[0]
    assert [s.address for s in route] == [nodes[0][1]["address"], nodes[2][1]["address"]]
    branches = quiet["uncut"]  # undisturbed: one whole step per branch (guidance: two branches)
    assert branches == 2 and calls["uncut"] == 2 * branches, (quiet, calls)
    # the interrupted cut call is counted, then it and the other branch's next call ran whole
    assert calls["cut"] == quiet["cut"] - branches + 1, (quiet, calls)
    assert not np.array_equal(patched, steady)  # one step ran whole, so the bits differ...
    assert np.abs(patched - exact).max() < 0.5 * np.abs(exact).max()  # ...not the picture


def test_the_route_takes_one_usable_holder_per_range_and_a_failed_node_waits_its_turn():
    from diffuse.plan.contracts import Slice, SlicingPlan, ModelIdentity, StackPlan, Stage
    from diffuse.client.repair import RepairPolicy, choose_route

    stack = StackPlan(path="blocks", length=4, block_class="m.Block")
    plan = SlicingPlan(model=ModelIdentity("m", "transformer", "m.Model", "h"), stacks=(stack,))
    nodes = tuple(Stage(address=f"tcp://127.0.0.1:{7000 + i}", key="", slices=()) for i in range(4))
    front, back = [Slice("blocks", 0, 2)], [Slice("blocks", 2, 4)]
    held = [front, back, front, back]  # listed interleaved: the route still goes front, then back
    route = choose_route(plan, nodes, held, [True] * 4).route
    assert [s.address for s in route] == [nodes[0].address, nodes[1].address]
    route = choose_route(plan, nodes, held, [False, True, True, False]).route
    assert [s.address for s in route] == [nodes[2].address, nodes[1].address]
    # a holder that never answered (nothing known of what it holds) is simply not used
    route = choose_route(plan, nodes, [front, None, back, back], [True, False, True, True]).route
    assert [s.address for s in route] == [nodes[0].address, nodes[2].address]
    with pytest.raises(diffuse_error(), match=r"no usable node holds blocks\[2:4\]"):
        choose_route(plan, nodes, held, [True, False, True, False])
    # nodes that load what they are asked for: an even split over the usable ones
    route = choose_route(plan, nodes, [None] * 4, [True, False, True, True]).route
    assert [(s.address, str(s.slices[0])) for s in route] == [
        (nodes[0].address, "blocks[0:2]"), (nodes[2].address, "blocks[2:3]"), (nodes[3].address, "blocks[3:4]")]
    # avoided for a while after a failure, twice as long after the next, then tried again
    policy = RepairPolicy()
    try:
        assert policy.failed("tcp://x:1", now=100.0) == 30.0
        assert policy.avoided("tcp://x:1", now=129.0) and not policy.avoided("tcp://x:1", now=131.0)
        assert policy.failed("tcp://x:1", now=131.0) == 60.0
        assert policy.avoided("tcp://x:1", now=190.0) and not policy.avoided("tcp://x:1", now=192.0)
        assert [policy.failed("tcp://x:1", now=200.0) for _ in range(5)] == [120.0, 240.0, 480.0, 600.0, 600.0]
        policy.served("tcp://x:1")  # a session opened on it: its next failure starts over
        assert policy.failed("tcp://x:1", now=300.0) == 30.0
    finally:
        policy.avoidance.clear()


def test_ranges_go_in_block_order_whatever_order_their_holders_are_listed_or_answer_in():
    from diffuse.plan.contracts import Slice, SlicingPlan, ModelIdentity, StackPlan, Stage
    from diffuse.client.repair import choose_route

    stack = StackPlan(path="blocks", length=4, block_class="m.Block")
    plan = SlicingPlan(model=ModelIdentity("m", "transformer", "m.Model", "h"), stacks=(stack,))
    nodes = tuple(Stage(address=f"tcp://127.0.0.1:{7000 + i}", key="", slices=()) for i in range(3))
    front, back = [Slice("blocks", 0, 2)], [Slice("blocks", 2, 4)]
    # the first listed holder of the front never answered: the back's holder answered first
    route = choose_route(plan, nodes, [None, back, front], [False, True, True]).route
    assert [s.address for s in route] == [nodes[2].address, nodes[1].address]
    route = choose_route(plan, nodes[:2], [back, front], [True, True]).route  # listed back to front
    assert [s.address for s in route] == [nodes[1].address, nodes[0].address]
    # the only holder of the front never answered: said so, not routed through the back alone
    with pytest.raises(diffuse_error(), match=r"no usable node holds blocks\[0:2\]"):
        choose_route(plan, nodes, [None, back, back], [False, True, True])


def diffuse_error():
    from diffuse.errors import DiffuseError

    return DiffuseError


def test_a_language_model_answers_the_same_after_a_node_dies_mid_answer(tmp_path_factory, diffuse_home):
    """Three nodes that load what they are asked for; the middle one is killed after the fourth token.
    The route is split again over the two left, the answer so far replayed to rebuild their caches
    (the layers the dead node held now live elsewhere), and every token equals the undisturbed run's."""
    import lm_models

    import diffuse
    from conftest import THREADS
    from diffuse.lm.client_media import build_inputs
    from diffuse.client.repair import AVOIDED

    model_dir = lm_models.build("qwen2", str(tmp_path_factory.mktemp("repair-lm") / "qwen2"))
    inputs, _ = build_inputs(model_dir, "Tell me a story about the moon.")
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    nodes = [_node(model_dir, None) for _ in range(3)]  # no --blocks: each loads what it is asked for

    class KillAt:  # generate hands each new token to its streamer: the node dies after the fourth
        def __init__(self, at):
            self.at, self.seen = at, 0

        def put(self, value):
            self.seen += 1
            if self.seen == self.at + 1:  # the first put is the prompt
                nodes[1][0].send_signal(signal.SIGKILL)

        def end(self):
            pass

    answers, lines = [], []
    try:
        model = diffuse.from_pretrained(model_dir)
        for streamer in (None, KillAt(4)):
            with diffuse.split(model, nodes=[f"{r['address']}#{r['key']}" for _, r in nodes], timeout=60) as split:
                split.ring.say = lines.append
                out = model.generate(**inputs, max_new_tokens=10, do_sample=False, streamer=streamer)
                answers.append(out[:, inputs["input_ids"].shape[1]:].tolist())
                route = [s.address for s in split.plan.route]
    finally:
        AVOIDED.clear()
        torch.set_num_threads(threads)
        _stop(*(p for p, _ in nodes))
    assert answers[0] == answers[1] and len(answers[0][0]) == 10
    assert len(lines) == 1 and nodes[1][1]["address"] in lines[0], lines
    assert "replayed 4 earlier passes" in lines[0] or "replayed 5 earlier passes" in lines[0], lines
    assert route == [nodes[0][1]["address"], nodes[2][1]["address"]]


def test_a_dead_first_listed_replica_is_routed_around_and_a_failed_node_serves_again_after_its_wait(
        models, diffuse_home, tmp_path, monkeypatch):
    """Listed a1 (1/2), b (2/2), a2 (1/2). With a1 not running, the route is a2, b. Then a1 is up: killed
    mid-run (a2 takes over), restarted, and once its wait is over a2 is killed: a1 serves again. Each
    result is byte-identical to an undisturbed run. With b frozen and no replica of it, the error names b."""
    import socket

    import diffuse.client.handshake
    from diffuse.errors import NodeError
    from diffuse.client.repair import AVOIDED, RepairPolicy
    from diffuse.wire.sealing import load_identity

    monkeypatch.setattr(diffuse.client.handshake, "HELLO_TIMEOUT_S", 3.0)  # a dead node's hello is not waited for long
    model = models("wan")
    key = str(tmp_path / "a1.key")
    with socket.socket() as free:  # a1's address and key, before a1 runs
        free.bind(("127.0.0.1", 0))
        listen = f"tcp://127.0.0.1:{free.getsockname()[1]}"
    (b, b_ready), (a2, a2_ready) = _nodes(model, ["2/2", "1/2"])
    addresses = [f"{listen}#{load_identity(key).public_hex}"] + [f"{r['address']}#{r['key']}" for r in (b_ready, a2_ready)]
    procs = {a2_ready["address"]: a2}
    pipe = diffuse.from_pretrained(model)
    policy = RepairPolicy(avoid_first_s=1.0)
    failed_at = []

    def start_a1():
        procs[listen] = _node(model, "1/2", extra=["--key-file", key, "--listen", listen])[0]

    try:
        undisturbed, route, _, _ = _run(pipe, [addresses[2], addresses[1]], [])
        assert route == [a2_ready["address"], b_ready["address"]]

        around, route, _, repairs = _run(pipe, addresses, [], repair=policy)  # a1, listed first, is not up
        assert route == [a2_ready["address"], b_ready["address"]] and repairs == []
        assert np.array_equal(around, undisturbed)  # byte for byte

        def strike(i, route):
            if i == 1:  # a1 dies: a2 takes over, a1 is avoided for a second
                failed_at.append(time.monotonic())
                procs[listen].send_signal(signal.SIGKILL)
            elif i == 2:  # a1 is back; once its second is over, a2 dies
                procs[listen].wait(10)
                start_a1()
                time.sleep(max(0.0, failed_at[0] + 1.5 - time.monotonic()))
                procs[a2_ready["address"]].send_signal(signal.SIGKILL)

        start_a1()
        lines: list[str] = []
        again, route, final, repairs = _run(pipe, addresses, lines, strike, repair=policy)
        print("\n".join(repairs))
        assert route == [listen, b_ready["address"]]
        assert np.array_equal(again, undisturbed)
        assert len(repairs) == 2 and lines == repairs
        assert repairs[0].startswith(f"repaired the route after node {listen}") and a2_ready["address"] in repairs[0]
        assert repairs[1].startswith(f"repaired the route after node {a2_ready['address']}")
        assert [s.address for s in final] == [listen, b_ready["address"]]

        b.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(NodeError) as caught:
            _run(pipe, addresses[:2], [])
        said = str(caught.value)
        assert said.startswith(f"node {b_ready['address']}: no answer to 'hello'"), said
        assert "no usable node holds blocks[2:4]" in said and "dead, frozen or unreachable" in said, said
        assert "do not chain" not in said and time.monotonic() - t0 < 30
    finally:
        AVOIDED.clear()
        b.send_signal(signal.SIGCONT)
        _stop(b, *procs.values())
