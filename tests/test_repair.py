"""A lost node costs a retry, not the answer: replicas take over, and the run says so.

Real node processes on loopback. A node is killed (SIGKILL) or frozen (SIGSTOP) in the middle of a
run; the client notices, opens the session on a route through another holder of that node's range,
resends the pass in flight (for a language model, replays the answer so far to rebuild the caches)
and the result is byte-identical to an undisturbed run.
"""

from __future__ import annotations

import os
import signal

import families
import numpy as np
import pytest
import torch

from test_hardening import _node, _nodes, _stop

WAN_ARGS = dict(families.call_args("wan"), num_inference_steps=5)


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


def _run(pipe, addresses, lines, on_step=None, patches=1, calls=None):
    import diffuse

    with diffuse.split(pipe, nodes=addresses, timeout=60, patches=patches) as split:
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
    from diffuse.repair import _failures

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
        _failures.clear()  # other tests in this process may use these addresses' successors
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
    from diffuse.repair import _failures

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
        _failures.clear()
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
    from diffuse.plan import Slice, SlicingPlan, ModelIdentity, StackPlan, Stage
    from diffuse.repair import _failures, avoided, choose_route, note_failure

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
    try:
        assert note_failure("tcp://x:1", now=100.0) == 30.0
        assert avoided("tcp://x:1", now=129.0) and not avoided("tcp://x:1", now=131.0)
        assert note_failure("tcp://x:1", now=131.0) == 60.0
        assert avoided("tcp://x:1", now=190.0) and not avoided("tcp://x:1", now=192.0)
    finally:
        _failures.clear()


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
    from diffuse.media_inputs import build_inputs
    from diffuse.repair import _failures

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
        _failures.clear()
        torch.set_num_threads(threads)
        _stop(*(p for p, _ in nodes))
    assert answers[0] == answers[1] and len(answers[0][0]) == 10
    assert len(lines) == 1 and nodes[1][1]["address"] in lines[0], lines
    assert "replayed 4 earlier passes" in lines[0] or "replayed 5 earlier passes" in lines[0], lines
    assert route == [nodes[0][1]["address"], nodes[2][1]["address"]]
