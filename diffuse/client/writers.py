"""Built-in output writers: .png for images, .mp4 for video, .wav for audio.

Registered through the ``diffuse`` entry-point group like any third-party writer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from diffuse.errors import DiffuseError
from diffuse.plan.hookspecs import hookimpl

DEFAULT_FPS = 16


@dataclass
class OutputInfo:
    kind: str  # image | video | audio
    frame_rate: float | None = None
    sample_rate: int | None = None


def to_uint8(a: np.ndarray) -> np.ndarray:
    return (np.clip(a, 0.0, 1.0) * 255.0).round().astype(np.uint8)


def numbered(path: str, i: int, n: int) -> str:
    """``out.png`` for one item; ``out-0.png``, ``out-1.png`` ... for a batch."""
    if n == 1:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}-{i}{ext}"


@hookimpl(trylast=True)
def diffuse_write_output(result, path, info):
    ext = os.path.splitext(path)[1].lower()
    if info.kind == "image" and ext in (".png", ".jpg", ".jpeg", ".webp"):
        from PIL import Image

        batch = result if result.ndim == 4 else result[None]
        for i, img in enumerate(batch):
            Image.fromarray(to_uint8(img)).save(numbered(path, i, len(batch)))
        return path
    if info.kind == "video" and ext in (".mp4", ".gif"):
        import imageio.v2 as imageio

        batch = result if result.ndim == 5 else result[None]
        fps = info.frame_rate or DEFAULT_FPS
        for i, frames in enumerate(batch):
            frames = to_uint8(frames)
            target = numbered(path, i, len(batch))
            if ext == ".mp4":
                # yuv420p needs even sides; macro_block_size=1 keeps tiny videos their own size
                h, w = frames.shape[1:3]
                frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
                imageio.mimwrite(target, list(frames), fps=fps, codec="libx264", macro_block_size=1,
                                 pixelformat="yuv420p")
            else:
                imageio.mimwrite(target, list(frames), duration=1000.0 / fps)
        return path
    if info.kind == "audio" and ext in (".wav", ".flac"):
        import soundfile

        batch = result if result.ndim == 3 else result[None]  # (batch, channels, samples)
        for i, wave in enumerate(batch):
            soundfile.write(numbered(path, i, len(batch)), np.ascontiguousarray(wave.T), int(info.sample_rate or 44100))
        return path
    return None


DEFAULT_SUFFIX = {"image": ".png", "video": ".mp4", "audio": ".wav"}


PROBE_SHAPES = {"image": (1, 8, 8, 3), "video": (1, 2, 8, 8, 3), "audio": (1, 1, 8)}


def check_output_path(out: str | None, draft: dict) -> None:
    """Fail before generating if no writer takes this file name for what the model makes."""
    import tempfile

    from diffuse.plan.plugins import call_hook

    kind = draft.get("output_kind", "image")
    suffix = os.path.splitext(out or "")[1] or DEFAULT_SUFFIX[kind]
    with tempfile.TemporaryDirectory(prefix="diffuse-probe-") as tmp:
        probe = os.path.join(tmp, "probe" + suffix)
        info = OutputInfo(kind=kind, frame_rate=16, sample_rate=8000)
        if call_hook("diffuse_write_output", result=np.zeros(PROBE_SHAPES[kind], np.float32), path=probe,
                     info=info) is None:
            raise DiffuseError(f"--out {out}: this model makes {kind}, and no output writer makes {kind} "
                               f"as {suffix}; use e.g. {DEFAULT_SUFFIX[kind]}")
