"""Language models through the ring, against plain transformers run whole in a subprocess.

Each tiny model (tests/lm_models.py) is saved to disk; the reference is
tests/lm_reference.py, which imports transformers alone. A split run goes
through ``python -m diffuse.run`` with real node processes on loopback: the
tokens it saves must be the tokens ``generate`` returns whole, and the top
candidates' raw logits of every step must be the same bits, at the same thread
count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import THREADS, reference_jobs, run_client, subprocess_env

PROMPT = "Tell me a story about the moon."


class LMModels:
    def __init__(self, root):
        self.root, self.dirs = root, {}

    def __call__(self, name: str) -> str:
        if name not in self.dirs:
            import lm_models

            self.dirs[name] = lm_models.build(name, str(self.root / name))
        return self.dirs[name]


@pytest.fixture(scope="session")
def lm_models(tmp_path_factory) -> LMModels:
    return LMModels(tmp_path_factory.mktemp("lm-models"))


# every reference the tests compare with, computed in one interpreter (tests/lm_reference.py --jobs), each
# model loaded afresh: (name, max new tokens, sampling, with the image)
# sampling: the first four keys are the flags of the same name, the rest go to generate as they are (--arg)
SAMPLINGS = {"temperature_top_p": {"seed": 3, "temperature": 0.9, "top_p": 0.95},
             "top_k": {"seed": 5, "top_k": 4, "repetition_penalty": 1.3}}
SAMPLING_FLAGS = ("seed", "temperature", "top_p", "top_k")
REFERENCE_JOBS = [("qwen2", 6, None, False), ("hybrid", 6, None, False), ("smolvlm", 6, None, True),
                  ("qwen2_vl", 6, None, True), ("qwen2", 8, None, False),
                  *(("qwen2", 8, sample, False) for sample in SAMPLINGS.values())]


@pytest.fixture(scope="session")
def lm_references(lm_models, image_file, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lm-references")
    jobs = [dict(model=lm_models(name), prompt=PROMPT, max_new_tokens=new, images=[image_file] if image else [],
                 do_sample=bool(sample), **{k: v for k, v in (sample or {}).items() if k in SAMPLING_FLAGS},
                 generate_args={k: v for k, v in (sample or {}).items() if k not in SAMPLING_FLAGS})
            for name, new, sample, image in REFERENCE_JOBS]
    results = reference_jobs("lm_reference.py", jobs, root)
    return {(job["model"], job["max_new_tokens"], json.dumps(sample, sort_keys=True), bool(job["images"])): result
            for job, (_, _, sample, _), result in zip(jobs, REFERENCE_JOBS, results)}


def reference(refs: dict, model: str, max_new: int = 6, sample: dict | None = None, image: bool = False) -> dict:
    return refs[(model, max_new, json.dumps(sample, sort_keys=True), image)]


def split_run(model: str, tmp_path, home: str, nodes: int = 2, max_new: int = 6, extra=(), images=()):
    """``python -m diffuse.run`` on a language model through ``nodes`` local node processes (its client in this
    process, see conftest.run_client): the saved tokens, the report, and what it printed."""
    tokens, report = tmp_path / "tokens.json", tmp_path / "report.json"
    argv = ["--model", model, "--prompt", PROMPT, "--max-new-tokens", str(max_new), "--threads", str(THREADS),
            "--local-nodes", str(nodes), "--save-tokens", str(tokens), "--report", str(report), "--quiet",
            "--timeout", "120", *extra]
    for image in images:
        argv += ["--image", image]
    run = run_client(argv, home)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(tokens) as f, open(report) as g:
        return json.load(f), json.load(g), run


@pytest.mark.parametrize("nodes", [2, 3])
@pytest.mark.parametrize("name", ["qwen2", "hybrid"])
def test_split_greedy_tokens_and_logits_equal_transformers(name, nodes, lm_models, lm_references, tmp_path,
                                                           diffuse_home):
    model = lm_models(name)
    ref = reference(lm_references, model)
    on_node = nodes == 3  # the embedding table on the first node (opt-in) at three nodes, on the client at two
    tokens, report, proc = split_run(model, tmp_path, diffuse_home, nodes,
                                     extra=["--embedding-on-node"] if on_node else [])
    assert tokens["input_ids"] == ref["input_ids"]
    assert tokens["new_tokens"] == ref["new_tokens"]
    assert report["top"] == ref["top"]  # ids and the exact float32 bits of each step's best 8 logits
    # what was said is what was generated, streamed to stdout
    assert proc.stdout.strip() == report["text"].strip() and report["new_tokens"] == len(ref["new_tokens"][0])
    # the client handed every decoder layer out; each node holds the cache of its own layers only
    assert report["client_layer_params"] == 0
    assert [len(n["hop_bytes"]) for n in report["node_stats"]] == [report["calls"]] * nodes
    # the last node ran the final norm and the head on every pass and sent home only the best candidates
    assert report["tail_passes"] == report["calls"] and report["last_hop_bytes_per_token"] <= 1024
    if on_node:  # the first node embedded the token ids of every pass: the client holds none of the table, nor
        # of the head tied to it (each counted on the model's own modules, which are on meta)
        assert report["embedding"] == "first node" and report["embed_passes"] == report["calls"]
        assert report["client_embedding_params"] == 0 and report["client_head_params"] == 0
        hops = [n["bytes_in"] for n in report["node_stats"]]
        assert hops[0] < hops[1]  # ids on the first hop, hidden states (8 bytes a position against 128) after it
    else:  # the client embeds: every pass carries hidden states, never token ids
        assert report["embedding"] == "client" and "--embedding-on-node" in report["embedding_kept_because"]
    if name == "qwen2":  # full attention everywhere: every position seen stays in the cache of its layer's node
        check_cache_bytes(model, report)


def check_cache_bytes(model: str, report: dict) -> None:
    """Keys and values of every position seen, on the node holding the layer: 2 x kv heads x positions x head
    dim floats per layer (the last token generated is never fed back), each node for its own layers only."""
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    positions = report["prompt_tokens"] + report["new_tokens"] - 1
    per_layer = 2 * cfg["num_key_value_heads"] * positions * (cfg["hidden_size"] // cfg["num_attention_heads"]) * 4
    held = [n["cache_bytes"] for n in report["node_stats"]]
    assert sum(held) == cfg["num_hidden_layers"] * per_layer
    assert all(b > 0 and b % per_layer == 0 for b in held)


@pytest.fixture(scope="session")
def image_file(tmp_path_factory) -> str:
    import numpy as np
    from PIL import Image

    path = tmp_path_factory.mktemp("media") / "picture.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (80, 100, 3), dtype=np.uint8)).save(path)
    return str(path)


@pytest.mark.parametrize("nodes", [2, 3])
@pytest.mark.parametrize("name", ["smolvlm", "qwen2_vl"])
def test_split_vision_language_model_with_an_image_equals_transformers(name, nodes, lm_models, lm_references,
                                                                        image_file, tmp_path, diffuse_home):
    """The image is read and encoded here (the vision tower stays on the client); only the decoder's
    hidden states travel. Their processors do not build without torchvision: the reference builds the
    inputs by hand, the client through the model's own processor class, and the ids must agree."""
    model = lm_models(name)
    ref = reference(lm_references, model, image=True)
    on_node = nodes == 3  # asked to put the embedding table on the first node at three nodes
    tokens, report, proc = split_run(model, tmp_path, diffuse_home, nodes, images=(image_file,),
                                     extra=["--embedding-on-node"] if on_node else [])
    assert tokens["input_ids"] == ref["input_ids"]
    assert tokens["new_tokens"] == ref["new_tokens"]
    assert report["top"] == ref["top"]
    assert report["client_layer_params"] == 0
    assert report["tail_passes"] == report["calls"] and report["last_hop_bytes_per_token"] <= 1024
    if name == "smolvlm":  # its head has weights of its own (not tied to the embedding): none of them stay here
        assert report["client_head_params"] == 0
    # the image's features are merged into the token embeddings here: asked or not, the table stays, and the
    # report says why
    assert report["embedding"] == "client"
    assert ("pixel_values" if on_node else "--embedding-on-node") in report["embedding_kept_because"]
    assert "without its video processor" in proc.stderr  # said in one line, as it was built


def test_seeded_sampling_draws_on_the_last_node_and_equals_transformers(lm_models, lm_references, tmp_path,
                                                                        diffuse_home):
    """The last node applies generate's own processors (the generation config's default top_k of 50 included) and
    draws in the client's generator state: the tokens are the ones generate draws whole after torch.manual_seed,
    and only the drawn token and the best 8 raw logits come home, never a row of the vocabulary. (Top-k with a
    repetition penalty, which reads the token history: the Python API test.)"""
    model = lm_models("qwen2")
    sample = SAMPLINGS["temperature_top_p"]
    ref = reference(lm_references, model, max_new=8, sample=sample)
    flags = [f for k, v in sample.items() for f in
             ((f"--{k.replace('_', '-')}", str(v)) if k in SAMPLING_FLAGS else ("--arg", f"{k}={v}"))]
    tokens, report, _ = split_run(model, tmp_path, diffuse_home, 2, max_new=8, extra=flags)
    assert tokens["new_tokens"] == ref["new_tokens"]
    assert report["top"] == ref["top"]  # the raw logits of every step, the same bits
    greedy = reference(lm_references, model, max_new=8)
    assert ref["new_tokens"] != greedy["new_tokens"]  # the draw mattered: sampling is not greedy in disguise
    # every token was drawn on the last node, after the processors generate built (with the generation config's
    # default top_k of 50); the client's generator state crossed once, then both stayed in step
    steps = [("TemperatureLogitsWarper", {"temperature": 0.9}), ("TopKLogitsWarper", {"top_k": 50}),
             ("TopPLogitsWarper", {"top_p": 0.95})]
    described = report["sampling"].pop("processors")
    assert [(name, {k: params[k] for k in expected}) for (name, params), (_, expected)
            in zip(described, steps, strict=True)] == steps
    assert report["sampling"] == {"draws": 8, "generator_states_sent": 1}
    assert report["tail_passes"] == report["calls"]
    # the last hop: no answer as large as a row of float32 logits, at most 1 KiB a token
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    assert vocab * 4 > 1024 and report["last_hop_max_bytes"] <= 1024 and report["last_hop_bytes_per_token"] <= 1024


def test_sampling_processors_travel_as_data_and_a_node_rebuilds_them_as_transformers_built_them():
    """Each processor of the closed list, described, through CBOR, rebuilt: the same scores as the original on the
    same history; anything else (a name outside the list, code, a wrong parameter) is refused with a reason."""
    import cbor2
    import torch
    from transformers.generation import logits_process as lp

    import diffuse
    from diffuse.lm.node_sampling import NodeSampler
    from diffuse.lm.sampling import PROCESSORS, describe, rebuild

    built = [lp.TemperatureLogitsWarper(0.7), lp.TopKLogitsWarper(5), lp.TopPLogitsWarper(0.9), lp.MinPLogitsWarper(0.1),
             lp.TypicalLogitsWarper(0.8), lp.EpsilonLogitsWarper(3e-4), lp.EtaLogitsWarper(3e-4),
             lp.RepetitionPenaltyLogitsProcessor(1.3), lp.RepetitionPenaltyLogitsProcessor(1.3, torch.tensor([2, 0])),
             lp.NoRepeatNGramLogitsProcessor(2), lp.MinLengthLogitsProcessor(30, torch.tensor([3])),
             lp.MinNewTokensLengthLogitsProcessor(5, 10, [3, 4]), lp.SuppressTokensLogitsProcessor([1, 2]),
             lp.SuppressTokensAtBeginLogitsProcessor([5], 19), lp.ForcedBOSTokenLogitsProcessor(1),
             lp.ForcedEOSTokenLogitsProcessor(20, 3), lp.InfNanRemoveLogitsProcessor(),
             lp.ClassifierFreeGuidanceLogitsProcessor(3.0)]
    assert sorted({type(p).__name__ for p in built}) == sorted(PROCESSORS)
    rebuilt = rebuild(cbor2.loads(cbor2.dumps(describe(built))))
    g = torch.Generator().manual_seed(0)
    history = torch.randint(0, 50, (2, 19), generator=g)
    history[:, -3:] = history[:, 5:8]  # an n-gram seen before
    for original, copy in zip(built, rebuilt, strict=True):
        # guidance reads twice the rows of the history (conditional half, then unconditional)
        scores = torch.randn(4 if isinstance(original, lp.ClassifierFreeGuidanceLogitsProcessor) else 2, 50, generator=g)
        assert type(copy) is type(original) and torch.equal(copy(history, scores.clone()), original(history, scores))
    with pytest.raises(diffuse.DiffuseError, match="cannot be rebuilt on the last node"):
        describe([lp.WatermarkLogitsProcessor(50, "cpu")])
    for bad in ([["os.system", {}]], [["TopKLogitsWarper", {"top_k": 5}]],
                [["TopKLogitsWarper", {"top_k": "5", "filter_value": 0.0, "min_tokens_to_keep": 1}]], "x"):
        with pytest.raises(diffuse.DiffuseError):
            rebuild(bad)
    sampler = NodeSampler()
    for spec in ({"sample": True}, {"sample": True, "processors": [], "history": {"keep": 3, "add": [[1]]}},
                 {"sample": True, "processors": [], "history": {"keep": 0, "add": [[1]]}, "rng": b"short"}):
        with pytest.raises(diffuse.DiffuseError):
            sampler.draw(spec, torch.zeros(1, 50))


def test_the_client_refuses_a_draw_the_model_changed_after_its_head():
    """Logits the model changes after the output head (a soft cap) would be drawn from another distribution on the
    last node: generate's processor step refuses them rather than take the token."""
    import torch

    import diffuse
    from diffuse.lm.sampling import Draw, DrawnToken, NodeTail

    draw = Draw([], sample=True)
    draw.ids = torch.tensor([[4, 5, 6]])
    draw.wire(NodeTail(None))
    row = torch.full((1, 10), float("-inf"))
    row[0, 2], row[0, 7] = 1.5, 0.5
    draw.took({"drawn": torch.tensor([7]), "rng": "00"}, NodeTail(None), row)
    forced = DrawnToken(draw)(torch.tensor([[4, 5, 6]]), row.clone())
    assert forced[0, 7] == 0 and torch.isinf(forced).sum() == 9  # only the drawn token can be picked
    draw.took({"drawn": torch.tensor([7]), "rng": "00"}, NodeTail(None), row)
    with pytest.raises(diffuse.DiffuseError, match="changes its logits after the output head"):
        DrawnToken(draw)(torch.tensor([[4, 5, 6]]), 30 * torch.tanh(row / 30))


def test_language_model_flags_are_checked_before_anything_starts(lm_models, capsys, tmp_path, diffuse_home):
    from diffuse.cli.query import main

    model = lm_models("qwen2")
    cases = [
        (["--steps", "3"], "applies to diffusion pipelines"),
        (["--temperature", "0"], "must be above 0"),
        (["--arg", "num_beams=3"], "beam search"),
        (["--image", os.path.join(model, "config.json")], "image"),
    ]
    video = tmp_path / "clip.mp4"
    video.write_bytes(b"\x00\x00\x00\x18ftypisom\x00\x00\x02\x00isomiso2" + bytes(64))
    cases.append((["--model", lm_models("qwen2_vl"), "--video", str(video)], "torchvision"))
    for extra, expected in cases:
        assert main(["--model", model, "--prompt", "hi", "--quiet", *extra]) == 2, extra
        said = capsys.readouterr().err
        assert expected in said and "Traceback" not in said and "starting" not in said, (extra, said)


def test_a_three_turn_chat_keeps_one_session_and_sends_only_each_new_turn(lm_models, tmp_path, diffuse_home):
    model = lm_models("qwen2")
    report_file = tmp_path / "chat.json"
    cmd = [sys.executable, "-m", "diffuse.cli.command", "chat", "--model", model, "--max-new-tokens", "4", "--threads",
           str(THREADS), "--local-nodes", "2", "--report", str(report_file)]
    proc = subprocess.run(cmd, input="hello there\nwhat is the moon?\nthank you\n", env=subprocess_env(diffuse_home),
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(report_file) as f:
        report = json.load(f)
    turns = report["turns"]
    assert len(turns) == 3
    # only the rows the cache lacks travel: the new turn's tokens, then one per generated token, and the drafted
    # tokens the model did not take (prompt lookup drafts by default; their positions are cut from every cache)
    rejected = [t["drafted"] - t["accepted"] for t in turns]
    assert turns[0]["cached_before"] == 0
    assert turns[0]["rows_sent"] == turns[0]["input_tokens"] + turns[0]["new_tokens"] - 1 + rejected[0]
    for k, (before, turn) in enumerate(zip(turns, turns[1:]), 1):
        # the nodes still hold every position of the earlier turns but the last token generated
        assert turn["cached_before"] == before["input_tokens"] + before["new_tokens"] - 1
        assert turn["rows_sent"] == turn["input_tokens"] - turn["cached_before"] + turn["new_tokens"] - 1 + rejected[k]
        assert turn["input_tokens"] - turn["cached_before"] < turn["input_tokens"] // 2
    # one session per node saw every pass of the chat
    assert [n["messages"] for n in report["node_stats"]] == [report["passes"]] * 2
    assert all(t["answer"] in proc.stdout for t in turns)


def test_python_api_splits_a_transformers_model_samples_and_refuses_beam_search(lm_models, lm_references, tmp_path,
                                                                                diffuse_home):
    import torch

    import diffuse
    from diffuse.lm.client_media import build_inputs

    from transformers import LogitsProcessorList

    model_dir = lm_models("qwen2")
    ref = reference(lm_references, model_dir)
    sample = SAMPLINGS["top_k"]
    from diffuse.local.nodes import start_local_nodes
    from diffuse.wire.transport import transport_for

    def state(node):  # what the node says it holds for sessions now (its plain status answer)
        answer = transport_for(node.address).request(node.address, {"op": "status"}, 10.0)
        return answer["sessions"], answer["state_bytes"]

    inputs, _ = build_inputs(model_dir, PROMPT)
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    nodes = start_local_nodes(model_dir, 2, threads=THREADS)
    try:
        model = diffuse.from_pretrained(model_dir)
        # the embedding table on the first node (opt-in): the client then holds neither it nor the head tied to it
        with diffuse.split(model, nodes=[f"{n.address}#{n.key}" for n in nodes], embedding_on_node=True) as ring:
            out = model.generate(**inputs, max_new_tokens=6, do_sample=False)
            during = [state(n) for n in nodes]
            with pytest.raises(diffuse.DiffuseError, match="beam search"):
                model.generate(**inputs, max_new_tokens=3, num_beams=2, do_sample=False)
            # top-k under a repetition penalty (it reads the token history, which travels as it grows), seeded twice
            # in one session: the node's generator is set to the client's each time, so both equal the reference
            drawn, answers = [], len(ring.ring.channel_stats.returns)
            for _ in range(2):
                torch.manual_seed(sample["seed"])
                again = model.generate(**inputs, max_new_tokens=8, do_sample=True, top_k=sample["top_k"],
                                       repetition_penalty=sample["repetition_penalty"])
                draw = ring.splitter.last_draw
                drawn.append((again[:, inputs["input_ids"].shape[1]:].tolist(), draw.draws, draw.states_sent,
                              [name for name, _ in draw.described]))
            last_hop = [n for _, n in ring.ring.channel_stats.returns[answers:]]
            # a processor of the user's own is code: it cannot travel to the last node, so it is refused
            with pytest.raises(diffuse.DiffuseError, match="cannot be rebuilt on the last node"):
                model.generate(**inputs, max_new_tokens=2, do_sample=True,
                               logits_processor=LogitsProcessorList([lambda ids, scores: scores]))
        after = [state(n) for n in nodes]
    finally:
        torch.set_num_threads(threads)
        nodes.stop()
    # the session's caches grew on the nodes while it was open, and went with it at close
    assert all(sessions == 1 and held > 0 for sessions, held in during) and after == [(0, 0), (0, 0)]
    assert out[:, inputs["input_ids"].shape[1]:].tolist() == ref["new_tokens"]
    sampled = reference(lm_references, model_dir, max_new=8, sample=sample)["new_tokens"]
    assert sampled != reference(lm_references, model_dir, max_new=8)["new_tokens"]  # not greedy in disguise
    assert drawn == [(sampled, 8, 1, ["RepetitionPenaltyLogitsProcessor", "TopKLogitsWarper"])] * 2
    assert len(last_hop) == 16 and max(last_hop) <= 1024  # the drawn token home, never a row of the vocabulary
    assert ring.stats.passes >= 6
    held = [p for layers in ring.splitter.originals.values() for p in layers.parameters()]
    assert held and all(p.device.type == "meta" for p in held)  # the decoder layers were handed out and freed
    # so were the embedding table and the head tied to it: the first node embeds, the last one projects
    ends = [p for _, m in (ring.splitter.embed, ring.splitter.head) for p in m.parameters()]
    assert len(ends) == 2 and all(p.device.type == "meta" for p in ends)
    with pytest.raises(diffuse.DiffuseError, match="held by the first node"):
        model.get_input_embeddings()(inputs["input_ids"])


def test_check_finds_the_decoder_stack_and_its_depth_setting_from_config_alone(lm_models):
    """The decoder stack is found by what it does on a tiny probe (causal attention indexing a cache), its depth
    setting by nudging the nested text config; the vision tower, which the decoder never calls, is named and left
    on the client."""
    from diffuse.cli.check import check

    r = check(lm_models("qwen2_vl"))
    assert r["verdict"] == "splittable" and r["output_kind"] == "text"
    assert [(s["path"], s["length"], s["config_key"]) for s in r["stacks"]] == [
        ("model.language_model.layers", 4, "text_config.num_hidden_layers")]
    assert "decoder never calls" in r["other_lists"]["model.visual.blocks"]


def test_the_embedding_table_leaves_the_client_only_where_the_first_layer_takes_it_untouched():
    """Decided on the model's own forward, run twice on token ids with two different embedding outputs: the table
    goes to the first node only when its first decoder layer receives that output itself, unchanged, and the same
    other arguments both times. A model that scales it (Granite), one that derives an argument from its values, and
    one that takes media keep it; ids from a peer are checked before the lookup."""
    import torch
    import transformers
    from torch import nn

    import diffuse
    from diffuse.lm.embedding import embedding_path, embedding_stays
    from diffuse.lm.node_layers import checked_ids

    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1)
    torch.manual_seed(0)

    def decision(model):
        return embedding_stays(model, embedding_path(model), model.model.layers[0])

    assert decision(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**small)).eval()) is None
    # Gemma's scale sits inside its embedding module, which the first node runs as it is
    assert decision(transformers.GemmaForCausalLM(transformers.GemmaConfig(**small, head_dim=8)).eval()) is None
    granite = transformers.GraniteForCausalLM(transformers.GraniteConfig(**small, embedding_multiplier=12.0)).eval()
    assert "changes the token embeddings" in decision(granite)

    class Peeks(transformers.LlamaForCausalLM):  # hands its layers a gate read off the embeddings' values
        def forward(self, input_ids=None, attention_mask=None, **kwargs):
            x = self.model.embed_tokens(input_ids)
            gate = x.mean(-1)
            for layer in self.model.layers:
                x = layer(x, attention_mask=gate)
            return x

    assert "derives" in decision(Peeks(transformers.LlamaConfig(**small)).eval())

    class Listens(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, input_features=None, **kwargs):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    assert "input_features" in decision(Listens(transformers.LlamaConfig(**small)).eval())
    assert "no input embedding" in embedding_stays(nn.Linear(2, 2), None, nn.Linear(2, 2))
    assert torch.equal(checked_ids(torch.tensor([[1, 63]]), 64), torch.tensor([[1, 63]]))
    for bad, said in ((torch.tensor([[1, 64]]), "outside the embedding table"), (torch.tensor([[-1]]), "outside"),
                      (torch.ones(1, 2), "integer"), (torch.tensor([1, 2]), "2-D")):
        with pytest.raises(diffuse.DiffuseError, match=said):
            checked_ids(bad, 64)
    # what a pass says about its ids is checked on the node before any of it is used
    from diffuse.plan.contracts import ReturnMap
    from diffuse.node.stage import StageSession

    rmap = ReturnMap(single=True, outputs=[0], names=["args[0]"])
    assert StageSession._embed_spec({"slot": 0, "dtype": "bfloat16"}, rmap, 3) == (0, torch.bfloat16)
    for bad in ({"slot": 1, "dtype": "float32"}, {"slot": 5, "dtype": "float32"}, {"slot": 0, "dtype": "int64"},
                {"slot": 0, "dtype": "Tensor"}, {"slot": "0", "dtype": "float32"}, [0]):
        with pytest.raises(diffuse.DiffuseError):
            StageSession._embed_spec(bad, rmap, 3)


def test_a_folder_without_tokenizer_files_is_refused_naming_them(tmp_path):
    """transformers builds an empty tokenizer from a config alone, which makes no tokens of any prompt: the
    client says the folder lacks its tokenizer instead (``diffuse query`` then ends in that one line, exit 2,
    before any node starts)."""
    from transformers import Qwen2Config

    from diffuse.errors import DiffuseError
    from diffuse.lm.client_media import load_tokenizer

    Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=100).save_pretrained(tmp_path)
    with pytest.raises(DiffuseError, match=r"has no tokenizer files \(tokenizer\.json, tokenizer_config\.json"):
        load_tokenizer(str(tmp_path))
