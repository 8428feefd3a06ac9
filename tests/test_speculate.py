"""Several tokens per trip: drafts made on the client, verified by one pass through the ring (``diffuse.lm.client_drafts``).

Real node processes on loopback, against plain transformers run whole in a subprocess (tests/lm_reference.py,
at the same thread count). Greedy decoding with drafts (prompt lookup, by default; an assistant model) gives the
tokens plain greedy ``generate`` gives whole, at 2 and 3 nodes, on full-attention and sliding-window layers (whose
caches are cut back through a window); seeded sampling gives what transformers' assisted generation draws whole
with the same drafter (its acceptance rule, run on the client from whole rows). A replica killed while drafts are
in flight is replaced, the session replayed with its cuts, and the answer does not change. Bad flags end in one
line, before any node starts.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from conftest import THREADS, reference_jobs, run_client
from test_hardening import _node, _nodes, _stop
from test_lm import lm_models  # noqa: F401  (the session's tiny models, built once)

# a prompt the tiny models answer by repeating themselves (random weights quote nothing, but fall into a loop
# here): prompt lookup finds what to draft in their own answer
PROMPT = "one two three four five one two three four five one two three"
NEW = 24
SEED = 7


@pytest.fixture(scope="module")
def spec_models(lm_models):  # noqa: F811
    return lm_models


@pytest.fixture(scope="module")
def assistant_dir(tmp_path_factory) -> str:
    """Another tiny Qwen2 (its own seed, so its drafts are often wrong) with the model's tokenizer."""
    import lm_models

    return lm_models.build("qwen2", str(tmp_path_factory.mktemp("spec-assistant") / "qwen2-assistant"), seed=1)


@pytest.fixture(scope="module")
def spec_refs(spec_models, assistant_dir, tmp_path_factory) -> dict:
    qwen2, hybrid = spec_models("qwen2"), spec_models("hybrid")
    base = dict(prompt=PROMPT, max_new_tokens=NEW)
    jobs = {"greedy": dict(base, model=qwen2), "hybrid": dict(base, model=hybrid),
            "lookup_sampled": dict(base, model=qwen2, do_sample=True, seed=SEED,
                                   generate_args={"prompt_lookup_num_tokens": 4}),
            "assistant_sampled": dict(base, model=qwen2, do_sample=True, seed=SEED, assistant=assistant_dir),
            "plain_sampled": dict(base, model=qwen2, do_sample=True, seed=SEED)}
    results = reference_jobs("lm_reference.py", list(jobs.values()), tmp_path_factory.mktemp("spec-refs"))
    return {name: r["new_tokens"] for name, r in zip(jobs, results)}


def _split_runs(model_dir: str, nodes: int, assistant_dir: str | None = None, **options) -> dict:
    """The runs each test compares, through ``nodes`` local node processes: the new tokens and the drafts' counts."""
    import diffuse
    from diffuse.lm.client_media import build_inputs
    from diffuse.local.nodes import start_local_nodes
    from transformers import AutoModelForCausalLM

    inputs, _ = build_inputs(model_dir, PROMPT)
    prompt_len = inputs["input_ids"].shape[1]
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    started = start_local_nodes(model_dir, nodes, threads=THREADS)
    out = {}
    try:
        model = diffuse.from_pretrained(model_dir)
        addresses = [f"{n.address}#{n.key}" for n in started]
        with torch.no_grad(), diffuse.split(model, nodes=addresses, **options) as ring:
            # the default drafts by prompt lookup where greedy tokens cannot change
            tokens = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
            out["greedy"] = (tokens[:, prompt_len:].tolist(), ring.splitter.drafting.last)
            if assistant_dir is None:
                return out
            # transformers' own drafter as the call names it: fixed at 4 tokens, sampled with its acceptance rule
            torch.manual_seed(SEED)
            tokens = model.generate(**inputs, max_new_tokens=NEW, do_sample=True, prompt_lookup_num_tokens=4)
            out["lookup_sampled"] = (tokens[:, prompt_len:].tolist(), ring.splitter.lm.generation.drafts)
            torch.manual_seed(SEED)  # no drafts when sampling by default: the seed draws what it draws whole
            tokens = model.generate(**inputs, max_new_tokens=NEW, do_sample=True)
            out["plain_sampled"] = (tokens[:, prompt_len:].tolist(), ring.splitter.drafting.last)
        assistant = AutoModelForCausalLM.from_pretrained(assistant_dir)
        with torch.no_grad(), diffuse.split(model, nodes=addresses, speculate=assistant, **options) as ring:
            tokens = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
            out["assistant_greedy"] = (tokens[:, prompt_len:].tolist(), ring.splitter.drafting.last)
            torch.manual_seed(SEED)
            tokens = model.generate(**inputs, max_new_tokens=NEW, do_sample=True)
            out["assistant_sampled"] = (tokens[:, prompt_len:].tolist(), ring.splitter.drafting.last)
    finally:
        torch.set_num_threads(threads)
        started.stop()
    return out


@pytest.mark.parametrize("nodes", [2, 3])
def test_drafts_verified_by_the_ring_give_transformers_tokens_greedy_and_sampled(nodes, spec_models, spec_refs,
                                                                                 assistant_dir, diffuse_home):
    # at three nodes the embedding table is on the first node: drafted tokens travel as ids
    runs = _split_runs(spec_models("qwen2"), nodes, assistant_dir, embedding_on_node=nodes == 3)
    tokens, drafts = runs["greedy"]
    assert tokens == spec_refs["greedy"]  # plain greedy whole, no drafts there
    # drafts were made, some accepted, some cut: fewer passes than tokens
    assert drafts.drafts > 0 and 0 < drafts.accepted < drafts.drafted and drafts.passes < NEW
    tokens, drafts = runs["lookup_sampled"]
    assert tokens == spec_refs["lookup_sampled"] and drafts.drafted > 0
    tokens, drafts = runs["plain_sampled"]
    assert tokens == spec_refs["plain_sampled"] and drafts is None
    assert spec_refs["plain_sampled"] != spec_refs["greedy"]  # not greedy in disguise
    tokens, drafts = runs["assistant_greedy"]
    # its wrong drafts were cut, and drafting paused after a run of them (greedy: the tokens cannot change)
    assert tokens == spec_refs["greedy"] and drafts.drafted > drafts.accepted and drafts.paused > 0
    tokens, drafts = runs["assistant_sampled"]
    assert tokens == spec_refs["assistant_sampled"] and drafts.drafts > 0


def test_sliding_window_caches_are_cut_back_through_their_window(spec_models, spec_refs, diffuse_home):
    """The hybrid model's sliding layers (window 4) keep their past while drafts are checked (as the client's
    cache records it), then are cut as the client's was: the tokens are plain greedy's whole."""
    tokens, drafts = _split_runs(spec_models("hybrid"), 2)["greedy"]
    assert tokens == spec_refs["hybrid"]
    assert drafts.drafts > 0 and drafts.accepted < drafts.drafted


def test_a_replica_killed_with_drafts_in_flight_changes_nothing(spec_models, spec_refs, diffuse_home, quick_probes):
    """Nodes: first half, second half, its replica. The second half's holder is killed as the third verifying
    pass is sent; its replica takes the route, the session's passes (cuts included) replay into its cache."""
    import diffuse
    from diffuse.client.repair import AVOIDED
    from diffuse.lm.client_media import build_inputs

    model_dir = spec_models("qwen2")
    inputs, _ = build_inputs(model_dir, PROMPT)
    nodes = _nodes(model_dir, ["1/2", "2/2", "2/2"])
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    lines = []

    class KillAt:
        def __init__(self):
            self.puts = 0

        def put(self, value):
            self.puts += 1
            if self.puts == 3:  # the prompt, two answers: the next pass carries drafts
                nodes[1][0].send_signal(signal.SIGKILL)

        def end(self):
            pass

    try:
        model = diffuse.from_pretrained(model_dir)
        with torch.no_grad(), diffuse.split(model, nodes=[f"{r['address']}#{r['key']}" for _, r in nodes],
                                            timeout=60, speculate="lookup") as split:
            split.ring.say = lines.append
            out = model.generate(**inputs, max_new_tokens=NEW, do_sample=False, streamer=KillAt())
            drafts = split.splitter.drafting.last
            route = [s.address for s in split.plan.route]
    finally:
        AVOIDED.clear()
        torch.set_num_threads(threads)
        _stop(*(p for p, _ in nodes))
    assert out[:, inputs["input_ids"].shape[1]:].tolist() == spec_refs["greedy"]
    assert route == [nodes[0][1]["address"], nodes[2][1]["address"]]
    assert len(lines) == 1 and nodes[1][1]["address"] in lines[0] and "replayed" in lines[0], lines
    assert drafts.drafts > 0 and drafts.accepted < drafts.drafted


def test_a_node_of_an_older_wire_version_gets_no_drafts(spec_models, spec_refs, diffuse_home):
    """A node speaking wire versions 1 and 2 (as one from before cuts travelled) would not cut its cache: the
    default then drafts nothing, and asking for drafts is refused in one line naming it."""
    import diffuse

    from diffuse.lm.client_media import build_inputs

    model_dir = spec_models("qwen2")
    inputs, _ = build_inputs(model_dir, PROMPT)
    nodes = [_node(model_dir, "1/2", ["--wire", "1,2"]), _node(model_dir, "2/2")]
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        model = diffuse.from_pretrained(model_dir)
        addresses = [f"{r['address']}#{r['key']}" for _, r in nodes]
        with torch.no_grad(), diffuse.split(model, nodes=addresses, timeout=60) as split:
            out = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
            assert split.splitter.drafting.last is None and split.ring.channel_stats.passes == NEW
        with torch.no_grad(), diffuse.split(model, nodes=addresses, timeout=60, speculate="lookup"):
            with pytest.raises(diffuse.DiffuseError, match=f"node {nodes[0][1]['address']} .2. speaks a wire version "
                                                           "older than 3"):
                model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    finally:
        torch.set_num_threads(threads)
        _stop(*(p for p, _ in nodes))
    assert out[:, inputs["input_ids"].shape[1]:].tolist() == spec_refs["greedy"]


def test_the_command_line_drafts_reports_and_refuses_bad_drafting_in_one_line(spec_models, spec_refs, tmp_path,
                                                                               diffuse_home):
    model = spec_models("qwen2")
    report, tokens = tmp_path / "r.json", tmp_path / "t.json"
    argv = ["--model", model, "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--threads", str(THREADS),
            "--local-nodes", "2", "--quiet", "--timeout", "120"]
    loud = [a for a in argv if a != "--quiet"]  # its summary says what drafting did
    run = run_client([*loud, "--speculate", "lookup", "--draft-tokens", "4", "--report", str(report),
                      "--save-tokens", str(tokens)], diffuse_home)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(report) as f, open(tokens) as g:
        r, t = json.load(f), json.load(g)
    assert t["new_tokens"] == spec_refs["greedy"]
    sp = r["speculation"]
    assert sp["drafter"] == "lookup" and sp["tokens_per_trip"] > 1 and 0 < sp["acceptance"] < 1
    assert sp["passes"] == r["tail_passes"] < NEW  # every pass verified (or decoded) on the last node
    assert "tokens per trip" in run.stdout + run.stderr
    # bad drafting: one line, status 2, before any node starts
    smolvlm = spec_models("smolvlm")  # another tokenizer
    # an assistant whose weights this process has no room for (a sparse file: its size, no disk): refused before a
    # byte of it is read
    import shutil

    huge = tmp_path / "huge-assistant"
    shutil.copytree(model, huge)
    for f in huge.glob("*.safetensors"):
        os.truncate(f, 1 << 40)
    for extra, said in ((["--draft-tokens", "0"], "1 to 32"), (["--draft-tokens", "33"], "1 to 32"),
                        (["--speculate", str(huge)], "the assistant's weights take 1024.00 GiB and this process may"),
                        (["--speculate", smolvlm], "tokenizer is not the model's"),
                        (["--speculate", str(tmp_path / "nowhere")], "nowhere"),
                        (["--whole", "--speculate", "lookup"], "--whole")):
        bad = run_client([*[a for a in argv if a not in ("--local-nodes", "2")], *extra], diffuse_home)
        assert bad.returncode == 2, (extra, bad.stderr[-2000:])
        errors = [line for line in bad.stdout.splitlines() + bad.stderr.splitlines() if "error:" in line]
        assert len(errors) == 1 and said in errors[0], (extra, errors)
        assert "starting" not in bad.stdout + bad.stderr, extra


def test_crops_travel_in_the_pass_and_a_malformed_one_is_refused():
    from diffuse.wire.passes import ContractError, LayerPass

    p = LayerPass("DynamicCache", False, record=True, crops=(-3, 0))
    w = p.to_wire()
    assert w["state"] == {"kind": "DynamicCache", "fresh": False, "record": True, "crops": [-3, 0]}
    assert LayerPass.from_wire(w, 1) == p
    assert "crops" not in LayerPass("DynamicCache").to_wire()["state"]
    for crops in ([1], ["-1"], [-(1 << 21)], [0] * 65, "x"):
        with pytest.raises(ContractError, match="crops"):
            LayerPass.from_wire({"state": {"kind": "DynamicCache", "fresh": False, "crops": crops}}, 1)
    with pytest.raises(ContractError, match="cache state"):
        LayerPass.from_wire({"state": {"kind": "DynamicCache", "record": "yes"}}, 1)
