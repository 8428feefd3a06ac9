"""Language-model architectures beyond the dense decoders, through the ring, against plain transformers.

Mixture-of-experts checkpoints keep one tensor per expert, which ``from_pretrained`` fuses into the layer's
expert parameters as it loads; a node loading only its layers must do the same, by transformers' own
conversion rules, so that the router's choices, made on the node holding the layer, are the ones made whole.
Each tiny model (tests/lm_models.py) runs split through local node processes, and its tokens and the exact bits
of every step's best raw logits are compared with tests/lm_reference.py run whole in a subprocess, at the
same thread count (test_lm.py's machinery). So are Falcon (layers that return a tuple, read between
layers), BLOOM (ALiBi, no ``is_causal``, attention weights returned beside the hidden state), OLMo (a client
left with no parameter at all) and Gemma 2 with a soft cap that saturates (greedy decoding from whole rows
of logits, not a shortlist), and T5 (block 0's position biases handed to every later block; a head fed the
final norm's output scaled). A checkpoint a node could not load as transformers loads it is refused before
any node starts, in one line.
"""

from __future__ import annotations

import json
import os

import pytest

from conftest import reference_jobs, run_client
from test_lm import PROMPT, LMModels, split_run

# (model, nodes): each architecture once, 2 and 3 nodes between them (a node start is the cost of a case)
MOE = [("mixtral", 2), ("qwen2_moe", 3), ("qwen3_moe", 2), ("deepseek_v3", 3)]
OTHERS = [("falcon", 3), ("olmo", 2), ("gemma2_capped", 2), ("bloom", 3)]
T5 = [("t5", 2), ("t5_untied", 3)]
SPLITS = MOE + OTHERS + T5
MAX_NEW = 6


@pytest.fixture(scope="module")
def arch_models(tmp_path_factory) -> LMModels:
    return LMModels(tmp_path_factory.mktemp("lm-arch-models"))


@pytest.fixture(scope="module")
def arch_references(arch_models, tmp_path_factory) -> dict:
    """Every model of SPLITS run whole by plain transformers, in one interpreter: {folder: result}."""
    root = tmp_path_factory.mktemp("lm-arch-references")
    names = sorted({name for name, _ in SPLITS})
    jobs = [dict(model=arch_models(name), prompt=PROMPT, max_new_tokens=MAX_NEW, images=[], do_sample=False,
                 generate_args={}) for name in names]
    return {job["model"]: result for job, result in zip(jobs, reference_jobs("lm_reference.py", jobs, root))}


def node_side_params(model_dir: str, embedding: bool) -> int:
    """Parameters of the decoder layers, the final norm and the head (what the nodes run), and the embedding
    table if ``embedding``, counted on the model class built weightless from its config."""
    import transformers
    from accelerate import init_empty_weights

    config = transformers.AutoConfig.from_pretrained(model_dir)
    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config)
    parts = (model.model.layers, model.model.norm, model.lm_head, *([model.model.embed_tokens] if embedding else []))
    return sum(p.numel() for part in parts for p in part.parameters())


@pytest.mark.parametrize("name,nodes", MOE)
def test_mixture_of_experts_split_equals_transformers(name, nodes, arch_models, arch_references, tmp_path,
                                                      diffuse_home):
    model = arch_models(name)
    ref = arch_references[model]
    tokens, report, _ = split_run(model, tmp_path, diffuse_home, nodes, max_new=MAX_NEW)
    assert tokens["input_ids"] == ref["input_ids"]
    assert tokens["new_tokens"] == ref["new_tokens"]
    assert report["top"] == ref["top"]  # ids and the exact float32 bits of each step's best 8 logits
    # every expert is on the nodes: the client holds no layer parameter, the nodes hold them all between them
    # (and the last one the final norm and the head)
    assert report["client_layer_params"] == 0 and report["client_head_params"] == 0
    assert sum(n["params"] for n in report["node_stats"]) == node_side_params(
        model, embedding=report["embedding"] == "first node")
    # an expert layer sends what a dense one does: the hidden rows of the pass, the same bytes every decode step
    decode = [b for n in report["node_stats"][1:] for _, b in n["hop_bytes"][1:]]
    assert len(decode) == (nodes - 1) * (MAX_NEW - 1) and len(set(decode)) == 1


@pytest.mark.parametrize("name,nodes", OTHERS)
def test_tuples_alibi_a_client_without_parameters_and_a_soft_cap_equal_transformers(
        name, nodes, arch_models, arch_references, tmp_path, diffuse_home):
    """Falcon's layers return (hidden, attention weights) and the model reads ``outputs[0]`` between layers;
    BLOOM's do too (its weights a tensor, never threaded), and its attention says nothing of causality;
    OLMo's client holds no parameter once its layers, embedding and head are on nodes; Gemma 2 with a tiny soft
    cap makes ties far wider than the best candidates, so its greedy tokens need whole rows of logits."""
    model = arch_models(name)
    ref = arch_references[model]
    # OLMo with the embedding table on the first node too: the client keeps no parameter at all
    extra = ["--embedding-on-node"] if name == "olmo" else []
    tokens, report, _ = split_run(model, tmp_path, diffuse_home, nodes, max_new=MAX_NEW, extra=extra)
    assert tokens["new_tokens"] == ref["new_tokens"] and report["top"] == ref["top"]
    assert report["client_layer_params"] == 0 and report["client_head_params"] == 0
    assert report["tail_passes"] == report["calls"]  # the last node ran the head on the tuple's hidden state
    if name == "olmo":
        assert report["embedding"] == "first node" and report["client_embedding_params"] == 0
        assert report["client_params"] == 0
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    if name == "gemma2_capped":  # the cap changes the logits after the head: every answer is the whole last row
        assert report["last_hop_bytes_per_token"] > 4 * vocab
    else:  # the first pass brings the whole last row once (to learn that nothing changes after the head), then 8
        assert report["last_hop_bytes_per_token"] < 4 * vocab


@pytest.mark.parametrize("name,nodes", T5)
def test_t5_threads_block_zeros_position_biases_and_equals_transformers(name, nodes, arch_models, arch_references,
                                                                         tmp_path, diffuse_home):
    """T5's decoder hands the position biases block 0 returned to every later block: the stand-in answers each
    block in that structure and the pass threads them on, node to node, as the model does (without them every
    later block would see no position bias, and the logits would differ). T5's own layout feeds its tied head the
    final norm's output scaled: its first pass, held back for the last node, goes without the tail, the forward
    runs again on that answer up to the head, and later passes go at once, the head here; an untied T5 (flan's
    layout) has its norm and head run on the last node."""
    model = arch_models(name)
    ref = arch_references[model]
    tokens, report, _ = split_run(model, tmp_path, diffuse_home, nodes, max_new=MAX_NEW)
    assert tokens["new_tokens"] == ref["new_tokens"] and report["top"] == ref["top"]
    assert len(set(ref["new_tokens"][0])) > 2  # not one token repeated
    assert report["client_layer_params"] == 0 and report["calls"] == MAX_NEW
    assert report["tail_passes"] == (report["calls"] if name == "t5_untied" else 0)


def test_checkpoint_whose_expert_names_no_rule_knows_is_refused_before_any_node_starts(arch_models, tmp_path,
                                                                                       diffuse_home, monkeypatch):
    """Mixtral's per-expert ``w1`` saved under a name transformers has no rule for: from_pretrained would leave
    the fused parameter unloaded, and a node could not load it. Refused at analysis, one line, exit 2: the
    local nodes asked for are never started (a start would be recorded here)."""
    from safetensors.torch import load_file, save_file

    from diffuse.local import nodes as localnodes

    started = []
    monkeypatch.setattr(localnodes, "start_local_nodes", lambda *a, **k: started.append(a) or 1 / 0)

    src = arch_models("mixtral")
    bad = tmp_path / "mixtral-renamed"
    bad.mkdir()
    for f in os.listdir(src):
        if f != "model.safetensors":
            os.symlink(os.path.join(src, f), bad / f)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    save_file({k.replace(".w1.", ".wi."): v for k, v in tensors.items()}, str(bad / "model.safetensors"),
              metadata={"format": "pt"})
    run = run_client(["--model", str(bad), "--prompt", PROMPT, "--max-new-tokens", "2", "--local-nodes", "2",
                      "--quiet", "--timeout", "20"], diffuse_home)
    assert run.returncode == 2
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, run.stderr
    assert f"cannot split {bad}" in lines[0] and "experts.gate_up_proj" in lines[0] and "a node could not load" in lines[0]
    assert "local node" not in run.stderr and not started
