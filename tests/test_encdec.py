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
import subprocess
import sys

import pytest

from conftest import TESTS, THREADS, run_client, subprocess_env


@pytest.fixture(scope="session")
def whisper(tmp_path_factory) -> dict:
    import encdec_models
    import encdec_reference

    root = tmp_path_factory.mktemp("whisper")
    model = encdec_models.build("whisper", str(root / "model"))
    clip = str(root / "clip.wav")
    encdec_reference.write_clip(clip)
    out = root / "reference.json"
    cmd = [sys.executable, os.path.join(TESTS, "encdec_reference.py"), "--model", model, "--audio", clip,
           "--max-new-tokens", "12", "--threads", str(THREADS), "--out", str(out)]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as f:
        return {"model": model, "clip": clip, "reference": json.load(f)}


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


@pytest.fixture(scope="session")
def musicgen(tmp_path_factory) -> dict:
    import encdec_models

    root = tmp_path_factory.mktemp("musicgen")
    model = encdec_models.build("musicgen", str(root / "model"))
    out = root / "reference.json"
    cmd = [sys.executable, os.path.join(TESTS, "encdec_reference.py"), "--model", model, "--prompt", "slow piano",
           "--max-new-tokens", "8", "--threads", str(THREADS), "--out", str(out)]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as f:
        return {"model": model, "reference": json.load(f)}


def test_split_musicgen_composes_what_transformers_composes(musicgen, diffuse_home):
    """MusicGen through the Python API: the text encoder and the audio codec stay on the client, the decoder's
    layers (both guidance branches in one batch, four codebooks summed into one stream) on 2 nodes. The codes
    handed to the codec and the audio are those of plain transformers (its ``generate`` prefills twice: two
    fresh caches on the nodes, one per prefill)."""
    import hashlib

    import numpy as np
    import torch
    from transformers import AutoProcessor

    import diffuse

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
    finally:
        torch.set_num_threads(threads)
    assert [c.tolist() for c in codes] == [ref["new_tokens"]]
    samples = np.ascontiguousarray(audio.to(torch.float32).numpy()).astype("<f4")
    assert hashlib.sha256(samples.tobytes()).hexdigest() == ref["audio_sha256"]
    assert ring.stats.passes == 9  # 8 tokens, the first prompt pass made twice


def test_musicgen_from_the_command_line_writes_the_codec_rate_and_saves_the_codes(musicgen, tmp_path, diffuse_home):
    import soundfile

    tokens, out = tmp_path / "tokens.json", tmp_path / "tune.wav"
    run = run_client(["--model", musicgen["model"], "--prompt", "slow piano", "--max-new-tokens", "8", "--threads",
                      str(THREADS), "--local-nodes", "2", "--save-tokens", str(tokens), "--out", str(out), "--quiet",
                      "--timeout", "120"], diffuse_home)
    assert run.returncode == 0, run.stderr[-3000:]
    ref = musicgen["reference"]
    with open(tokens) as f:
        saved = json.load(f)
    assert saved["new_tokens"] == ref["new_tokens"] and saved["input_ids"] == ref["input_ids"]
    info = soundfile.info(str(out))
    assert info.samplerate == ref["sampling_rate"] and info.frames == ref["audio_shape"][-1]


def test_check_sizes_whisper_by_its_decoder_depth_not_the_encoders(whisper):
    """Whisper's config calls its encoder depth num_hidden_layers too: the nudge tells the settings apart."""
    from diffuse.check import check

    r = check(whisper["model"])
    assert [(s["path"], s["config_key"]) for s in r["stacks"]] == [("model.decoder.layers", "decoder_layers")]
    assert "model.encoder.layers" in r["other_lists"]
