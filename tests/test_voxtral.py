"""A model that listens through its prompt: Voxtral's audio tower on the client, its Llama decoder on the nodes.

The question and the clip go through the processor's chat template (one user
turn: the audio, then the text); on the first pass the audio tower and the
projector run here and their output takes the place of the ``[AUDIO]``
placeholders' embeddings, so the nodes see an ordinary stream of hidden states.
The answer's tokens and each step's top logits must equal plain transformers'
``generate`` on the same folder, clip and question (tests/encdec_reference.py,
in a subprocess).
"""

from __future__ import annotations

import json
import os

import pytest

from conftest import THREADS, encdec_answer, run_client

QUESTION = "what is said?"
NEW_TOKENS = 12


@pytest.fixture(scope="session")
def voxtral(tmp_path_factory) -> dict:
    import encdec_models
    import encdec_reference

    root = tmp_path_factory.mktemp("voxtral")
    model = encdec_models.build("voxtral", str(root / "model"))
    clip = encdec_reference.write_clip(str(root / "clip.wav"))
    reference = encdec_answer(model, clip, str(root / "reference.json"), "--prompt", QUESTION,
                              "--max-new-tokens", str(NEW_TOKENS))
    return {"model": model, "clip": clip, "reference": reference}


@pytest.mark.parametrize("nodes", [2, 3])
def test_split_voxtral_answers_about_a_clip_as_transformers_does(voxtral, nodes, tmp_path, diffuse_home):
    tokens, report = tmp_path / "tokens.json", tmp_path / "report.json"
    run = run_client(["--model", voxtral["model"], "--audio", voxtral["clip"], "--prompt", QUESTION,
                      "--max-new-tokens", str(NEW_TOKENS), "--threads", str(THREADS), "--local-nodes", str(nodes),
                      "--save-tokens", str(tokens), "--report", str(report), "--quiet", "--timeout", "120"],
                     diffuse_home)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(tokens) as f, open(report) as g:
        tokens, report = json.load(f), json.load(g)
    ref = voxtral["reference"]
    assert tokens["input_ids"] == ref["input_ids"]  # the clip's placeholders, as the chat template put them
    assert tokens["new_tokens"] == ref["new_tokens"]
    assert report["top"] == ref["top"]  # each step's best 8 raw logits, bit for bit
    assert report["client_layer_params"] == 0 and report["tail_passes"] == report["calls"] == NEW_TOKENS
    assert len(report["node_stats"]) == nodes
    # the audio stayed here: the first pass carried the prompt's rows (the audio tower's output among them), every
    # later one a single new row, and the whole run sent less than the clip's mel features alone would take
    messages = report["messages"]
    assert messages[0]["stream_rows"] == len(ref["input_ids"][0])
    assert all(m["stream_rows"] == 1 for m in messages[1:])
    assert len({m["bytes_out"] for m in messages[1:]}) == 1 and messages[1]["bytes_out"] < 1024
    mel_bytes = 128 * 3000 * 4  # input_features: 128 mel bins x 30 s of frames, float32
    assert report["bytes_sent"] < mel_bytes


def test_voxtral_refuses_what_its_processor_cannot_take(voxtral, tmp_path, diffuse_home):
    import numpy as np
    import soundfile

    other = tmp_path / "clip-8k.wav"
    soundfile.write(other, np.zeros(8000, dtype=np.float32), 8000)
    base = ["--model", voxtral["model"], "--quiet"]
    for argv, expected in [
        (["--audio", voxtral["clip"], "--prompt", QUESTION, "--no-template"], "only through its chat template"),
        (["--audio", voxtral["clip"]], "--prompt is needed"),
        (["--audio", str(other), "--prompt", QUESTION], "16000 Hz"),
        (["--audio", str(tmp_path / "missing.wav"), "--prompt", QUESTION], "no such file"),
    ]:
        run = run_client(base + argv, diffuse_home)
        assert run.returncode == 2 and expected in run.stderr and "Traceback" not in run.stderr, (argv, run.stderr)
        assert len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_voxtral_without_audio_gets_its_tokenizers_own_chat_format(voxtral):
    """Mistral's tokenizer renders chats in mistral-common (no Jinja template): a question alone is wrapped as it
    renders it ([INST] ... [/INST]), not sent as bare text."""
    from diffuse.lm.client_media import build_inputs

    inputs, _ = build_inputs(voxtral["model"], QUESTION)
    assert inputs["input_ids"].tolist() == voxtral["reference"]["text_only_input_ids"]
    bare, _ = build_inputs(voxtral["model"], QUESTION, no_template=True)
    assert bare["input_ids"].tolist() != voxtral["reference"]["text_only_input_ids"]


def test_check_sizes_voxtral_by_its_decoder_and_leaves_the_audio_tower_here(voxtral):
    from diffuse.cli.check import check

    with open(os.path.join(voxtral["model"], "config.json")) as f:
        config = json.load(f)
    depth, tower = config["text_config"]["num_hidden_layers"], config["audio_config"]["num_hidden_layers"]
    assert depth != tower
    r = check(voxtral["model"])
    assert r["verdict"] == "splittable", r["reason"]
    assert (r["config"]["depth"], r["config"]["depth_key"]) == (depth, "text_config.num_hidden_layers")
    assert f"audio_token_id {config['audio_token_id']}" in r["config"]["media"]
    assert [(s["path"], s["length"]) for s in r["stacks"]] == [("model.language_model.layers", depth)]
    assert "model.audio_tower.layers" in r["other_lists"]
