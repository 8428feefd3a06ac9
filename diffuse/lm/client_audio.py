"""The client's inputs for a model that listens (``--audio``): a speech recogniser's audio features, or a
chat model's conversation holding a clip and a question.

The audio is read here, where it is owned, and turned into the model's inputs
by the model's own processor: a speech recogniser's feature extractor, or a
chat model's chat template (one user turn: the audio, then the text), which
puts the audio's placeholder tokens in the prompt and its features beside it.
Only what the audio tower or encoder makes of it ever leaves this machine, as
hidden states.
"""

from __future__ import annotations

import os

from diffuse.errors import DiffuseError

# What a chat template's processor needs beyond transformers to read audio (the Mistral tokenizer and its
# imports), as pip names: installed with --no-deps to leave numpy and the rest as they are.
AUDIO_CHAT_PACKAGES = ("mistral-common", "tiktoken", "jsonschema", "jsonschema-specifications", "referencing",
                       "rpds-py", "attrs", "pydantic-extra-types", "pycountry")


def read_audio(path: str, rate: int):
    """The clip at ``path`` as float32 mono samples at ``rate`` Hz (channels averaged). A clip at another rate is
    refused: resampling changes the samples, and the answer should not depend on a resampler chosen here."""
    import numpy as np
    import soundfile

    if not os.path.isfile(path):
        raise DiffuseError(f"--audio {path}: no such file")
    try:
        samples, found = soundfile.read(path, dtype="float32", always_2d=True)
    except Exception as exc:  # soundfile raises its own error types for unreadable files
        raise DiffuseError(f"--audio {path}: not a sound file soundfile can read ({exc})") from None
    if found != rate:
        raise DiffuseError(f"--audio {path} is sampled at {found} Hz; this model listens at {rate} Hz: convert it "
                           f"first (e.g. ffmpeg -i {os.path.basename(path)} -ar {rate} clip.wav)")
    return np.ascontiguousarray(samples.mean(axis=1), dtype=np.float32)


def build_audio_inputs(model_dir: str, audio: str) -> tuple[dict, str | None]:
    """(``generate``'s inputs for ``audio``, a note or None), through the model's own processor."""
    from transformers import AutoFeatureExtractor, AutoProcessor

    note = None
    try:
        processor = AutoProcessor.from_pretrained(model_dir)
        extractor = getattr(processor, "feature_extractor", processor)
    except Exception as exc:  # a processor that needs a package not installed: its feature extractor alone
        extractor = AutoFeatureExtractor.from_pretrained(model_dir)
        note = f"the model's processor did not build ({type(exc).__name__}); its feature extractor alone made the inputs"
    rate = int(getattr(extractor, "sampling_rate", 16000))
    samples = read_audio(audio, rate)
    features = extractor(samples, sampling_rate=rate, return_tensors="pt")
    return {k: v for k, v in features.items() if hasattr(v, "shape")}, note


def takes_audio_in_chat(config) -> bool:
    """Whether a decoder-only model hears audio through its prompt: an audio tower (``audio_config``) whose
    output takes the place of placeholder tokens (``audio_token_id``/``audio_token_index``)."""
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "audio_config", None) is None:
        return False
    return any(getattr(config, k, None) is not None for k in ("audio_token_id", "audio_token_index"))


def _chat_processor(model_dir: str):
    from transformers import AutoProcessor

    from diffuse.lm.client_loading import _first_line

    try:
        return AutoProcessor.from_pretrained(model_dir)
    except ImportError as exc:
        raise DiffuseError(f"the processor of {model_dir} did not build ({_first_line(exc)}): it needs mistral-common; "
                           f"pip install --no-deps {' '.join(AUDIO_CHAT_PACKAGES)}") from None
    except Exception as exc:
        raise DiffuseError(f"cannot build the processor of {model_dir}: {_first_line(exc)}") from None


def build_audio_chat_inputs(model_dir: str, audio: str, prompt: str) -> dict:
    """``generate``'s inputs for a question about a clip, made by the processor's chat template alone (the only
    way such a processor takes audio): one user turn holding the audio, then the text, with the generation
    prompt. The clip is checked here first (a file soundfile reads, at the feature extractor's rate) so that a
    mistake is one line; the processor then reads it itself."""
    import torch

    from diffuse.lm.client_loading import _first_line

    processor = _chat_processor(model_dir)
    extractor = getattr(processor, "feature_extractor", None)
    read_audio(audio, int(getattr(extractor, "sampling_rate", None) or 16000))
    conversation = [{"role": "user", "content": [{"type": "audio", "path": os.path.abspath(audio)},
                                                 {"type": "text", "text": prompt}]}]
    try:
        out = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                            return_dict=True, return_tensors="pt")
    except Exception as exc:
        raise DiffuseError(f"the {type(processor).__name__} could not take --audio {audio}: {_first_line(exc)}") from None
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
