"""Ground truth for encoder-decoder audio models: run a saved model whole, in plain transformers.

    python tests/encdec_reference.py --model WHISPER_DIR --audio CLIP.wav
        [--max-new-tokens N] [--threads N] --out OUT.json
    python tests/encdec_reference.py --model MUSICGEN_DIR --prompt TEXT
        [--max-new-tokens N] [--threads N] [--wav OUT.wav] --out OUT.json
    python tests/encdec_reference.py --model VOXTRAL_DIR --audio CLIP.wav --prompt TEXT
        [--max-new-tokens N] [--threads N] --out OUT.json
    python tests/encdec_reference.py --jobs JOBS.json [--threads N] --out OUT.json

The model type comes from the folder's config.json. Both load float32 in eval
mode; ``--threads`` > 0 sets the torch thread count first (1 and 2 threads give
the same tokens but not the same logits bits).

Whisper (WhisperForConditionalGeneration, sdpa): the clip is read with
soundfile as float32, mono only, and refused unless its rate is the feature
extractor's ``sampling_rate``; the model's processor (its WhisperFeatureExtractor)
turns it into ``input_features`` -- padded or cut to the extractor's window --
and ``generate(input_features=..., max_new_tokens=N, output_logits=True,
return_dict_in_generate=True)`` runs with everything else from the
generation config (greedy; the decoder prompt built from it; the suppress-token
logits processors it names). Writes::

    {"decoder_prompt": [[...]], "new_tokens": [[...]], "sequences": [[...]],
     "text": "...", "top": [{"ids": [8 ids], "values_hex": [8 x float32 hex]}, ...]}

``sequences`` is exactly what that ``generate`` call returns: with
``return_dict_in_generate=True`` Whisper's ``sequences`` start with the decoder
prompt (``<|startoftranscript|><|notimestamps|>``); ``new_tokens`` is what
follows it -- what a plain ``generate(input_features)`` returns -- one token
per entry of ``top``. ``text`` is ``new_tokens`` decoded with
``skip_special_tokens=True``. ``top`` is one entry per generated token, from
the raw logits of batch row 0 (``output_logits``: before the suppress-token
processors, so a suppressed id can head the list): the 8 highest, ordered by
value then by id (lowest first among equal values, as ``argmax`` picks), each
float32's little-endian bytes as hex.

MusicGen (MusicgenForConditionalGeneration): ``input_ids`` and
``attention_mask`` from the processor (``processor(text=[prompt],
padding=True)``, i.e. the T5 tokenizer), then ``generate(**inputs,
output_logits=True, return_dict_in_generate=True)`` with the generation
config's guidance scale, greedy setting and ``max_new_tokens`` (``--max-new-tokens``
overrides the last); with ``--seed S`` (a job's ``seed``) ``do_sample=True`` after
``torch.manual_seed(S)``. ``generate`` returns audio, not codes: the codes are what
it hands to ``audio_encoder.decode`` once the delay pattern is undone, and the
reference records them by replacing ``model.audio_encoder.decode`` on the
instance with a wrapper that stores a clone of its first argument and calls
the original with the same arguments, so the codes and the audio are untouched.
Writes::

    {"input_ids": [[...]], "new_tokens": [[[[...]]]], "codes_shape": [1, B, K, L],
     "sampling_rate": R, "audio_shape": [B, C, S], "audio_sha256": "...",
     "top": [[{"ids": [...], "values_hex": [...]}, ... one per logits row], ...]}

``new_tokens`` has shape (1, batch, codebooks, length): 8 new tokens give
length 5 with 4 codebooks (the delay pattern costs codebooks - 1 frames).
``top`` is per generated step, one entry per row of the raw logits: under
classifier-free guidance 2 x batch x codebooks rows (the conditional batch
first, codebooks inner), before the guidance processor mixes them.
``audio_sha256`` hashes the generated audio as little-endian float32. With
``--wav`` the audio is written there too (soundfile's default WAV subtype,
16-bit PCM, at the codec's rate).

Voxtral (VoxtralForConditionalGeneration, sdpa): its processor takes audio only
through its chat template, so the inputs are
``processor.apply_chat_template(conversation)`` for one user turn holding the
clip (``{"type": "audio", "path": CLIP}``, read by mistral-common) and then the
text (``{"type": "text", "text": PROMPT}``): ``input_ids`` (the clip's
``[AUDIO]`` placeholders included), ``attention_mask`` and ``input_features``.
Then ``generate(**inputs, max_new_tokens=N, output_logits=True,
return_dict_in_generate=True)`` with the rest from the generation config
(greedy). Writes::

    {"input_ids": [[...]], "new_tokens": [[...]], "text": "...", "top": [...],
     "text_only_input_ids": [[...]]}

``new_tokens`` follow the prompt in ``sequences``; ``top`` as for Whisper.
``text_only_input_ids``: the same question without the audio, as the
tokenizer's own ``apply_chat_template(..., add_generation_prompt=True,
tokenize=True, return_dict=True)`` renders it (Mistral's tokenizer renders chats in
mistral-common, with no Jinja template).

``--jobs FILE.json``: a JSON list of jobs, each ``{"model", "audio"}`` (Whisper),
``{"model", "prompt"}`` (MusicGen) or ``{"model", "audio", "prompt"}``
(Voxtral), with optional ``"max_new_tokens"`` and ``"wav"``; each model is
loaded afresh in one interpreter and the list of results is written.

``write_clip(path, seconds=1.0, rate=16000)`` writes the deterministic test
clip the tests use (three sine tones under an envelope plus seeded noise,
16-bit PCM).

Imports only torch, numpy, soundfile and transformers: nothing from ``diffuse``
or tests/, so the reference cannot share a bug with what it checks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import numpy as np
import soundfile
import torch
from transformers import (
    AutoConfig,
    AutoProcessor,
    MusicgenForConditionalGeneration,
    VoxtralForConditionalGeneration,
    WhisperForConditionalGeneration,
)

TOP_K = 8
DEFAULT_WHISPER_NEW_TOKENS = 8


def write_clip(path, seconds: float = 1.0, rate: int = 16000, seed: int = 0) -> str:
    """A deterministic mono test clip: tones at 220, 660 and 1250 Hz (each
    with its own slow amplitude envelope, so the spectrum changes over time)
    plus white noise from ``numpy.random.default_rng(seed)``, peak below 0.9,
    written as 16-bit PCM WAV. Returns ``path``."""
    n = int(round(seconds * rate))
    t = np.arange(n, dtype=np.float64) / rate
    wave = (
        0.30 * np.sin(2 * np.pi * 220.0 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 1.5 * t))
        + 0.20 * np.sin(2 * np.pi * 660.0 * t) * (0.5 + 0.5 * np.cos(2 * np.pi * 0.7 * t))
        + 0.15 * np.sin(2 * np.pi * 1250.0 * t) * np.clip(4.0 * t / max(seconds, 1e-9), 0.0, 1.0)
        + 0.05 * np.random.default_rng(seed).standard_normal(n)
    )
    wave = np.clip(wave, -0.9, 0.9).astype(np.float32)
    soundfile.write(str(path), wave, int(rate), subtype="PCM_16")
    return str(path)


def _top(logits: torch.Tensor) -> dict:
    """The TOP_K largest of one row of raw logits, by value then lowest id."""
    values = logits.detach().to(torch.float32).cpu().numpy()
    order = np.lexsort((np.arange(values.shape[0]), -values))[:TOP_K]
    picked = values[order].astype("<f4")
    return {"ids": [int(i) for i in order], "values_hex": [v.tobytes().hex() for v in picked]}


def model_type(model_dir: str) -> str:
    return AutoConfig.from_pretrained(model_dir).model_type


# --------------------------------------------------------------------------- #
# whisper


def read_audio(path: str, sampling_rate: int) -> np.ndarray:
    """The clip as float32 mono samples; refused when its rate is not ``sampling_rate``."""
    data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    if int(rate) != int(sampling_rate):
        raise ValueError(f"{path}: {rate} Hz, but the feature extractor wants {sampling_rate} Hz; resample it first")
    if data.shape[1] != 1:
        raise ValueError(f"{path}: {data.shape[1]} channels; the reference takes mono clips only")
    return np.ascontiguousarray(data[:, 0])


def whisper_inputs(model_dir: str, audio_path: str) -> dict:
    """``{"input_features": (1, mel bins, frames)}`` as the model's processor builds it."""
    extractor = AutoProcessor.from_pretrained(model_dir).feature_extractor
    samples = read_audio(audio_path, extractor.sampling_rate)
    features = extractor(samples, sampling_rate=extractor.sampling_rate, return_tensors="pt")
    return {"input_features": features["input_features"]}


def run_whisper(model_dir: str, audio_path: str, max_new_tokens: int = DEFAULT_WHISPER_NEW_TOKENS,
                threads: int = 0) -> dict:
    if threads > 0:
        torch.set_num_threads(threads)
    inputs = whisper_inputs(model_dir, audio_path)  # first: a clip at the wrong rate is refused before loading
    processor = AutoProcessor.from_pretrained(model_dir)
    model = WhisperForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    with torch.no_grad():
        out = model.generate(
            input_features=inputs["input_features"],
            max_new_tokens=max_new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
        )
    sequences = out.sequences
    steps = len(out.logits)
    prompt_len = sequences.shape[1] - steps
    new_tokens = sequences[:, prompt_len:]
    return {
        "decoder_prompt": sequences[:, :prompt_len].tolist(),
        "new_tokens": new_tokens.tolist(),
        "sequences": sequences.tolist(),
        "text": processor.batch_decode(new_tokens, skip_special_tokens=True)[0],
        "top": [_top(step[0]) for step in out.logits],
    }


# --------------------------------------------------------------------------- #
# musicgen


def musicgen_inputs(model_dir: str, prompt: str) -> dict:
    """``input_ids`` and ``attention_mask`` (1, L) as the model's processor builds them."""
    processor = AutoProcessor.from_pretrained(model_dir)
    enc = processor(text=[prompt], padding=True, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def run_musicgen(model_dir: str, prompt: str, max_new_tokens: int | None = None, threads: int = 0,
                 wav: str | None = None, seed: int | None = None) -> dict:
    if threads > 0:
        torch.set_num_threads(threads)
    model = MusicgenForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = musicgen_inputs(model_dir, prompt)

    # generate returns audio; record the codes it decodes it from, unchanged.
    seen = []
    decode = model.audio_encoder.decode

    def recording_decode(audio_codes, *args, **kwargs):
        seen.append(audio_codes.detach().clone())
        return decode(audio_codes, *args, **kwargs)

    model.audio_encoder.decode = recording_decode
    kwargs = dict(output_logits=True, return_dict_in_generate=True)
    if max_new_tokens is not None:
        kwargs["max_new_tokens"] = max_new_tokens
    if seed is not None:  # sampling, the rest from the generation config, after torch.manual_seed(seed)
        kwargs["do_sample"] = True
        torch.manual_seed(seed)
    try:
        with torch.no_grad():
            out = model.generate(**inputs, **kwargs)
    finally:
        del model.audio_encoder.decode
    if len(seen) != 1:
        raise RuntimeError(f"audio_encoder.decode ran {len(seen)} times (stereo MusicGen is not handled here)")
    codes = seen[0]
    audio = out.sequences  # (batch, channels, samples)
    samples = audio.detach().to(torch.float32).cpu().numpy()
    rate = int(model.config.audio_encoder.sampling_rate)
    if wav:
        # soundfile's default WAV subtype (16-bit PCM), as diffuse's writer uses; a float WAV
        # would carry libsndfile's time-stamped PEAK chunk and differ from run to run.
        soundfile.write(str(wav), np.ascontiguousarray(samples[0].T), rate)
    return {
        "input_ids": inputs["input_ids"].tolist(),
        "new_tokens": codes.tolist(),
        "codes_shape": list(codes.shape),
        "sampling_rate": rate,
        "audio_shape": list(audio.shape),
        "audio_sha256": hashlib.sha256(np.ascontiguousarray(samples).astype("<f4").tobytes()).hexdigest(),
        "top": [[_top(row) for row in step] for step in out.logits],
    }


# --------------------------------------------------------------------------- #
# voxtral


def voxtral_inputs(model_dir: str, audio_path: str, prompt: str) -> dict:
    """``input_ids``, ``attention_mask`` and ``input_features`` as the processor's chat template makes them for
    one user turn: the clip, then the text."""
    processor = AutoProcessor.from_pretrained(model_dir)
    read_audio(audio_path, processor.feature_extractor.sampling_rate)  # the rate checked, as for Whisper
    conversation = [{"role": "user", "content": [{"type": "audio", "path": str(audio_path)},
                                                 {"type": "text", "text": prompt}]}]
    return dict(processor.apply_chat_template(conversation))


def run_voxtral(model_dir: str, audio_path: str, prompt: str, max_new_tokens: int = DEFAULT_WHISPER_NEW_TOKENS,
                threads: int = 0) -> dict:
    if threads > 0:
        torch.set_num_threads(threads)
    inputs = voxtral_inputs(model_dir, audio_path, prompt)
    processor = AutoProcessor.from_pretrained(model_dir)
    model = VoxtralForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, output_logits=True,
                             return_dict_in_generate=True)
    new_tokens = out.sequences[:, inputs["input_ids"].shape[1]:]
    return {
        "input_ids": inputs["input_ids"].tolist(),
        "new_tokens": new_tokens.tolist(),
        "text": processor.batch_decode(new_tokens, skip_special_tokens=True)[0],
        "top": [_top(step[0]) for step in out.logits],
        "text_only_input_ids": [list(processor.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
            return_dict=True)["input_ids"])],
    }


# --------------------------------------------------------------------------- #


def run_job(job: dict, threads: int = 0) -> dict:
    kind = model_type(job["model"])
    if kind == "whisper":
        if "audio" not in job:
            raise ValueError("a whisper job needs an audio file")
        return run_whisper(job["model"], job["audio"], job.get("max_new_tokens", DEFAULT_WHISPER_NEW_TOKENS),
                           threads=threads)
    if kind == "musicgen":
        if "prompt" not in job:
            raise ValueError("a musicgen job needs a prompt")
        return run_musicgen(job["model"], job["prompt"], job.get("max_new_tokens"), threads=threads,
                            wav=job.get("wav"), seed=job.get("seed"))
    if kind == "voxtral":
        if "audio" not in job or "prompt" not in job:
            raise ValueError("a voxtral job needs an audio file and a prompt")
        return run_voxtral(job["model"], job["audio"], job["prompt"],
                           job.get("max_new_tokens", DEFAULT_WHISPER_NEW_TOKENS), threads=threads)
    raise ValueError(f"no reference for model type {kind!r} (whisper, musicgen and voxtral only)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model")
    parser.add_argument("--audio", help="Whisper, Voxtral: a mono WAV (or any soundfile format) at the extractor's rate")
    parser.add_argument("--prompt", help="MusicGen: the text prompt; Voxtral: the question after the audio")
    parser.add_argument("--max-new-tokens", type=int,
                        help=f"Whisper, Voxtral: default {DEFAULT_WHISPER_NEW_TOKENS}; "
                             "MusicGen: default from its generation config")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 leaves torch's default")
    parser.add_argument("--wav", help="MusicGen: also write the generated audio here")
    parser.add_argument("--seed", type=int, help="MusicGen: sample (do_sample=True) after torch.manual_seed(SEED)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--jobs", metavar="FILE.json",
                        help="run each job of this JSON list instead ({model, audio}, {model, prompt} or "
                             "{model, audio, prompt}, optional "
                             "max_new_tokens, wav and seed; each model loaded afresh) and write the list of results")
    args = parser.parse_args(argv)
    if args.jobs:
        if args.threads > 0:
            torch.set_num_threads(args.threads)
        with open(args.jobs) as f:
            jobs = json.load(f)
        results = [run_job(job) for job in jobs]
        with open(args.out, "w") as f:
            json.dump(results, f)
        return 0

    if not args.model:
        parser.error("--model is needed (or --jobs)")
    job = {"model": args.model}
    for key in ("audio", "prompt", "wav", "seed"):
        if getattr(args, key) is not None:
            job[key] = getattr(args, key)
    if args.max_new_tokens is not None:
        job["max_new_tokens"] = args.max_new_tokens
    try:
        result = run_job(job, threads=args.threads)
    except ValueError as exc:
        parser.error(str(exc))
    with open(args.out, "w") as f:
        json.dump(result, f)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
