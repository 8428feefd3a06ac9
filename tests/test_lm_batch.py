"""Decoding passes of concurrent sessions batched through a node's layers (``diffuse.lm.node_batching``).

Three greedy sessions with prompts of different lengths run at once through two
real local nodes, each session its own client (own model copy, own
``diffuse.split``) on its own thread: every session's tokens must be what plain
transformers' ``generate`` gives for its prompt alone (tests/lm_reference.py, in
a subprocess), and the nodes must say they formed batches, so this fails if
batching silently never happens; the second node, started with ``--no-batch``,
forms none. In-process, the
same layers' batched pass is compared with each session's lone pass: each cache
ends as the lone run leaves it, and a batch that cannot run leaves every cache
as it was.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from conftest import TESTS, THREADS, subprocess_env
from test_lm import LMModels

# three lengths of prompt (the chat template adds the same few tokens to each)
PROMPTS = ["Hi.", "Tell me a story about the moon.",
           "Write three short lines about the sea, the wind and the small boats that sleep in the harbour at night."]
NEW = 12


@pytest.fixture(scope="module")
def lm_dirs(tmp_path_factory) -> LMModels:
    return LMModels(tmp_path_factory.mktemp("lm-batch-models"))


@pytest.fixture(scope="module")
def references(lm_dirs, tmp_path_factory) -> dict:
    """Plain transformers, whole, one prompt at a time (input ids and new tokens per prompt), in a subprocess
    started here and read by ``reference_results`` (it runs while the split side runs); the prompts' input ids
    the split side needs are built in this process by the reference's own ``build_inputs``, and
    ``reference_results`` checks they are the reference's."""
    import lm_reference

    root = tmp_path_factory.mktemp("lm-batch-references")
    model = lm_dirs("qwen2")
    jobs = [dict(model=model, prompt=p, max_new_tokens=NEW) for p in PROMPTS]
    (root / "jobs.json").write_text(json.dumps(jobs))
    cmd = [sys.executable, os.path.join(TESTS, "lm_reference.py"), "--jobs", str(root / "jobs.json"),
           "--threads", str(THREADS), "--out", str(root / "results.json")]
    proc = subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ids = [lm_reference.build_inputs(model, p)["input_ids"].tolist() for p in PROMPTS]
    yield {"proc": proc, "out": root / "results.json", "input_ids": ids}
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def reference_results(references) -> list[dict]:
    proc = references["proc"]
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    refs = json.loads(references["out"].read_text())
    assert [r["input_ids"] for r in refs] == references["input_ids"]  # the split side ran the reference's prompts
    assert len({len(r["input_ids"][0]) for r in refs}) == 3  # three different lengths
    return refs


class Lockstep:
    """A streamer that waits for the other sessions at every token, so that their passes reach the nodes
    together (bounded: a session that stops early breaks the barrier as it ends, and the others go on alone --
    a session can emit two tokens at one ``put`` and so end a step before the others)."""

    def __init__(self, barrier: threading.Barrier):
        self.barrier = barrier

    def put(self, _value) -> None:
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            pass

    def end(self) -> None:
        self.barrier.abort()  # no more waits for this session: the others must not wait out the barrier's timeout


def concurrent_sessions(model: str, prompts: list[list[int]]) -> tuple[list, list[dict], list]:
    """Each prompt's greedy tokens through two local nodes, all sessions at once: the first node batches
    (the default), the second is started with ``--no-batch``. The nodes' status after, and each session's
    node reports."""
    from concurrent.futures import ThreadPoolExecutor

    import diffuse
    from diffuse.local.nodes import LocalNodes, start_local_nodes
    from diffuse.wire.transport import transport_for

    # one node each (the last --blocks given wins), both starting at once
    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(lambda extra: start_local_nodes(model, 1, threads=THREADS, extra=extra),
                                [["--blocks", "1/2"], ["--blocks", "2/2", "--no-batch"]]))
    nodes = LocalNodes(n for group in started for n in group)
    try:
        spec = [f"{n.address}#{n.key}" for n in nodes]
        # loaded one after the other: transformers' lazy imports are not safe to race
        copies = [diffuse.from_pretrained(model) for _ in prompts]
        barrier = threading.Barrier(len(prompts), timeout=20)
        results: dict[int, object] = {}

        def session(i: int) -> None:
            try:
                ids = torch.tensor([prompts[i]])
                with diffuse.split(copies[i], nodes=spec, timeout=60) as ring:
                    out = copies[i].generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                             min_new_tokens=NEW, do_sample=False, streamer=Lockstep(barrier))
                results[i] = (out[:, ids.shape[1]:].tolist(), ring.node_reports)
            except BaseException as exc:  # the test thread reports it
                barrier.abort()
                results[i] = exc

        threads = [threading.Thread(target=session, args=(i,), daemon=True) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for i in range(len(prompts)):
            if isinstance(results.get(i), BaseException):
                raise results[i]
            assert i in results, f"session {i} did not finish in 120 s"
        status = [transport_for(n.address).request(n.address, {"op": "status"}, 10.0) for n in nodes]
    finally:
        nodes.stop()
    return [results[i][0] for i in range(len(prompts))], status, [results[i][1] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def sessions(lm_dirs, references):
    return concurrent_sessions(lm_dirs("qwen2"), [ids[0] for ids in references["input_ids"]])


def test_concurrent_sessions_batched_tokens_equal_transformers(sessions, reference_results):
    tokens, (first, _), reports = sessions
    assert tokens == [r["new_tokens"] for r in reference_results]  # each session's, as if it ran alone
    assert first["batching"]
    # batches formed: rows of several sessions ran through the first node's layers at once
    assert first["batches"] > 0 and first["batched_rows"] >= 2 * first["batches"], first
    assert first["batch_fallbacks"] == 0, first  # Qwen2's decoding passes all fit
    assert sum(per[0]["batched_passes"] for per in reports) > 0


def test_no_batch_forms_none(sessions):
    _, (_, second), reports = sessions
    assert (second["batching"], second["batches"], second["batched_rows"]) == (False, 0, 0)
    assert all(per[1]["batched_passes"] == 0 for per in reports)


# ------------------------------------------------------------------ in-process: the batched layers themselves

def decoding_passes(model_dir: str, lengths: list[int]):
    """A model loaded whole, and for each prompt length a decoding pass of its layers as a node gets it
    (``diffuse.node.stage.Prepared``): the session's cache after the prompt, the next token's hidden state, positions,
    rotary cos/sin."""
    from transformers import AutoModelForCausalLM

    from diffuse.plan.calltree import flatten
    from diffuse.plan.contracts import ReturnMap, Slice
    from diffuse.node.stage import Prepared

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    layers = list(enumerate(model.model.layers))
    passes = []
    for n in lengths:
        ids = torch.arange(3, 3 + n)[None] % model.config.vocab_size
        with torch.no_grad():
            cache = model(ids, use_cache=True).cache
            hidden = model.model.embed_tokens(torch.tensor([[7]]))
            positions = torch.tensor([[n]])
            rotary = model.model.rotary_emb(hidden, positions)
        tree, tensors = flatten((hidden,), {"attention_mask": None, "position_embeddings": rotary,
                                            "position_ids": positions, "cache": cache, "use_cache": True})
        passes.append(Prepared({"op": "call"}, "model.layers", Slice("model.layers", 0, len(layers)), [], list(tensors),
                           {}, ReturnMap(single=True, outputs=[0], names=["args[0]"]), tree, {}, cache, layers))
    return model, passes


def lone(p):
    """The pass run alone on a copy of its cache: the last layer's output and the cache it leaves."""
    from diffuse.plan.calltree import thread_outputs, unflatten

    cache, values = copy.deepcopy(p.cache), list(p.values)
    with torch.no_grad():
        for _, block in p.blocks:
            args, kwargs = unflatten(p.tree, values, cache)
            out = block(*args, **kwargs)
            thread_outputs(values, out, p.rmap)
    return out, cache


def test_batched_layers_leave_each_cache_as_a_lone_pass(lm_dirs):
    from diffuse.lm.node_batching import batch_key, run_batch

    model, passes = decoding_passes(lm_dirs("qwen2"), [3, 9, 14])
    assert len({batch_key(torch.float32, p) for p in passes}) == 1  # one batch, whatever the cache lengths
    alone = [lone(p) for p in passes]
    caches = [p.cache for p in passes]
    outs = run_batch(passes)
    worst = 0.0
    for p, cache, out, (ref, ref_cache) in zip(passes, caches, outs, alone):
        assert p.cache is cache and out.shape == ref.shape == (1, 1, model.config.hidden_size)
        assert torch.equal(p.values[0], out)  # the stream slot holds the session's own rows
        worst = max(worst, (out - ref).abs().max().item())
        for layer, ref_layer in zip(cache.layers, ref_cache.layers):  # each session's own keys and values, no padding
            assert layer.keys.shape == ref_layer.keys.shape and layer.values.shape == ref_layer.values.shape
            torch.testing.assert_close(layer.keys, ref_layer.keys, rtol=0, atol=1e-5)
            torch.testing.assert_close(layer.values, ref_layer.values, rtol=0, atol=1e-5)
        # the next token is the lone run's
        assert torch.equal(model.lm_head(model.model.norm(out)).argmax(-1), model.lm_head(model.model.norm(ref)).argmax(-1))
    assert worst < 1e-5, worst  # masked attention over padding: at most the last bits of a float32 differ
    print(f"batched vs lone, last layer's output: max abs difference {worst:.2e}")


def test_a_batch_that_cannot_run_leaves_every_cache_as_it_was(lm_dirs):
    from diffuse.lm.node_batching import NotBatchable, batch_key, run_batch

    model, passes = decoding_passes(lm_dirs("qwen2"), [4, 6])
    before = [[(layer.keys, layer.values) for layer in p.cache.layers] for p in passes]

    class Fails(torch.nn.Module):  # a last layer that fails after the others wrote their caches
        def forward(self, *args, **kwargs):
            raise RuntimeError("fails")

    for p in passes:
        p.blocks = p.blocks[:-1] + [(p.blocks[-1][0], Fails())]
    with pytest.raises(RuntimeError):
        run_batch(passes)
    after = [[(layer.keys, layer.values) for layer in p.cache.layers] for p in passes]
    assert all(a is b for x, y in zip(before, after) for pa, pb in zip(x, y) for a, b in zip(pa, pb))
    # caches of different lengths need the padding mask: a mask already in the call cannot take it
    model, passes = decoding_passes(lm_dirs("qwen2"), [4, 6])
    for p in passes:
        p.tree["kwargs"]["attention_mask"] = {"$t": 0}  # the hidden state stands in for a mask
    with pytest.raises(NotBatchable):
        run_batch(passes)
    assert all(layer.get_seq_length() in (4, 6) for p in passes for layer in p.cache.layers)
    # a prefill (a cache still empty) and a sliding-window cache are never batched
    from transformers.cache_utils import DynamicCache

    passes[0].cache = DynamicCache(config=model.config)
    assert batch_key(torch.float32, passes[0]) is None
    _, hybrid = decoding_passes(lm_dirs("hybrid"), [5])
    assert batch_key(torch.float32, hybrid[0]) is None


def test_batched_tails_answer_each_row_as_its_tail_alone(lm_dirs):
    """The last node's tails of a batch (norm, head over every row in one product, best candidates) answer each
    session with the ids, order and value bits of its tail run alone; and the candidates, found by ``topk``, are
    those a stable sort of the row puts first, ties and all."""
    from types import SimpleNamespace

    from diffuse.plan.analysis import ModelSubject
    from diffuse.lm.node_batching import run_batch
    from diffuse.node.blockstore import BlockStore
    from diffuse.lm.node_layers import joint_tails, run_tail
    from diffuse.wire.passes import LayerPass, Tail
    from diffuse.plan.planner import config_draft
    from diffuse.lm.node_tail import top_candidates

    model_dir = lm_dirs("qwen2")
    model, passes = decoding_passes(model_dir, [3, 9, 14])
    outs = run_batch(passes)
    subject = ModelSubject.from_path(model_dir)
    store = BlockStore(model_dir, subject, config_draft(subject, wanted={"stacks"})["stacks"], None)
    node = SimpleNamespace(store=store, tail_dtype=torch.float32)  # what a tail reads of its session
    tail = Tail("model.norm", (0, 1), 8)
    for p in passes:
        p.part = LayerPass(kind="DynamicCache", tail=tail)
    joint_tails([(node, p) for p in passes], outs)
    for p, out in zip(passes, outs):
        alone = run_tail(node, out, tail)
        with torch.no_grad():
            plain = top_candidates(model.lm_head(model.model.norm(out)), 8)  # the model's own modules
        assert p.tail_answer is not None
        for got in (alone, {"ids": plain[0], "values": plain[1]}):
            assert torch.equal(p.tail_answer["ids"], got["ids"])
            assert torch.equal(p.tail_answer["values"].view(torch.int32), got["values"].view(torch.int32))
    # a head with a bias and a vocabulary whose last tile is short, its best logits in that tile
    from diffuse.lm.node_tail import joint_head

    head = torch.nn.Linear(96, 1000)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        head.weight.copy_(torch.randn(1000, 96, generator=g) * 0.1)
        head.bias.copy_(torch.randn(1000, generator=g))
        head.weight[990:] *= 5
    rows = [torch.randn(1, 1, 96, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    joint = joint_head(head)
    with torch.no_grad():
        assert joint.agrees(head, rows[0])
        for (ids, values), row in zip(joint.top(rows, 8), rows):
            alone = top_candidates(head(row), 8)
            assert torch.equal(ids, alone[0]) and torch.equal(values.view(torch.int32), alone[1].view(torch.int32))
            assert ids.max() >= 990
    # ties across the k-th value, infinities, signed zeros: as a stable descending sort, value bits included
    rows = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 0.0, -0.0, float("inf")],
                         [0.0, -0.0, 0.0, -0.0, float("-inf"), 5.0, 5.0, 5.0],
                         [7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    for k in (1, 2, 3, 4, 7):
        values, ids = torch.sort(rows, dim=-1, descending=True, stable=True)
        got_ids, got_values = top_candidates(rows, k)
        assert torch.equal(got_ids, ids[:, :k])
        assert torch.equal(got_values.view(torch.int32), values[:, :k].view(torch.int32))
