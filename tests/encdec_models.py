"""Tiny transformers audio models (encoder-decoders, and a chat model that listens), built offline and saved for
``from_pretrained``.

``build(name, out_dir)`` (or ``BUILDERS[name](out_dir, seed=0)``) writes a complete
model folder -- config.json, model.safetensors, generation_config.json, the
tokenizer files and processor_config.json (the processor, with its feature
extractor inside, as transformers 5 saves it; AutoFeatureExtractor reads it) -- with
seeded random float32 weights, and returns the folder. Nothing is fetched from
a hub: the tokenizers are made here from the small fixed English text below
(Whisper's byte-level BPE trained with the ``tokenizers`` library, T5's
Unigram vocabulary counted). Building twice with the same seed writes
byte-identical files.

Weights are drawn from ``torch.manual_seed(seed)`` for the class's own init and
then redrawn from a generator seeded with ``seed + 1``: normal, std 0.2; norm
scales 1 + normal, std 0.2 (with the classes' std 0.02 a greedy transcript is
one token repeated). Parameters that do not train (Whisper's sinusoidal encoder
positions) keep their init. Even at std 0.2 the outputs repeat a lot, so a few
tensors are then scaled (named below and in the builders).

- ``whisper``: WhisperForConditionalGeneration, English-only (``is_multilingual``
  False, no ``lang_to_id``: no language detection pass), d_model 32, 2 encoder
  and 4 decoder layers, 4 heads. The feature extractor works on 1 s windows
  (``chunk_length=1``: 16 000 samples, 100 mel frames of 80 bins; a longer clip
  is cut to 1 s, a shorter one padded), and the encoder takes exactly that
  (``max_source_positions=50``: two convolutions, the second with stride 2).
  The decoder prompt is ``<|startoftranscript|><|notimestamps|>``; a plain
  ``generate`` returns only the tokens after it, ``return_dict_in_generate``
  sequences start with it. Decoder position embeddings are scaled to std 2.0
  (else the transcript is mostly one token). Tied embeddings: the rows of
  ``<|endoftext|>`` and of the timestamp tokens are zeroed, so their logit is
  exactly 0 and greedy decoding runs to ``max_new_tokens`` (like real Whisper,
  the generation config suppresses the other specials everywhere and
  ``<|endoftext|>`` and the space at the first step).
- ``musicgen``: MusicgenForConditionalGeneration, a 4-layer decoder (hidden 32,
  4 heads, 4 codebooks of 64 codes), a 2-layer T5 text encoder (d_model 48, so
  ``enc_to_dec_proj`` 48 -> 32 exists as in musicgen-small) and a tiny EnCodec
  (8 kHz, hop 16, 4 quantizers of 64 codes). The generation config asks for
  classifier-free guidance 3.0 (the batch doubles inside ``generate``), greedy,
  8 new tokens. Code embeddings are scaled to std 1.0 and the cross-attention
  output projections to std 0.1 (else guidance pins each codebook to one
  code). The codebook vectors (buffers) are drawn too, so decoded audio is not
  silence.
- ``voxtral``: VoxtralForConditionalGeneration, an audio tower (2 layers,
  d_model 16, 128 mel bins, 30 s windows) and a 4-layer Llama decoder (hidden
  32), with a tekken.json written here (256 byte tokens, 96 merges counted on
  the text below, Voxtral's special-token ranks and audio section; it needs
  mistral-common to load). Decoder token embeddings are scaled to std 1.0
  (else the answer is one token repeated); ``</s>`` scores exactly 0, so
  greedy decoding runs to ``max_new_tokens``.

    python tests/encdec_models.py NAME OUT_DIR [SEED]
"""

from __future__ import annotations

import json
import os
import sys

NAMES = ["whisper", "musicgen", "voxtral"]

# What the tokenizers are trained on: plain spoken-style English and the words
# music prompts use.
_CORPUS = """\
Hello, and welcome to the show. Today we talk about the weather and the news.
The quick brown fox jumps over the lazy dog. A small red cat sits on a green chair.
Once upon a time there was a little house by the river, and in the house lived
an old man with his dog. Every morning the man walked to the market to buy bread,
milk, apples and fresh fish for dinner. In the evening he told stories to the
children of the village about the sea, the mountains and the stars in the sky.
Thank you very much. Yes, I think so. No, not today. What time is it? It is ten past four.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 12 20 42 100. Colors: red, green, blue, yellow, white, black.
80s pop track with bassy drums and synth. Lo-fi hip hop beat with a calm piano melody.
A cheerful folk song with acoustic guitar, violin and hand claps. Slow jazz with soft saxophone.
Epic orchestral music with strings, brass and loud drums. Ambient electronic music for sleep.
A happy rock song with electric guitar and a fast beat. Sad piano ballad in a minor key.
"""

_SEED_STD = 0.2

# Whisper's special tokens, in Whisper's order (English-only checkpoints keep
# <|en|> too); the timestamp tokens <|0.00|>.. come after them.
WHISPER_SPECIALS = [
    "<|endoftext|>",
    "<|startoftranscript|>",
    "<|en|>",
    "<|translate|>",
    "<|transcribe|>",
    "<|startoflm|>",
    "<|startofprev|>",
    "<|nospeech|>",
    "<|notimestamps|>",
]
_WHISPER_BPE_VOCAB = 384  # 256 byte symbols + 128 merges
_WHISPER_CHUNK_S = 1  # feature-extractor window, seconds
_WHISPER_RATE = 16000
_WHISPER_HOP = 160
_WHISPER_MAX_SOURCE = _WHISPER_CHUNK_S * _WHISPER_RATE // _WHISPER_HOP // 2  # 50: conv2 has stride 2
_WHISPER_TIME_PRECISION = 0.02  # seconds per timestamp token, as in Whisper
_WHISPER_POSITION_GAIN = 10.0  # decoder position embeddings: std 2.0 instead of 0.2

_MUSICGEN_RATE = 8000
_MUSICGEN_CODES = 64
_MUSICGEN_CODEBOOKS = 4
_MUSICGEN_RATIOS = (4, 4)  # EnCodec hop 16 -> 500 frames per second
_MUSICGEN_EMBED_GAIN = 5.0  # decoder code embeddings: std 1.0
_MUSICGEN_CROSS_GAIN = 0.5  # decoder cross-attention out_proj weights: std 0.1


# --------------------------------------------------------------------------- #
# shared


def _randomize(model, seed: int, quiet_ids=(), buffers=()) -> None:
    """Redraw every trainable parameter (and the named float ``buffers``) from a
    generator seeded with ``seed + 1``: norm scales 1 + N(0, 0.2), everything
    else N(0, 0.2). Then zero the output rows of ``quiet_ids`` so they score
    exactly 0."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    done = set()
    with torch.no_grad():
        for _, module in model.named_modules():
            is_norm = "norm" in type(module).__name__.lower()
            for pname, p in module.named_parameters(recurse=False):
                if id(p) in done or not p.requires_grad:
                    continue
                done.add(id(p))
                noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * _SEED_STD
                if is_norm and pname == "weight":
                    noise += 1.0
                p.copy_(noise.to(p.dtype))
            for bname, b in module.named_buffers(recurse=False):
                if bname in buffers and id(b) not in done:
                    done.add(id(b))
                    b.copy_((torch.randn(b.shape, generator=gen, dtype=torch.float32) * _SEED_STD).to(b.dtype))
        if quiet_ids:
            model.get_output_embeddings().weight[list(quiet_ids)] = 0.0


def _save(model, out_dir: str, generation: dict, *savers) -> str:
    from transformers import GenerationConfig

    os.makedirs(out_dir, exist_ok=True)
    model.generation_config = GenerationConfig(**generation)
    model.save_pretrained(out_dir, safe_serialization=True)
    for saver in savers:
        saver(out_dir)
    return str(out_dir)


# --------------------------------------------------------------------------- #
# whisper


def _train_byte_bpe() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE (vocab, merges) trained on ``_CORPUS`` with the GPT-2
    pre-tokenizer WhisperTokenizer rebuilds on load (ByteLevel, regex on, no
    prefix space). The trainer is deterministic (checked by building twice)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=_WHISPER_BPE_VOCAB,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer)
    model = json.loads(tok.to_str())["model"]
    return dict(model["vocab"]), [tuple(m) for m in model["merges"]]


def _whisper_tokenizer():
    """WhisperTokenizer over the trained BPE; the specials take the ids right
    after the BPE (``<|endoftext|>`` first), then one timestamp token per 20 ms
    of the window (``<|0.00|>`` .. ``<|1.00|>``), not special, as Whisper has them."""
    from tokenizers import AddedToken
    from transformers import WhisperTokenizer

    vocab, merges = _train_byte_bpe()
    tok = WhisperTokenizer(vocab=vocab, merges=merges, model_max_length=64)
    tok.add_special_tokens({"additional_special_tokens": WHISPER_SPECIALS[1:]})
    steps = int(round(_WHISPER_CHUNK_S / _WHISPER_TIME_PRECISION))
    tok.add_tokens([AddedToken("<|%.2f|>" % (i * _WHISPER_TIME_PRECISION), lstrip=False, rstrip=False,
                               normalized=False, special=False) for i in range(steps + 1)])
    return tok


def build_whisper(out_dir: str, seed: int = 0) -> str:
    """Whisper (WhisperForConditionalGeneration), English-only: d_model 32,
    2 encoder layers, 4 decoder layers, 4 heads, FFN 64, 80 mel bins,
    ``max_source_positions`` 50 (1 s of audio), ``max_target_positions`` 64.

    Traps: the decoder stack is ``model.decoder.layers`` (``decoder_layers``),
    the encoder's ``model.encoder.layers`` (``encoder_layers``, aliased as
    ``num_hidden_layers``); ``generate`` is Whisper's own (it builds the
    decoder prompt from the generation config, adds its suppress-token logits
    processors and returns only the tokens after the prompt); the encoder runs
    once, its output goes to every decoder layer every step; tied embeddings.
    """
    import torch
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    tok = _whisper_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in WHISPER_SPECIALS}
    eot, sot, notimestamps = ids["<|endoftext|>"], ids["<|startoftranscript|>"], ids["<|notimestamps|>"]
    timestamps = list(range(notimestamps + 1, len(tok)))
    space = tok.convert_tokens_to_ids("\u0120")  # "Ġ": a bare space, as id 220 is in Whisper
    # As Whisper's generation configs: the task/prompt tokens never, eot and a
    # bare space not as the first token.
    suppress = [ids[t] for t in ("<|startoftranscript|>", "<|translate|>", "<|transcribe|>", "<|startoflm|>",
                                 "<|startofprev|>", "<|nospeech|>")]
    begin_suppress = [space, eot]
    config = WhisperConfig(
        vocab_size=len(tok),
        num_mel_bins=80,
        encoder_layers=2,
        encoder_attention_heads=4,
        decoder_layers=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        d_model=32,
        max_source_positions=_WHISPER_MAX_SOURCE,
        max_target_positions=64,
        decoder_start_token_id=sot,
        pad_token_id=eot,
        bos_token_id=eot,
        eos_token_id=eot,
        suppress_tokens=suppress,
        begin_suppress_tokens=begin_suppress,
        tie_word_embeddings=True,
        dtype="float32",
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config).to(torch.float32).eval()
    _randomize(model, seed, quiet_ids=[eot, *timestamps])
    with torch.no_grad():  # positions 10x wider (std 2): with std 0.2 the transcript is mostly one token repeated
        model.model.decoder.embed_positions.weight.mul_(_WHISPER_POSITION_GAIN)
    features = WhisperFeatureExtractor(
        feature_size=80,
        sampling_rate=_WHISPER_RATE,
        hop_length=_WHISPER_HOP,
        chunk_length=_WHISPER_CHUNK_S,
        n_fft=400,
    )
    generation = dict(
        decoder_start_token_id=sot,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        no_timestamps_token_id=notimestamps,
        is_multilingual=False,
        suppress_tokens=suppress,
        begin_suppress_tokens=begin_suppress,
        max_initial_timestamp_index=50,
        return_timestamps=False,
        do_sample=False,
    )

    def save_processor(path: str) -> None:
        from transformers import WhisperProcessor

        WhisperProcessor(feature_extractor=features, tokenizer=tok).save_pretrained(path)
        tok.backend_tokenizer.model.save(path)  # vocab.json + merges.txt (Whisper ships both forms)

    return _save(model, out_dir, generation, save_processor)


# --------------------------------------------------------------------------- #
# musicgen


def _t5_tokenizer():
    """T5Tokenizer (a Unigram model, T5's whitespace + Metaspace pre-tokenizer)
    over a vocabulary counted from ``_CORPUS`` here rather than trained: the
    ``tokenizers`` UnigramTrainer's scores differ in their last bits from run
    to run, which would break byte-identical builds. Pieces: every character,
    alone and after the word marker, and every word (letters/digits runs and
    punctuation) with and without the marker; score log(count / total).
    ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2 as in T5, no sentinel tokens."""
    import math
    import re
    from collections import Counter

    from transformers import T5Tokenizer

    marker = "\u2581"
    counts: Counter = Counter()
    for word in _CORPUS.split():
        for i, piece in enumerate(re.findall(r"\w+|[^\w\s]", word)):
            counts[piece] += 1
            if i == 0:
                counts[marker + piece] += 1
        for ch in word:
            counts[ch] += 1
        counts[marker + word[0]] += 1
    counts[marker] += 1
    total = sum(counts.values())
    pieces = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [(piece, math.log(count / total)) for piece, count in pieces]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=64)


def build_musicgen(out_dir: str, seed: int = 0) -> str:
    """MusicGen (MusicgenForConditionalGeneration): decoder 4 layers, hidden 32,
    4 heads, FFN 64, 4 codebooks of 64 codes (pad / decoder start 64); T5 text
    encoder 2 layers, d_model 48 (``enc_to_dec_proj`` to 32); EnCodec 8 kHz,
    4 quantizers of 64 codes, hop 16. Generation config: guidance 3.0,
    greedy, 8 new tokens.

    Traps: the decoder stack is ``decoder.model.decoder.layers``
    (``decoder.num_hidden_layers``), the text encoder's
    ``text_encoder.encoder.block`` (T5Block, returns a tuple); classifier-free
    guidance doubles the batch (conditional rows, then unconditional); the 4
    codebooks are summed into one stream before the stack and split into 4
    heads after it; ``generate`` prefills twice and returns audio, not codes
    (the codes are the input of ``audio_encoder.decode``, shape
    (1, batch, 4, new_tokens - 3) after the delay pattern).
    """
    import torch
    from transformers import (
        EncodecConfig,
        EncodecFeatureExtractor,
        MusicgenConfig,
        MusicgenDecoderConfig,
        MusicgenForConditionalGeneration,
        T5Config,
    )

    tok = _t5_tokenizer()
    text = T5Config(
        vocab_size=len(tok),
        d_model=48,
        d_kv=12,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="relu",
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        decoder_start_token_id=tok.pad_token_id,
    )
    hop = 1
    for r in _MUSICGEN_RATIOS:
        hop *= r
    frame_rate = -(-_MUSICGEN_RATE // hop)
    bits = (_MUSICGEN_CODES - 1).bit_length()
    bandwidth = _MUSICGEN_CODEBOOKS * frame_rate * bits / 1000.0  # kbps for exactly 4 quantizers
    audio = EncodecConfig(
        target_bandwidths=[bandwidth],
        sampling_rate=_MUSICGEN_RATE,
        audio_channels=1,
        hidden_size=16,
        num_filters=4,
        num_residual_layers=1,
        upsampling_ratios=list(_MUSICGEN_RATIOS),
        kernel_size=7,
        last_kernel_size=7,
        residual_kernel_size=3,
        num_lstm_layers=1,
        codebook_size=_MUSICGEN_CODES,
    )
    assert audio.num_quantizers == _MUSICGEN_CODEBOOKS, audio.num_quantizers
    pad = _MUSICGEN_CODES
    decoder = MusicgenDecoderConfig(
        vocab_size=_MUSICGEN_CODES,
        max_position_embeddings=256,
        num_hidden_layers=4,
        ffn_dim=64,
        num_attention_heads=4,
        hidden_size=32,
        num_codebooks=_MUSICGEN_CODEBOOKS,
        audio_channels=1,
        pad_token_id=pad,
        bos_token_id=pad,
        decoder_start_token_id=pad,
    )
    config = MusicgenConfig(text_encoder=text, audio_encoder=audio, decoder=decoder, dtype="float32")
    config.decoder_start_token_id = pad
    config.pad_token_id = pad
    torch.manual_seed(seed)
    model = MusicgenForConditionalGeneration(config).to(torch.float32).eval()
    _randomize(model, seed, buffers=("embed",))
    with torch.no_grad():
        # With every weight at std 0.2 the guided codes mostly repeat one code per codebook (the
        # cross-attention, which guidance amplifies, outweighs the code inputs): code embeddings
        # std 1.0 and cross-attention output projections std 0.1 make them vary.
        for embedding in model.decoder.model.decoder.embed_tokens:
            embedding.weight.mul_(_MUSICGEN_EMBED_GAIN)
        for layer in model.decoder.model.decoder.layers:
            layer.encoder_attn.out_proj.weight.mul_(_MUSICGEN_CROSS_GAIN)
        # keep EnCodec's EMA copy equal to the codebook, as a trained one is
        for layer in model.audio_encoder.quantizer.layers:
            layer.codebook.embed_avg.copy_(layer.codebook.embed)
    features = EncodecFeatureExtractor(feature_size=1, sampling_rate=_MUSICGEN_RATE, padding_value=0.0)
    generation = dict(
        decoder_start_token_id=pad,
        bos_token_id=pad,
        pad_token_id=pad,
        guidance_scale=3.0,
        max_new_tokens=8,
        do_sample=False,
    )

    def save_processor(path: str) -> None:
        from transformers import MusicgenProcessor

        MusicgenProcessor(feature_extractor=features, tokenizer=tok).save_pretrained(path)

    return _save(model, out_dir, generation, save_processor)


# --------------------------------------------------------------------------- #
# voxtral


# Tekken's special tokens, at the ranks Voxtral's tekken.json gives them (the
# processor hard-codes the audio placeholder at id 24); the ranks between are
# filled with <SPECIAL_n> by the Tekkenizer itself.
_TEKKEN_SPECIALS = {
    0: "<unk>", 1: "<s>", 2: "</s>", 3: "[INST]", 4: "[/INST]", 5: "[AVAILABLE_TOOLS]", 6: "[/AVAILABLE_TOOLS]",
    7: "[TOOL_RESULTS]", 8: "[/TOOL_RESULTS]", 9: "[TOOL_CALLS]", 10: "[IMG]", 11: "<pad>", 12: "[IMG_BREAK]",
    13: "[IMG_END]", 14: "[PREFIX]", 15: "[MIDDLE]", 16: "[SUFFIX]", 17: "[SYSTEM_PROMPT]", 18: "[/SYSTEM_PROMPT]",
    19: "[TOOL_CONTENT]", 24: "[AUDIO]", 25: "[BEGIN_AUDIO]", 32: "[ARGS]", 33: "[CALL_ID]", 34: "[TRANSCRIBE]",
}
_TEKKEN_NUM_SPECIAL = 40
_TEKKEN_MERGES = 96  # byte-pair merges after the 256 byte tokens
_TEKKEN_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
                   r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+"
                   r"[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # Tekken's own pre-tokenizer pattern
_VOXTRAL_AUDIO_TOKEN = 24
_VOXTRAL_RATE = 16000
_VOXTRAL_MELS = 128
_VOXTRAL_CHUNK_S = 30  # the processor pads every clip to a multiple of 30 s (480 000 samples)
_VOXTRAL_FRAME_RATE = 12.5  # audio tokens per second: 30 s -> 3000 mel frames -> 1500 encoder positions -> 375
_VOXTRAL_EMBED_GAIN = 5.0  # decoder token embeddings: std 1.0 (at 0.2 the answer is one token repeated)


def _tekken_merges(n: int) -> list[bytes]:
    """``n`` byte-pair merges counted on ``_CORPUS`` (split as Tekken's pattern splits it), most frequent pair
    first, ties broken by the pair's bytes: a deterministic, tiny stand-in for Tekken's trained ranks."""
    import regex
    from collections import Counter

    words = Counter(regex.findall(_TEKKEN_PATTERN, _CORPUS))
    split = {w: [bytes([b]) for b in w.encode()] for w in words}
    merges: list[bytes] = []
    while len(merges) < n:
        pairs: Counter = Counter()
        for w, parts in split.items():
            for a, b in zip(parts, parts[1:]):
                pairs[(a, b)] += words[w]
        if not pairs:
            break
        (a, b), _ = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        merges.append(a + b)
        for w, parts in split.items():
            out, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == a and parts[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            split[w] = out
    return merges


def tekken_json() -> dict:
    """A tiny tekken.json (version v11, as Voxtral's): the 256 byte tokens and ``_TEKKEN_MERGES`` merges after
    ``_TEKKEN_NUM_SPECIAL`` special tokens, and Voxtral's audio section (16 kHz, 128 mel bins, hop 160,
    window 400, 12.5 audio tokens per second, clips padded to 30 s)."""
    import base64

    pieces = [bytes([i]) for i in range(256)] + _tekken_merges(_TEKKEN_MERGES)

    def text(b: bytes):
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return None

    vocab = [{"rank": i, "token_bytes": base64.b64encode(b).decode("ascii"), "token_str": text(b)}
             for i, b in enumerate(pieces)]
    specials = [{"rank": r, "token_str": s, "is_control": True} for r, s in sorted(_TEKKEN_SPECIALS.items())]
    specials = _fill_specials(specials)
    return {
        "config": {"pattern": _TEKKEN_PATTERN, "num_vocab_tokens": len(vocab),
                   "default_vocab_size": _TEKKEN_NUM_SPECIAL + len(vocab),
                   "default_num_special_tokens": _TEKKEN_NUM_SPECIAL, "version": "v11"},
        "vocab": vocab,
        "special_tokens": specials,
        "audio": {"sampling_rate": _VOXTRAL_RATE, "frame_rate": _VOXTRAL_FRAME_RATE,
                  "audio_encoding_config": {"num_mel_bins": _VOXTRAL_MELS, "hop_length": 160, "window_size": 400},
                  "chunk_length_s": float(_VOXTRAL_CHUNK_S)},
    }


def _fill_specials(specials: list[dict]) -> list[dict]:
    """The special tokens listed rank by rank: the Tekkenizer numbers them by position in the list, so the
    ranks not named get a ``<SPECIAL_n>`` filler of their own."""
    named = {t["rank"]: t for t in specials}
    return [named.get(r, {"rank": r, "token_str": f"<SPECIAL_{r}>", "is_control": True})
            for r in range(max(named) + 1)]


def build_voxtral(out_dir: str, seed: int = 0) -> str:
    """Voxtral (VoxtralForConditionalGeneration): a Whisper-like audio tower (2 layers, d_model 16, 2 heads,
    128 mel bins, 1500 positions = 30 s), a projector (4 audio frames -> one 32-wide embedding) and a Llama
    decoder (4 layers, hidden 32, 4 heads, 2 key/value heads, FFN 64); the vocabulary is the hand-made
    tekken.json above (``tekken_json``); processor_config.json names VoxtralProcessor with a
    WhisperFeatureExtractor (128 mel bins, 30 s window). Generation: greedy, 8 new tokens.

    Traps: the processor takes audio only through its chat template (``apply_chat_template`` with an audio
    part, then the text; it calls mistral-common, which reads the file); every clip is padded to 30 s, so the
    prompt holds 375 ``[AUDIO]`` placeholders (id 24) after ``[BEGIN_AUDIO]``; the audio tower and the
    projector run inside ``forward`` on the first pass and their output replaces the placeholders'
    embeddings, so the decoder stack (``model.language_model.layers``, ``text_config.num_hidden_layers``)
    sees one ordinary stream; the audio tower's stack is ``model.audio_tower.layers``
    (``audio_config.num_hidden_layers``)."""
    import torch
    from transformers import VoxtralConfig, VoxtralForConditionalGeneration, WhisperFeatureExtractor

    tekken = tekken_json()
    vocab_size = tekken["config"]["default_vocab_size"]
    bos, eos, pad = 1, 2, 11
    config = VoxtralConfig(
        audio_config=dict(model_type="voxtral_encoder", hidden_size=16, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_mel_bins=_VOXTRAL_MELS, max_source_positions=1500,
                          vocab_size=vocab_size),
        text_config=dict(model_type="llama", vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=1024, rope_theta=100000.0, rms_norm_eps=1e-5,
                         bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, tie_word_embeddings=False),
        audio_token_id=_VOXTRAL_AUDIO_TOKEN,
        projector_hidden_act="gelu",
        dtype="float32",
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = VoxtralForConditionalGeneration(config).to(torch.float32).eval()
    _randomize(model, seed, quiet_ids=[eos])
    with torch.no_grad():
        model.model.language_model.embed_tokens.weight.mul_(_VOXTRAL_EMBED_GAIN)
    features = WhisperFeatureExtractor(feature_size=_VOXTRAL_MELS, sampling_rate=_VOXTRAL_RATE, hop_length=160,
                                       chunk_length=_VOXTRAL_CHUNK_S, n_fft=400)
    generation = dict(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, max_new_tokens=8, do_sample=False)

    def save_processor(path: str) -> None:
        with open(os.path.join(path, "tekken.json"), "w") as f:
            json.dump(tekken, f, ensure_ascii=False)
        features.save_pretrained(path)
        with open(os.path.join(path, "processor_config.json"), "w") as f:
            json.dump({"processor_class": "VoxtralProcessor"}, f)

    return _save(model, out_dir, generation, save_processor)


# --------------------------------------------------------------------------- #


BUILDERS = {
    "whisper": build_whisper,
    "musicgen": build_musicgen,
    "voxtral": build_voxtral,
}


def build(name: str, out_dir: str, seed: int = 0) -> str:
    """Write tiny model ``name`` to ``out_dir`` and return the folder."""
    if name not in BUILDERS:
        raise KeyError(f"no tiny model {name!r}; known: {', '.join(BUILDERS)}")
    return BUILDERS[name](str(out_dir), seed=seed)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (2, 3):
        print("usage: python tests/encdec_models.py NAME OUT_DIR [SEED]", file=sys.stderr)
        return 2
    seed = int(argv[2]) if len(argv) == 3 else 0
    print(build(argv[0], argv[1], seed=seed))
    return 0


__all__ = ["NAMES", "BUILDERS", "build", *(f"build_{n}" for n in NAMES)]


if __name__ == "__main__":  # python tests/encdec_models.py NAME OUT_DIR
    sys.exit(main())
