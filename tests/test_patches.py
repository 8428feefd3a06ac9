"""PipeFusion (--patches P > 1): what is cut, what is borrowed, what is exact, what travels.

The client runs in this process (one torch thread, like the nodes and the
reference); nodes are real processes on loopback, sealed, started once per
model without a fixed share, so the same nodes serve rings of one, two or three.
"""

from __future__ import annotations

import json
import math

import families
import numpy as np
import pytest
import torch

from conftest import THREADS, Reference, node_process, run_client, split_command
from diffuse.plan.calltree import unflatten
from diffuse.pipefusion.client import BranchTracker, Patcher, patch_ranges, token_axis
from diffuse.pipefusion.node import PATHS, PatchRun, StaleStack
from diffuse.pipefusion.node_attention import AttentionBuffer, QuickUnsupported, attention_scope
from diffuse.pipefusion.policy import why_uncut
from diffuse.plan.contracts import PATCHABLE, UNCUT_STEPS, ReturnMap
from diffuse.plan.messages import Patch

STEPS = 3  # step 1 runs whole, steps 2 and 3 are cut into patches


class Nodes:
    """Node processes per model, started on first use, stopped at the end of the module."""

    def __init__(self):
        self.procs: dict[str, list] = {}

    def __call__(self, model: str, n: int) -> list[tuple[str, str]]:
        procs = self.procs.setdefault(model, [])
        while len(procs) < n:
            procs.append(node_process(["--model", model, "--ephemeral-key", "--threads", str(THREADS),
                                       "--log-level", "WARNING"]))
        out = []
        for p in procs[:n]:
            if not hasattr(p, "ready"):
                p.ready = json.loads(p.stdout.readline())
            out.append((p.ready["address"], p.ready["key"]))
        return out

    def stop(self):
        for procs in self.procs.values():
            for p in procs:
                p.terminate()
        for procs in self.procs.values():
            for p in procs:
                p.wait(10)


@pytest.fixture(scope="module")
def nodes():
    n = Nodes()
    yield n
    n.stop()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)


def split_run(model: str, kwargs: dict, addresses, patches: int, attention: str = "auto",
              ahead: bool = True, groups: bool = False) -> tuple[np.ndarray, dict]:
    """The pipeline's own __call__ here, its stack on the given nodes; returns the array and what was seen."""
    import diffusers

    import diffuse
    from diffuse.client.output import output_array

    pipe = diffusers.DiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    listed = [f"{a}#{k}" for a, k in addresses]
    with diffuse.split(pipe, nodes=[[n] for n in listed] if groups else listed, patches=patches, attention=attention,
                       timeout=60, ahead=ahead) as split, torch.no_grad():
        result = pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(0), output_type="np")
    st = split.ring.channel_stats
    seen = {"messages": st.messages, "returns": st.returns, "node_stats": split.node_reports,
            "attention": split.attention_paths(), "uncut": split.uncut, "calls": split.patch_calls,
            "ahead": split.patch_ahead, "used": split.patches_used, "plan": split.splitter.plan.with_route(split.plan.route)}
    return output_array(result), seen


def args_for(family: str, steps: int = STEPS) -> dict:
    return dict(families.call_args(family), num_inference_steps=steps)


# --------------------------------------------------------------------------- the client's cutting, in this process


class EchoRing:
    """A ring of one node whose blocks double the stream; logs every send and receive in order."""

    def __init__(self, single: bool = True):
        self.single, self.log, self.sent = single, [], {}

    def send(self, stack, tree, tensors, rmap, patch=None, digests=None) -> int:
        seq = len(self.sent) + 1
        self.sent[seq] = (list(tensors), patch, digests)
        self.log.append(("send", seq))
        return seq

    def receive(self, seq: int):
        self.log.append(("receive", seq))
        tensors, _, _ = self.sent[seq]
        return tensors[0] * 2 if self.single else (tensors[0] * 2, None)


def test_patcher_sends_every_patch_of_a_step_before_awaiting_any():
    ring, one = EchoRing(), ReturnMap(single=True, outputs=[0], names=["args[0]"])
    patcher = Patcher(ring, 4)
    text, t = torch.randn(1, 5, 8), torch.randn(1, 8)
    first, second = torch.randn(1, 12, 8), torch.randn(1, 12, 8)
    assert torch.equal(patcher.run("blocks", {}, [first, text, t], one), first * 2)
    (sent, patch, _), = ring.sent.values()
    assert patch.uncut and patch.tokens == 12 and sent[0] is first
    ring.log.clear()
    assert torch.equal(patcher.run("blocks", {}, [second, text, t], one), second * 2)
    assert [op for op, _ in ring.log] == ["send"] * 4 + ["receive"] * 4
    cuts = [ring.sent[seq] for op, seq in ring.log if op == "send"]
    assert [(p.index, p.lo, p.count, p.uncut, p.step) for _, p, _ in cuts] == [(i, 3 * i, 3, False, 2)
                                                                                for i in range(4)]
    for sent, p, digests in cuts:
        assert torch.equal(sent[0], second[:, p.lo:p.lo + p.count]) and sent[1] is text and sent[2] is t
        assert digests is cuts[0][2] and digests[0] == b""  # hashed once per call, the stream never
    assert patcher.calls == {"uncut": 1, "cut": 1}
    assert patcher.used == {"blocks": {"asked": 4, "used": 4, "why": ""}}


def test_patcher_reports_the_patches_it_used_not_the_ones_asked():
    ring = EchoRing(single=False)
    rmap = ReturnMap(single=False, outputs=[0, None], names=["args[0]", None])
    patcher = Patcher(ring, 4)
    text = torch.randn(1, 5, 8)
    patcher.run("blocks", {}, [torch.randn(1, 3, 8), text], rmap)
    assert patcher.used["blocks"]["used"] == 1 and patcher.used["blocks"]["why"]  # only an uncut step so far
    x = torch.randn(1, 3, 8)
    out, none = patcher.run("blocks", {}, [x, text], rmap)
    assert torch.equal(out, x * 2) and none is None
    assert patcher.used == {"blocks": {"asked": 4, "used": 3, "why": "only 3 tokens"}}
    assert patcher.calls == {"uncut": 1, "cut": 1}


def test_the_next_branch_is_sent_ahead_and_used_only_if_its_call_is_what_was_sent():
    ring, one = EchoRing(), ReturnMap(single=True, outputs=[0], names=["args[0]"])
    patcher = Patcher(ring, 2)
    cond, uncond, t = torch.randn(1, 5, 8), torch.randn(1, 5, 8), torch.ones(1)

    def step(x, second=uncond):
        a = patcher.run("blocks", {}, [x, cond, t], one)
        b = patcher.run("blocks", {}, [x, second, t], one)
        assert torch.equal(a, x * 2) and torch.equal(b, x * 2)

    step(torch.randn(1, 4, 8))  # first step: both branches whole, nothing to guess from
    ring.log.clear()
    step(torch.randn(1, 4, 8))
    # the first call's two patches, then the second branch's two sent at once; the second call only receives
    assert [op for op, _ in ring.log] == ["send"] * 4 + ["receive"] * 4
    guessed = [ring.sent[seq] for op, seq in ring.log[2:4]]
    assert all(sent[1] is uncond and p.branch == 1 and not p.uncut for sent, p, _ in guessed)
    assert patcher.ahead == {"used": 1, "dropped": 0} and patcher.calls == {"uncut": 2, "cut": 2}
    ring.log.clear()
    step(torch.randn(1, 4, 8), second=torch.randn(1, 5, 8))  # the second call is not what was guessed
    sends = [ring.sent[seq][1] for op, seq in ring.log if op == "send"]
    # the guess for branch 1 is received and dropped, and the call (a branch never seen: 2) runs whole
    assert patcher.ahead == {"used": 1, "dropped": 1} and sends[-1].uncut and sends[-1].branch == 2
    assert [op for op, _ in ring.log][-4:] == ["receive", "receive", "send", "receive"]
    ring.log.clear()
    step(torch.randn(1, 4, 8))  # branch 1 again: the nodes' buffers of it hold the dropped guess, so it runs whole
    sends = [ring.sent[seq][1] for op, seq in ring.log if op == "send"]
    assert sends[-1].uncut and sends[-1].branch == 1 and patcher.ahead["dropped"] == 2  # the guess was for 2


def test_passes_sent_ahead_are_taken_off_the_ring_before_any_other_answer_and_kept_for_their_call():
    ring, one = EchoRing(), ReturnMap(single=True, outputs=[0], names=["args[0]"])
    patcher = Patcher(ring, 2)
    cond, uncond, t = torch.randn(1, 5, 8), torch.randn(1, 5, 8), torch.ones(1)
    x = torch.randn(1, 4, 8)
    patcher.run("a", {}, [x, cond, t], one)
    patcher.run("a", {}, [x, uncond, t], one)
    x = torch.randn(1, 4, 8)
    patcher.run("a", {}, [x, cond, t], one)  # sends the second call of this step ahead
    ahead = list(patcher._ahead["a"].seqs)
    ring.log.clear()
    patcher.run("b", {}, [torch.randn(1, 4, 8), cond, t], one)  # another stack's call: the ring answers in order
    assert ring.log[:2] == [("receive", s) for s in ahead]
    ring.log.clear()
    out = patcher.run("a", {}, [x, uncond, t], one)  # the call it was sent for: its kept answers, nothing sent
    assert torch.equal(out, x * 2) and ring.log == [] and patcher.ahead == {"used": 1, "dropped": 0}
    x = torch.randn(1, 4, 8)
    patcher.run("a", {}, [x, cond, t], one)  # the next step sends it ahead again...
    ring.log.clear()
    patcher.settle()  # ...and a call that does not go through the patcher takes it off the ring first
    assert [op for op, _ in ring.log] == ["receive", "receive"]
    out = patcher.run("a", {}, [x, uncond, t], one)
    assert torch.equal(out, x * 2) and patcher.ahead == {"used": 2, "dropped": 0}


def test_guidance_branches_are_told_apart_by_their_conditioning():
    tracker, t = BranchTracker(), torch.ones(1)
    cond, uncond = torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    seen = []
    for _ in range(3):
        x = torch.randn(1, 12, 8)
        seen += [tracker.identify([x, cond, t], 0), tracker.identify([x, uncond, t], 0)]
        t = t + 1  # a new timestep every step: not what names a branch
    assert seen == [(0, 1, True), (1, 1, True), (0, 2, False), (1, 2, False), (0, 3, False), (1, 3, False)]


def test_one_policy_decides_whether_a_stack_is_cut():
    one = ReturnMap(single=True, outputs=[0], names=["args[0]"])
    two = ReturnMap(single=False, outputs=[0, 3], names=["args[0]", "encoder_hidden_states"])
    assert why_uncut(one, PATCHABLE, False) is None
    assert why_uncut(two, PATCHABLE, False) == "its blocks return 2 streams (args[0], encoder_hidden_states)"
    assert "the plan says" in why_uncut(one, UNCUT_STEPS, False)
    assert "the nodes say" in why_uncut(one, PATCHABLE, True)
    with pytest.raises(ValueError):
        why_uncut(one, "whole-steps", False)


# --------------------------------------------------------------------------- a node's buffers, in this process


def stack_calls(models, family: str, steps: int = 2):
    """The pipeline run here; its first stack's blocks, return map, and the first call into block 0 of
    each (branch, step), with every tensor copied."""
    from diffuse.plan.calltree import flatten
    from diffuse.plan.planner import analyze, learn_call, load_pipeline

    model = models(family)
    subject, draft = analyze(model)
    stack = draft["stacks"][0]
    pipe = load_pipeline(model)
    blocks = getattr(pipe, subject.denoiser).get_submodule(stack.path)
    calls = []
    hook = blocks[0].register_forward_pre_hook(lambda m, a, k: calls.append((a, k, flatten(a, k))), with_kwargs=True)
    with torch.no_grad():
        pipe(**args_for(family, steps), generator=torch.Generator("cpu").manual_seed(0), output_type="np")
    hook.remove()
    _, rmap = learn_call(stack, calls[0][0], calls[0][1], blocks[0])
    tracker, picked = BranchTracker(), {}
    for _, _, (tree, tensors) in calls:
        tensors = [t.clone() for t in tensors]
        picked.setdefault(tracker.identify(tensors, rmap.streams[0])[:2], (tree, tensors))
    return list(blocks), rmap, picked


def whole(block, tree, values, rmap):
    """``block`` run plainly over ``values``: its stream output, all tokens."""
    args, kwargs = unflatten(tree, list(values))
    with torch.no_grad():
        out = block(*args, **kwargs)
    return out if rmap.single else out[rmap.output_of(rmap.streams[0])]


def with_stream(values, s, x) -> list:
    out = list(values)
    out[s] = x
    return out


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("family", ["wan", "pixart_sigma", "ltx", "stable_audio"])
def test_quick_rows_are_the_block_run_over_the_whole_buffer(family, models):
    blocks, rmap, calls = stack_calls(models, family)
    (tree, one), (_, two) = calls[(0, 1)], calls[(0, 2)]
    s, block = rmap.streams[0], blocks[0]
    axis = token_axis(two[s].shape)
    tokens = two[s].shape[axis]
    (a, b), (c, d) = patch_ranges(tokens, 2)
    stale, step = StaleStack("stack"), Patch(branch=0, step=2, axis=axis, tokens=tokens)
    held = [(0, block)]
    with torch.no_grad():
        stale.run(held, tree, [t.clone() for t in one], rmap, Patch(0, 1, axis, tokens, uncut=True))
        first = stale.run(held, tree, with_stream(two, s, two[s].narrow(axis, a, b - a)), rmap, step.cut(0, a, b))
        second = stale.run(held, tree, with_stream(two, s, two[s].narrow(axis, c, d - c)), rmap, step.cut(1, c, d))
    assert stale.paths[0]["path"] == "quick", stale.paths[0]
    # the first patch (while the path is chosen) is answered by the kept path, as on a stack that had chosen it
    # already: where or when the choice is made changes no bit...
    chosen = StaleStack("stack")
    chosen.paths[0] = {"path": "quick", "agreement": 0.0, "why": ""}
    with torch.no_grad():
        chosen.run(held, tree, [t.clone() for t in one], rmap, Patch(0, 1, axis, tokens, uncut=True))
        again = chosen.run(held, tree, with_stream(two, s, two[s].narrow(axis, a, b - a)), rmap, step.cut(0, a, b))
    assert torch.equal(first, again)
    # ...the second, by the quick path, this step's rows everywhere: the block over this step's whole input
    expected = whole(block, tree, two, rmap).narrow(axis, c, d - c)
    assert rel(second, expected) < 1e-4, rel(second, expected)


def test_sana_blocks_run_plain_because_quick_cannot_reproduce_them(models):
    blocks, rmap, calls = stack_calls(models, "sana")
    (tree, one), (_, two) = calls[(0, 1)], calls[(0, 2)]
    s = rmap.streams[0]
    axis = token_axis(two[s].shape)
    tokens = two[s].shape[axis]
    held, step = list(enumerate(blocks)), Patch(branch=0, step=2, axis=axis, tokens=tokens)
    stale = StaleStack("stack")
    with torch.no_grad():
        stale.run(held, tree, [t.clone() for t in one], rmap, Patch(0, 1, axis, tokens, uncut=True))
        for i, (lo, hi) in enumerate(patch_ranges(tokens, 2)):
            stale.run(held, tree, with_stream(two, s, two[s].narrow(axis, lo, hi - lo)), rmap, step.cut(i, lo, hi))
    assert len(held) == 4 and all(stale.paths[i]["path"] == "plain" for i, _ in held), stale.paths
    # the quick path given this step's own keys and values over all tokens, against each block run over them
    _, (c, d) = patch_ranges(tokens, 2)
    x = list(two)
    for idx, block in held:
        kv = AttentionBuffer()
        with torch.no_grad(), attention_scope(block, "record", tokens, kv):
            out = whole(block, tree, x, rmap)
        try:
            with torch.no_grad():
                rows = with_stream(x, s, x[s].narrow(axis, c, d - c))
                p = PatchRun(tree, rows, rmap, step.cut(1, c, d), check=kv)
                quick = PATHS["quick"](StaleStack("stack"), idx, block, p)
            err = rel(quick, out.narrow(axis, c, d - c))
        except (RuntimeError, QuickUnsupported):  # cannot run on a patch's rows at all (a grid reshape)
            err = float("inf")
        assert err > 1e-4, (idx, err)
        x[s] = out


def test_each_guidance_branch_borrows_from_its_own_buffers(models):
    blocks, rmap, calls = stack_calls(models, "wan")  # guidance as two calls per step: two branches
    (tree, one0), (_, one1), (_, two0) = calls[(0, 1)], calls[(1, 1)], calls[(0, 2)]
    s = rmap.streams[0]
    axis = token_axis(two0[s].shape)
    tokens = two0[s].shape[axis]
    (a, b), _ = patch_ranges(tokens, 2)
    held = list(enumerate(blocks[:2]))  # block 0's input is the same latent for both branches; block 1's is not
    stale = StaleStack("stack", "plain")
    with torch.no_grad():  # branch 1 comes last: were buffers shared, branch 0 would find branch 1's
        for branch, call in ((0, one0), (1, one1)):
            stale.run(held, tree, [t.clone() for t in call], rmap, Patch(branch, 1, axis, tokens, uncut=True))
        got = stale.run(held, tree, with_stream(two0, s, two0[s].narrow(axis, a, b - a)), rmap,
                        Patch(0, 2, axis, tokens).cut(0, a, b))
    mixed = torch.cat([two0[s].narrow(axis, a, b - a), one0[s].narrow(axis, b, tokens - b)], axis)
    fresh = whole(blocks[0], tree, with_stream(two0, s, mixed), rmap).narrow(axis, a, b - a)

    def block1_over(last_step):  # block 1 over a branch's last-step input to it, this patch's rows fresh
        x = whole(blocks[0], tree, last_step, rmap)
        x.narrow(axis, a, b - a).copy_(fresh)
        return whole(blocks[1], tree, with_stream(two0, s, x), rmap).narrow(axis, a, b - a)

    own, other = block1_over(one0), block1_over(one1)
    assert rel(got, own) < 1e-6
    assert rel(other, own) > 1e-4  # sharing buffers would borrow the other branch's activations
    assert stale.report()["branches"] == 2


# --------------------------------------------------------------------------- exactness where promised


@pytest.mark.parametrize("patches", [2, 3])
def test_patched_output_is_the_same_on_one_two_or_three_nodes(patches, models, nodes, diffuse_home):
    model = models("wan")
    runs = [split_run(model, args_for("wan"), nodes(model, n), patches) for n in (1, 2, 3)]
    (one, seen), (two, _), (three, _) = runs
    assert seen["calls"]["cut"] > 0, "the run was never cut into patches"
    assert one.tobytes() == two.tobytes() == three.tobytes()
    # each step's second guidance call was sent ahead, while the first finished; sent when called, the same bits
    assert seen["ahead"] == {"used": seen["calls"]["cut"] // 2, "dropped": 0}
    if patches == 2:
        waited, seen_waited = split_run(model, args_for("wan"), nodes(model, 2), patches, ahead=False)
        assert seen_waited["ahead"] == {"used": 0, "dropped": 0} and waited.tobytes() == two.tobytes()
        # two groups of one node: each branch's patches on its own group, the second sent ahead to run alongside
        grouped, seen_grouped = split_run(model, args_for("wan"), nodes(model, 2), patches, groups=True)
        assert seen_grouped["ahead"]["used"] > 0
        assert grouped.tobytes() == two.tobytes()
        assert all(n["messages"] > 0 for n in seen_grouped["node_stats"])


@pytest.mark.parametrize("family,patches,calls", [("wan", 4, 2), ("pixart_sigma", 3, 1)])
def test_one_step_with_patches_is_the_whole_model_exactly(family, patches, calls, models, nodes, diffuse_home,
                                                          tmp_path):
    model = models(family)
    kwargs = args_for(family, steps=1)
    reference = Reference(model, kwargs, str(tmp_path / "reference.npy"))  # side by side with the split run
    split, seen = split_run(model, kwargs, nodes(model, 2), patches)
    reference = reference.result()
    # Wan runs guidance as two calls per step, PixArt as one batch of two: every call is a branch's first
    assert seen["calls"] == {"uncut": calls, "cut": 0}
    assert split.tobytes() == reference.tobytes(), f"max abs diff {np.abs(split - reference).max()}"


def test_patches_change_the_output_only_after_the_first_step(models, nodes, diffuse_home):
    model = models("wan")
    exact, _ = split_run(model, args_for("wan"), nodes(model, 2), 1)
    patched, seen = split_run(model, args_for("wan"), nodes(model, 2), 2)
    assert seen["calls"]["cut"] == 2 * 2  # steps 2 and 3, two guidance branches each
    assert exact.tobytes() != patched.tobytes()  # stale activations are an approximation...
    assert np.abs(patched - exact).max() < 0.5 * np.abs(exact).max()  # ...not a different picture


# --------------------------------------------------------------------------- the two attention paths


@pytest.mark.parametrize("family", ["wan", "pixart_sigma", "ltx", "stable_audio"])
def test_quick_attention_is_kept_only_where_it_agrees_with_plain(family, models, nodes, diffuse_home):
    model = models(family)
    exact, _ = split_run(model, args_for(family), nodes(model, 2), 1)
    quick, seen = split_run(model, args_for(family), nodes(model, 2), 2)
    plain, seen_plain = split_run(model, args_for(family), nodes(model, 2), 2, attention="plain")
    paths = seen["attention"]
    assert len(paths) == 1
    (stack, m), = paths.items()
    assert m["path"] == "quick", m  # that it is right: test_quick_rows_are_the_block_run_over_the_whole_buffer
    assert seen_plain["attention"][stack]["path"] == "plain"
    # on the patch where both ran they computed the same thing; later they differ only in how stale the
    # other patches' keys are (last step's keys, or last step's input under this step's timestep): both
    # stay an approximation of the exact output, not another picture (which of the two is nearer depends
    # on the model: on the 12-token test Wan quick is further, on the others nearer)
    scale = np.abs(exact).max()
    for approx in (quick, plain):
        assert 0 < np.abs(approx - exact).max() < 0.5 * scale


def test_sana_convolution_outside_attention_falls_back_to_plain(models, nodes, diffuse_home):
    model = models("sana")
    auto, seen = split_run(model, args_for("sana"), nodes(model, 2), 2)
    forced, _ = split_run(model, args_for("sana"), nodes(model, 2), 2, attention="plain")
    (stack, m), = seen["attention"].items()
    assert m["path"] == "plain" and len(m["blocks"]) == 4  # why: test_sana_blocks_run_plain_because_quick_...
    assert auto.tobytes() == forced.tobytes()


# --------------------------------------------------------------------------- guidance branches


def test_guidance_branches_keep_separate_buffers(models, nodes, diffuse_home):
    model = models("wan")  # Wan runs guidance as two calls per step
    _, seen = split_run(model, args_for("wan"), nodes(model, 2), 2)
    assert {m["branches"] for m in seen["attention"].values()} == {2}
    assert {msg["branch"] for msg in seen["messages"]} == {0, 1}
    # that sharing them would change the answer: test_each_guidance_branch_borrows_from_its_own_buffers


def test_stale_buffers_go_with_the_session(models, nodes, diffuse_home):
    from diffuse.wire.transport import transport_for

    model = models("wan")
    addresses = nodes(model, 2)
    _, seen = split_run(model, args_for("wan"), addresses, 2)
    plan = seen["plan"]
    spec = plan.call_plans["blocks"].tensors[plan.return_maps["blocks"].streams[0]]
    stream_bytes = math.prod(spec.shape) * torch.empty(0, dtype=getattr(torch, spec.dtype)).element_size()
    for stage, ns in zip(plan.route, seen["node_stats"]):
        sl = stage.slice_of("blocks")
        # per branch, per held block: at least its input over all tokens (plain) or its keys and values (quick)
        assert ns["stale"]["blocks"]["buffer_bytes"] >= 2 * (sl.stop - sl.start) * stream_bytes
    transport = transport_for(addresses[0][0])
    for address, _ in addresses:
        assert transport.request(address, {"op": "status"}, 10.0)["sessions"] == 0


# --------------------------------------------------------------------------- two streams


@pytest.mark.parametrize("family,stacks", [("flux", "single_transformer_blocks, transformer_blocks"),
                                           ("odd", "trunk.layers")])
def test_two_stream_model_runs_uncut_steps_and_says_so(family, stacks, models, diffuse_home, tmp_path):
    model = models(family)
    kwargs = args_for(family)
    reference = Reference(model, kwargs, str(tmp_path / "reference.npy"))  # side by side with the split run
    save = tmp_path / "split.npy"
    cmd = split_command(model, kwargs, str(save), nodes=2, extra=["--patches", "3", "--out", str(tmp_path / "o.png")])
    proc = run_client(cmd[3:], diffuse_home)  # the command's own code, its client in this process
    reference = reference.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "two streams" in line and "steps run uncut" in line]
    assert len(said) == 1, proc.stderr
    assert said[0].startswith(f"{stacks}: ")
    assert "patches used" not in proc.stderr  # no stack was cut, and the summary does not say otherwise
    assert np.load(save).tobytes() == reference.tobytes()


# --------------------------------------------------------------------------- the wire


def test_after_the_first_step_only_patches_and_the_timestep_travel(models, nodes, diffuse_home):
    model = models("wan")
    _, seen = split_run(model, args_for("wan"), nodes(model, 3), 2)
    names = seen["plan"].call_plans["blocks"].slot_names  # args[0] hidden states, args[2] timestep projection
    later = [m for m in seen["messages"] if m.get("step", 0) > 1]
    assert later and all(not m.get("uncut") for m in later)
    for m in later:
        assert {names[i] for i in m["fresh_slots"]} <= {"args[2]"}, m
    # the timestep travels once per step: both branches of a step share it
    per_step = {}
    for m in later:
        per_step[m["step"]] = per_step.get(m["step"], 0) + bool(m["fresh_slots"])
    assert set(per_step.values()) == {1}
    # every hop: a patch of hidden states, the timestep where it is new, and under 1 KiB besides
    sent = {m["seq"]: m for m in later}
    hops = [dict(ns["hop_bytes"]) for ns in seen["node_stats"]] + [dict(seen["returns"])]
    assert len(hops) == 4
    for seq, m in sent.items():
        for k, hop in enumerate(hops):
            carried = m["stream_bytes"] + (m["fresh_bytes"] if k < 3 else 0)  # the answer carries no timestep
            assert 0 < hop[seq] - carried <= 1024, (k, seq, hop[seq], m)
