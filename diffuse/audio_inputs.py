"""The client's inputs for a model that listens: a speech recogniser's audio features (``--audio``).

The audio is read here, where it is owned, and turned into the model's input
features by the model's own processor (its feature extractor); only the
encoder's output ever leaves this machine, as hidden states the decoder's
layers attend to.
"""

from __future__ import annotations

import os

from diffuse.errors import DiffuseError


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
