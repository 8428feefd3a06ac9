"""A pipeline's text encoders on the ring (``--encoders ring``): their layers split over the nodes like the
denoiser's blocks, the prompt embeddings byte-identical to plain diffusers'.

Encoders of four shapes: Wan's UMT5 (every layer its own position bias), Flux's CLIP text model and
T5 encoder (T5's block 0 makes the position biases every later block reads: a side output threaded from
the node that holds block 0), Sana's Gemma 2 (a language model read as an encoder: a cache made for the
call, a mask per attention kind), Qwen-Image's Qwen2.5-VL (its vision tower's stack on the nodes too,
never called for a prompt; its language model's last hidden state read as the model records it), SD3's two
CLIP text models (read at an inner layer: its output brought back beside the last) and T5. Each family's three
nodes serve 1, 2 and 3 node rings in turn; the
reference is each pipeline's own ``encode_prompt`` run whole by plain diffusers in a subprocess
(tests/encode_reference.py), at the same thread count.
"""

from __future__ import annotations

import concurrent.futures
import json
import os

import families
import numpy as np
import pytest

from conftest import THREADS, Reference, reference_jobs, run_split

ENCODE = {  # each pipeline's encode_prompt arguments: a prompt and a negative one where it takes them
    "wan": {"prompt": "dance monkey", "negative_prompt": "bad quality , blurry", "max_sequence_length": 16},
    "flux": {"prompt": "a painting of a squirrel eating a burger", "prompt_2": None, "max_sequence_length": 48},
    "sana": {"prompt": "a squirrel", "negative_prompt": "blurry", "max_sequence_length": 20},
    "qwenimage": {"prompt": "a squirrel", "max_sequence_length": 20},
    # its CLIP encoders are read at their next-to-last layer: the nodes send that layer's output back too
    "sd3": {"prompt": "a squirrel", "prompt_2": None, "prompt_3": None, "negative_prompt": "blurry",
            "max_sequence_length": 16},
}
RINGS = (1, 2, 3)


@pytest.fixture(scope="module")
def encoded(models, tmp_path_factory, diffuse_home):
    """{family: (the reference's arrays, {nodes: the split's arrays}, what the split learned)}: the references
    computed in one subprocess while each family's split side runs here over its own three local nodes."""
    root = tmp_path_factory.mktemp("encoders")
    paths = {f: models(f) for f in ENCODE}
    jobs = [{"model": paths[f], "kwargs": ENCODE[f], "out": str(root / f)} for f in ENCODE]
    jobs.append({"model": paths["wan"], "kwargs": ENCODE["wan"], "out": str(root / "wan-bf16"), "dtype": "bfloat16"})
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        references = pool.submit(reference_jobs, "encode_reference.py", jobs, str(root))
        split = {f: _split_side(paths[f], ENCODE[f], bf16=f == "wan") for f in ENCODE}
        results = references.result()
    out = {}
    for family, result in zip([*ENCODE, "wan-bf16"], results):
        assert "error" not in result, result.get("error")
        out[family] = [np.load(p) for p in result["arrays"]]
    return {f: (out[f], *split[f]) for f in ENCODE} | {"wan-bf16": (out["wan-bf16"], split["wan"][1]["bf16"], {})}


def _split_side(model: str, kwargs: dict, bf16: bool = False):
    """The split's arrays at each ring size, and what it said of itself (``bf16``: also its arrays loaded in
    bfloat16, at two nodes, under "bf16")."""
    import torch

    import diffuse
    from diffuse.local.nodes import start_local_nodes

    nodes = start_local_nodes(model, max(RINGS), THREADS, extra=["--encoders", "ring"], fixed=False)
    try:
        pipe = diffuse.from_pretrained(model, encoders="ring")
        arrays, seen = {}, {}
        for n in RINGS:
            with diffuse.split(pipe, nodes=[f"{x.address}#{x.key}" for x in nodes[:n]], timeout=60) as ring:
                before = ring.splitter.encoders.passes  # the splitter outlives a ring: what it counted before
                with torch.no_grad():
                    found = pipe.encode_prompt(**kwargs)
                arrays[n] = [t.numpy() for t in found if isinstance(t, torch.Tensor)]
                splitter = ring.splitter
                seen[n] = {"passes": splitter.encoders.passes - before, "encoders": sorted(splitter.encoders.paths),
                           "held": sum(p.numel() for path in splitter.encoders.paths  # of the encoders' layers
                                       for p in splitter.originals[path].parameters() if p.device.type != "meta")}
        if bf16:  # the same nodes compute in the dtype each session asks
            pipe = diffuse.from_pretrained(model, dtype="bfloat16", encoders="ring")
            with diffuse.split(pipe, nodes=[f"{x.address}#{x.key}" for x in nodes[:2]], timeout=60):
                with torch.no_grad():
                    found = pipe.encode_prompt(**kwargs)
            seen["bf16"] = {2: [t.float().numpy() for t in found if isinstance(t, torch.Tensor)]}
        return arrays, seen
    finally:
        nodes.stop()


@pytest.mark.parametrize("family", [*ENCODE, "wan-bf16"])
def test_prompt_embeddings_are_byte_identical_to_plain_diffusers_at_one_two_and_three_nodes(family, encoded):
    """In float32 at 1, 2 and 3 nodes; Wan's also loaded in bfloat16 (its transformer keeps modules in float32,
    which must not make the ring compute in float32), at 2 nodes."""
    reference, split, _ = encoded[family]
    assert reference and all(r.size for r in reference)
    for n in split:
        assert len(split[n]) == len(reference), n
        for got, want in zip(split[n], reference):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert got.tobytes() == want.tobytes(), f"{family} at {n} nodes: max abs diff {np.abs(got - want).max()}"


def test_each_encoder_stack_is_called_through_the_ring_and_the_client_holds_none_of_its_layers(encoded):
    _, _, seen = encoded["flux"]
    for n in RINGS:
        assert seen[n]["encoders"] == ["text_encoder.encoder.layers", "text_encoder_2.encoder.block"]
        assert seen[n]["passes"] == 2  # CLIP's pooled prompt, T5's sequence: one pass each
        assert seen[n]["held"] == 0
    _, _, seen = encoded["wan"]
    assert [seen[n]["passes"] for n in RINGS] == [2, 2, 2]  # the prompt and the negative prompt


def test_the_tokenizer_embedding_and_final_norm_stay_on_the_client(models):
    import diffuse

    pipe = diffuse.from_pretrained(models("flux"), encoders="ring")
    t5 = pipe.text_encoder_2
    assert t5.shared.weight.device.type == "cpu" and t5.encoder.final_layer_norm.weight.device.type == "cpu"
    # no block is loaded, the first included (it learns what the stack returns weightless, or with zero weights)
    assert all(p.device.type == "meta" for b in t5.encoder.block for p in b.parameters())
    assert pipe.tokenizer_2 is not None


def test_a_run_with_its_encoders_on_the_ring_is_byte_identical_to_plain_diffusers(models, tmp_path, diffuse_home):
    """HunyuanVideo through ``diffuse query``: a Llama read for its hidden states (a cache made for the call, the
    states recorded; the weightless dry call before the run has put the recorder's hooks on the layers, the
    first of which runs here once: it must record nothing; the state it reads is an inner layer's, the first of
    three, brought back from the node that holds it) and CLIP's pooled output, then a denoiser whose blocks carry
    two streams."""
    model = models("hunyuan_video")
    kwargs = families.call_args("hunyuan_video")
    reference = Reference(model, kwargs, str(tmp_path / "reference.npy"))
    split, report = run_split(model, kwargs, tmp_path, nodes=2, home=diffuse_home, extra=["--encoders", "ring"])
    reference = reference.result()
    assert split.tobytes() == reference.tobytes(), f"max abs diff {abs(split - reference).max()}"
    assert report["per_stack"]["text_encoder.layers"]["calls"] == 2  # the prompt, the negative prompt
    assert report["per_stack"]["text_encoder_2.encoder.layers"]["calls"] == 2
    assert report["client_block_params"] == 0


def test_the_service_keeps_a_pipelines_encoders_on_its_nodes_and_answers_as_plain_diffusers(models, tmp_path,
                                                                                             diffuse_home):
    """``diffuse serve --encoders ring``: its local nodes are started with their slices of the encoders too, and
    a request's picture is the one plain diffusers makes whole."""
    from conftest import hello_report
    from diffuse.serve.command import ServeOptions, Service
    from diffuse.serve.engines import Cancel
    from diffuse.serve.pipeline import Ask

    model = models("flux")
    kwargs = {"prompt": "a red cat", "height": 16, "width": 16, "num_inference_steps": 2}
    reference = Reference(model, kwargs, str(tmp_path / "reference.npy"), seed=3)
    service = Service.start([model], [], ServeOptions(local_nodes=2, threads=THREADS, encoders="ring"), lambda _: None)
    try:
        (engine,) = service.engines.values()
        picture = engine.run(Ask("a red cat", height=16, width=16, steps=2, seed=3), Cancel())
        held = {(stack, i) for n in engine.nodes.local for stack, i, _ in hello_report(n.address).holds}
    finally:
        service.stop()
    assert picture.array.tobytes() == reference.result().tobytes()
    assert {("text_encoder_2.encoder.block", 0), ("text_encoder_2.encoder.block", 1)} <= held


def test_recorded_hidden_states_come_back_from_the_nodes_as_a_whole_run_records_them(models, diffuse_home):
    """A model asked for every layer's hidden state (``output_hidden_states``: Qwen-Image reads the last, SD3's
    CLIP and HunyuanVideo's Llama an inner one) gets each of them as a whole run records them: the pass asks the
    nodes for the inner layers' too, or only for those transformers was told to keep (an index). A node older
    than wire version 4 cannot send them: such a call is refused in one line naming it, and one that reads
    only the last layer still runs there."""
    import diffusers
    import torch

    import diffuse
    from diffuse.errors import DiffuseError
    from diffuse.local.nodes import start_local_nodes

    model = models("wan")
    plain = diffusers.DiffusionPipeline.from_pretrained(model).text_encoder
    pipe = diffuse.from_pretrained(model, encoders="ring")
    # its token table (UMT5-XXL's: 2 GiB) is the file's bytes, mapped: a prompt makes its rows' pages resident
    table = pipe.text_encoder.get_input_embeddings().weight
    assert "/text_encoder/" in _mapped_file(table.data_ptr())
    assert torch.equal(table, plain.get_input_embeddings().weight)
    ids = pipe.tokenizer(["dance monkey"], return_tensors="pt").input_ids
    with torch.no_grad():
        want = plain(ids, output_hidden_states=True).hidden_states
        want_one = plain(ids, output_hidden_states=[1]).hidden_states
        with diffuse.split(pipe, local_nodes=2, threads=THREADS, timeout=60):
            got = pipe.text_encoder(ids, output_hidden_states=True).hidden_states
            got_one = pipe.text_encoder(ids, output_hidden_states=[1]).hidden_states
    assert len(got) == len(want) == 3  # the input, then each of the two layers' outputs (one on each node)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert [x is None for x in got_one] == [x is None for x in want_one] == [True, False, True]
    assert torch.equal(got_one[1], want_one[1])
    old = start_local_nodes(model, 1, THREADS, extra=["--encoders", "ring", "--wire", "3"], fixed=False)
    try:
        with diffuse.split(pipe, nodes=[f"{old[0].address}#{old[0].key}"], timeout=60), torch.no_grad():
            with pytest.raises(DiffuseError, match=rf"node {old[0].address} \(3\) cannot send back .*"
                                                   r"--encoders client"):
                pipe.text_encoder(ids, output_hidden_states=True)
            assert torch.equal(pipe.text_encoder(ids).last_hidden_state, plain(ids).last_hidden_state)
    finally:
        old.stop()


def _mapped_file(address: int) -> str:
    """The file whose mapping holds ``address`` in this process ("" for memory of no file)."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5].strip() if len(fields) > 5 else ""
    return ""


def test_a_node_serving_the_pipeline_without_its_encoders_is_refused_saying_so(models, diffuse_home):
    import diffuse
    from diffuse.errors import DiffuseError
    from diffuse.local.nodes import start_local_nodes

    model = models("wan")
    nodes = start_local_nodes(model, 1, THREADS, fixed=False)  # started without --encoders ring
    try:
        pipe = diffuse.from_pretrained(model, encoders="ring")
        with pytest.raises(DiffuseError, match="the same --encoders"):
            with diffuse.split(pipe, nodes=[f"{nodes[0].address}#{nodes[0].key}"], timeout=30):
                pass
    finally:
        nodes.stop()


def test_the_client_memory_puts_the_encoders_where_the_client_fits_and_refuses_a_budget_nothing_meets(models):
    """``--client-memory``: the encoders stay on the client while it fits them, go to the ring where only that
    fits, and a budget neither meets is one line and exit 2, naming what the smallest client needs."""
    from conftest import run_client
    from diffuse.plan.budget import fit_encoders

    model = models("flux")
    here, with_them = fit_encoders(model, 1 << 30, None, None)
    ring, without = fit_encoders(model, with_them - 1, None, None)
    assert (here, ring) == (False, True) and without < with_them
    with pytest.raises(Exception, match="needs"):
        fit_encoders(model, with_them - 1, False, None)  # --encoders client forced: only checked
    run = run_client(["--model", model, "--prompt", "a cat", "--client-memory", f"{(without - 1) / (1 << 20)}MiB",
                      "--local-nodes", "1", "--quiet"])
    assert run.returncode == 2
    last = run.stderr.strip().splitlines()[-1]
    assert "the smallest client needs" in last and "--encoders ring" in last, last


def test_a_client_of_a_hub_model_with_its_encoders_on_the_ring_fetches_none_of_their_layers(tmp_path):
    """``--encoders ring`` with a Hub id: the client fetches the encoder's ends, never a layer the nodes hold,
    the first included (what the stack returns is learned without its weights; without the flag: the encoder
    whole, tests/test_fetch.py)."""
    import subprocess
    import sys

    from hubtest import REPO, hub_env, ranges_of, tensor_spans
    from diffuse.bench.hubserver import HubServer
    from diffuse.plan.shipped import shipped_models

    encoder = "text_encoder/model.safetensors"
    with HubServer() as hub:
        hub.source = shipped_models()["tiny-wan-shapes"]
        hub.publish(REPO, hub.source)
        code = f"from diffuse.plan.resolve import resolve_model; resolve_model({REPO!r}, 'client-ring')"
        done = subprocess.run([sys.executable, "-c", code], env=hub_env(hub, "client-ring", tmp_path),
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
    _, spans = tensor_spans(f"{hub.source}/{encoder}")
    layers = [span for key, span in spans.items() if key.startswith("encoder.block.")]
    fetched = ranges_of(hub, "client-ring", encoder)
    assert fetched and layers and not any(a < e and s < b for a, b in fetched for s, e in layers)  # no layer's byte
    assert any(a <= s and e <= b for a, b in fetched for s, e in [spans["shared.weight"]])  # the embedding


def test_placement_counts_an_encoders_layers_in_memory_but_not_in_every_pass(models):
    """An encoder's layers run once a request: the planner gives them room on the nodes, not time in each pass,
    so the denoiser's blocks are shared out as if they were not there."""
    from diffuse.plan.needs import block_costs
    from diffuse.plan.placement import Capacity
    from diffuse.plan.planner import analyze
    from diffuse.plan.solver import place

    nodes = [Capacity(f"node{i}", 1 << 30, 1.0) for i in range(2)]
    placed = {}
    for ring in (False, True):
        subject, draft = analyze(models("flux"), ring)
        blocks = block_costs(subject, draft["stacks"], "float32")
        assert all(b.once == b.stack.startswith("text_encoder") for b in blocks)
        assert sum(b.weight_bytes for b in blocks if b.once) > 0 if ring else not any(b.once for b in blocks)
        placed[ring] = place(blocks, nodes)
    assert placed[True].slowest_s == pytest.approx(placed[False].slowest_s)


def test_the_plan_names_the_encoder_stacks_and_gives_each_node_a_slice(models):
    from diffuse.plan.planner import analyze, make_plan

    subject, draft = analyze(models("flux"), encoders=True)
    assert subject.encoders == ("text_encoder", "text_encoder_2")
    assert [(s.path, s.length, s.config_key) for s in draft["stacks"]] == [
        ("transformer.transformer_blocks", 3, "transformer.num_layers"),
        ("transformer.single_transformer_blocks", 3, "transformer.num_single_layers"),
        ("text_encoder.encoder.layers", 2, "text_encoder.num_hidden_layers"),
        ("text_encoder_2.encoder.block", 2, "text_encoder_2.num_layers")]
    plan = make_plan(subject, draft, ["a", "b"])
    assert [str(sl) for sl in plan.route[0].slices if sl.stack.startswith("text_encoder")] == [
        "text_encoder.encoder.layers[0:1]", "text_encoder_2.encoder.block[0:1]"]
    assert analyze(models("flux"))[1]["stacks"][0].path == "transformer_blocks"  # the default: encoders on the client
    assert os.path.isdir(subject.path)


def test_diffuse_plan_lists_every_part_with_its_size_and_where_it_runs(models):
    import re

    from conftest import run_cli

    said = {}
    for where in ("client", "ring"):
        run = run_cli(["plan", models("flux"), "--memory", "1,1", "--encoders", where])
        assert run.returncode == 0, run.stderr[-2000:]
        rows = [re.match(r"  (\S+)\s+(\S+)\s+(client \+ nodes|client|nodes)\s+(.*)$", line)
                for line in run.stdout.splitlines()]
        said[where] = {m[1]: (m[3], m[4]) for m in rows if m}
    assert {k: v[0] for k, v in said["client"].items()} == {
        "scheduler": "client", "text_encoder": "client", "text_encoder_2": "client", "tokenizer": "client",
        "tokenizer_2": "client", "transformer": "client + nodes", "vae": "client"}
    assert {k: v[0] for k, v in said["ring"].items()} == dict(
        {k: v[0] for k, v in said["client"].items()}, text_encoder="client + nodes", text_encoder_2="client + nodes")
    assert said["ring"]["text_encoder_2"][1].endswith("(text_encoder_2.encoder.block)")
    assert said["client"]["scheduler"][1] == "(no weights)"


def test_quantized_encoder_layers_on_the_ring_equal_plain_diffusers_loading_them_with_the_same_torchao_config(
        models, tmp_path, diffuse_home):
    """``--encoders ring --quantize int8``: the nodes hold the text encoder's layers quantized as they hold the
    denoiser's, and the run is byte-identical to plain diffusers loading the transformer and the text encoder
    (through transformers' own ``TorchAoConfig``) with their layers quantized, whole, in a subprocess; not to
    the run with the denoiser's blocks alone quantized."""
    from test_quant import finished, reference

    model, kwargs = models("wan"), families.call_args("wan")
    both, blocks = (reference("int8", model, str(tmp_path / f"{name}.npy"), family="wan", kwargs=json.dumps(kwargs),
                              seed=0, component=component, only=["encoder.block"])
                    for name, component in (("both", ["transformer", "text_encoder"]), ("blocks", ["transformer"])))
    split, _ = run_split(model, kwargs, tmp_path, nodes=2, home=diffuse_home,
                         extra=["--encoders", "ring", "--quantize", "int8"])
    finished(both), finished(blocks)
    assert split.tobytes() == np.load(tmp_path / "both.npy").tobytes()
    assert split.tobytes() != np.load(tmp_path / "blocks.npy").tobytes()
