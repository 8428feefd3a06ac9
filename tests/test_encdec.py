"""Encoder memory: a decoder that reads an encoder's output at every layer, split, against plain transformers.

Whisper: the audio is read and encoded on the client; the decoder's layers,
with their self- and cross-attention caches, live on the nodes, and the
encoder's output travels once (later passes refer to it by digest). The
transcript's tokens and each step's top logits must equal what plain
transformers' ``generate`` gives whole (tests/encdec_reference.py, imports
transformers alone, in a subprocess).
"""

from __future__ import annotations

import json
import os

import pytest

from conftest import THREADS, encdec_answer, reference_jobs, run_client


@pytest.fixture(scope="session")
def whisper(tmp_path_factory) -> dict:
    import encdec_models
    import encdec_reference

    root = tmp_path_factory.mktemp("whisper")
    model = encdec_models.build("whisper", str(root / "model"))
    clip = str(root / "clip.wav")
    encdec_reference.write_clip(clip)
    reference = encdec_answer(model, clip, str(root / "reference.json"), "--max-new-tokens", "12")
    return {"model": model, "clip": clip, "reference": reference}


@pytest.mark.parametrize("nodes", [2, 3])
def test_split_whisper_transcribes_as_transformers_does(whisper, nodes, tmp_path, diffuse_home):
    tokens, report = tmp_path / "tokens.json", tmp_path / "report.json"
    run = run_client(["--model", whisper["model"], "--audio", whisper["clip"], "--max-new-tokens", "12", "--threads",
                      str(THREADS), "--local-nodes", str(nodes), "--save-tokens", str(tokens), "--report", str(report),
                      "--quiet", "--timeout", "120"], diffuse_home)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(tokens) as f, open(report) as g:
        tokens, report = json.load(f), json.load(g)
    ref = whisper["reference"]
    assert tokens["new_tokens"] == ref["new_tokens"]
    assert report["top"] == ref["top"]  # each step's best 8 raw logits, bit for bit
    assert report["client_layer_params"] == 0 and report["tail_passes"] == report["calls"]
    # the encoder's output crossed the client's wire once: every later pass referred to it by digest
    fresh = [m["fresh_bytes"] for m in report["messages"]]
    memory = fresh[0] - fresh[1]
    assert memory > 0 and all(f < memory for f in fresh[1:])
    # each node keeps both caches of its layers: self-attention grows with the tokens, cross-attention holds the memory
    assert all(n["cache_bytes"] > 0 for n in report["node_stats"])


def test_whisper_needs_audio_at_its_own_rate(whisper, tmp_path, diffuse_home):
    import numpy as np
    import soundfile

    other = tmp_path / "clip-8k.wav"
    soundfile.write(other, np.zeros(8000, dtype=np.float32), 8000)
    for argv, expected in [([], "--audio FILE is needed"), (["--audio", str(other)], "16000 Hz"),
                           (["--audio", whisper["clip"], "--prompt", "hi"], "takes audio only")]:
        run = run_client(["--model", whisper["model"], "--quiet", *argv], diffuse_home)
        assert run.returncode == 2 and expected in run.stderr and "Traceback" not in run.stderr, (argv, run.stderr)


SEED = 5


@pytest.fixture(scope="session")
def musicgen(tmp_path_factory) -> dict:
    """The tiny MusicGen and plain transformers' answers in one process: greedy, and sampled after
    ``torch.manual_seed(SEED)`` (each also written as a .wav by soundfile, as diffuse writes it)."""
    import encdec_models

    root = tmp_path_factory.mktemp("musicgen")
    model = encdec_models.build("musicgen", str(root / "model"))
    job = {"model": model, "prompt": "slow piano", "max_new_tokens": 8}
    greedy, sampled = reference_jobs("encdec_reference.py", [dict(job, wav=str(root / "greedy.wav")),
                                                             dict(job, seed=SEED, wav=str(root / "sampled.wav"))],
                                     root, timeout=300)
    assert greedy["new_tokens"] != sampled["new_tokens"]  # the seeded draw is not the greedy path
    return {"model": model, "reference": greedy, "sampled": sampled,
            "wav": {"greedy": str(root / "greedy.wav"), "sampled": str(root / "sampled.wav")}}


def four_vocabulary_rows(model_dir: str) -> int:
    """Bytes of one step's logits for the four codebooks as float32 (one guidance branch)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        decoder = json.load(f)["decoder"]
    assert decoder["num_codebooks"] == 4
    return 4 * decoder["vocab_size"] * 4


def test_split_musicgen_composes_what_transformers_composes(musicgen, diffuse_home):
    """MusicGen through the Python API: the text encoder and the audio codec stay on the client, the decoder's
    layers (both guidance branches in one batch, four codebooks summed into one stream) on 2 nodes; the final
    norm, the four heads, the guidance combination and the greedy pick (then, in a second call, the seeded draw)
    on the last node. The codes handed to the codec and the audio are those of plain transformers (its
    ``generate`` prefills twice: two fresh caches on the nodes, one per prefill), and each step only the codes and
    a few raw candidates come home."""
    import hashlib

    import numpy as np
    import torch
    from transformers import AutoProcessor

    import diffuse
    from diffuse.lm.heads import LISTED_TOP

    model_dir, ref = musicgen["model"], musicgen["reference"]
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        inputs = AutoProcessor.from_pretrained(model_dir)(text=["slow piano"], padding=True, return_tensors="pt")
        model = diffuse.from_pretrained(model_dir)
        codes = []
        decode = model.audio_encoder.decode
        model.audio_encoder.decode = lambda c, *a, **k: (codes.append(c.clone()), decode(c, *a, **k))[1]
        with diffuse.split(model, local_nodes=2) as ring, torch.no_grad():
            audio = model.generate(**inputs, max_new_tokens=8)
            greedy = ring.splitter.last_draw
            torch.manual_seed(SEED)
            sampled_audio = model.generate(**inputs, max_new_tokens=8, do_sample=True)
    finally:
        torch.set_num_threads(threads)
    assert [c.tolist() for c in codes] == [ref["new_tokens"], musicgen["sampled"]["new_tokens"]]
    for out, r in ((audio, ref), (sampled_audio, musicgen["sampled"])):
        samples = np.ascontiguousarray(out.to(torch.float32).numpy()).astype("<f4")
        assert hashlib.sha256(samples.tobytes()).hexdigest() == r["audio_sha256"]
    assert ring.stats.passes == 18  # 8 tokens a call, the first prompt pass made twice
    sp = ring.splitter
    assert sp.head_list and sp.tail_passes == 18 and sp.head_freed
    assert all(p.device.type == "meta" for p in sp.head[1].parameters())  # the heads' weights went
    guidance = ["ClassifierFreeGuidanceLogitsProcessor", {"guidance_scale": 3.0}]
    # greedy: the last node combined the guidance halves and took the argmax; sampled: generate's top-k too, drawn
    # there with a generator in the client's state
    assert not greedy.sample and greedy.draws == 9 and greedy.described == [guidance]
    sampled = sp.last_draw
    assert sampled.sample and sampled.draws == 9 and guidance in sampled.described and sampled.states_sent >= 1
    # per step: 2 branches x 4 codebooks rows of LISTED_TOP (int32 id, float32 value), and 4 int32 codes
    assert sp.tail_bytes_max == 2 * 4 * LISTED_TOP * 8 + 4 * 4
    rows = four_vocabulary_rows(model_dir)
    assert sp.tail_bytes_max * 6 < rows  # the answer's tensors; the raw rows with both branches are twice `rows`
    returns = [n for _, n in ring.ring.channel_stats.returns]
    assert len(returns) == 18 and max(returns) < rows / 2, returns  # the whole sealed message, envelope included


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_musicgen_from_the_command_line_writes_what_transformers_writes(musicgen, mode, tmp_path, diffuse_home):
    """``diffuse.cli.query`` through 3 nodes, greedy and sampling (``do_sample``, seeded; 2 nodes: above): the codes
    saved equal ``generate``'s, and the .wav is byte for byte the one the same codes decode to; every step's heads,
    guidance and pick (or draw) ran on the last node."""
    import soundfile

    tokens, out, report = tmp_path / "tokens.json", tmp_path / "tune.wav", tmp_path / "report.json"
    sampling = ["--arg", "do_sample=true", "--seed", str(SEED)] if mode == "sampled" else []
    run = run_client(["--model", musicgen["model"], "--prompt", "slow piano", "--max-new-tokens", "8", "--threads",
                      str(THREADS), "--local-nodes", "3", "--save-tokens", str(tokens), "--out", str(out),
                      "--report", str(report), "--quiet", "--timeout", "120", *sampling], diffuse_home)
    assert run.returncode == 0, run.stderr[-3000:]
    ref = musicgen["reference" if mode == "greedy" else "sampled"]
    with open(tokens) as f, open(report) as g:
        saved, report = json.load(f), json.load(g)
    assert saved["new_tokens"] == ref["new_tokens"] and saved["input_ids"] == ref["input_ids"]
    info = soundfile.info(str(out))
    assert info.samplerate == ref["sampling_rate"] and info.frames == ref["audio_shape"][-1]
    with open(out, "rb") as f, open(musicgen["wav"][mode], "rb") as g:
        assert f.read() == g.read()
    picked = report["codes_picked"]
    assert picked["sample"] == (mode == "sampled") and picked["draws"] == 9
    assert ["ClassifierFreeGuidanceLogitsProcessor", {"guidance_scale": 3.0}] in picked["processors"]
    if mode == "sampled":  # generate's own top-k runs there too; the generator state crossed when out of step
        assert any(name == "TopKLogitsWarper" for name, _ in picked["processors"])
        assert picked["generator_states_sent"] >= 1
    assert report["tail_passes"] == report["calls"] == 9 and report["client_head_params"] == 0
    rows = four_vocabulary_rows(musicgen["model"])
    assert report["tail_answer_max_bytes"] * 6 < rows and report["last_hop_max_bytes"] < rows / 2


def test_check_sizes_whisper_by_its_decoder_depth_not_the_encoders(whisper):
    """Whisper's config calls its encoder depth num_hidden_layers too: the nudge tells the settings apart."""
    from diffuse.cli.check import check

    r = check(whisper["model"])
    assert [(s["path"], s["config_key"]) for s in r["stacks"]] == [("model.decoder.layers", "decoder_layers")]
    assert "model.encoder.layers" in r["other_lists"]
