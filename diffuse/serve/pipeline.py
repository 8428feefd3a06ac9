"""The pipeline engine of ``diffuse serve``: a diffusers pipeline's images, videos and sound, one request at a
time per copy of the client ends, with a callback per denoising step; and a video's preview frames as PNG.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from diffuse.errors import DiffuseError
from diffuse.serve.engines import BadRequest, Cancel, Engine, Pool, write_bytes


@dataclass
class Picture:
    data: bytes  # the file: .png, .mp4 or .wav
    suffix: str
    array: object  # the float32 array the pipeline returned
    seconds: float
    steps: int


@dataclass(frozen=True)
class Ask:
    """What one picture (image, video or sound) request asks of a ``PipelineEngine``: the flags of ``diffuse
    query`` of the same names (None: the model's default)."""

    prompt: str
    negative_prompt: str | None = None
    width: int | None = None
    height: int | None = None
    steps: int | None = None
    frames: int | None = None
    seed: int = 0
    patches: int = 1


class PipelineEngine(Engine):
    """A diffusers pipeline: images, videos or sound, one request at a time per copy (default one copy)."""

    def __init__(self, name, info, nodes, split_options, created, parallel: int, max_waiting: int):
        super().__init__(name, info, nodes, split_options, created)
        self.kind = info.output_kind
        self.pool = Pool(self._make, parallel, max_waiting, name)

    def _make(self):
        import diffuse

        return diffuse.from_pretrained(self.info.path, encoders="ring" if self.info.encoders else None,
                                       decoder="ring" if self.info.decoders else None)

    def describe(self) -> dict:
        d = super().describe()
        d["defaults"] = self.info.call_defaults()
        return d

    def run(self, ask: "Ask", cancel: Cancel, on_step=None) -> Picture:
        """The pipeline's call, as ``diffuse query`` makes it for the same flags; ``on_step(i, n)`` after
        each denoising step. Counted in the engine's tally as one request of its kind (an image request for
        ``n`` images counts ``n``)."""
        with self.tally.request(self.kind):
            return self._run(ask, cancel, on_step)

    def _run(self, ask: "Ask", cancel: Cancel, on_step=None) -> Picture:
        import torch

        from diffuse.client.dryrun import call_kwargs
        from diffuse.client.output import output_array
        from diffuse.client.request import PipelineCall

        if not isinstance(ask.prompt, str) or not ask.prompt.strip():
            raise BadRequest("prompt must be a non-empty string", "prompt")
        if ask.patches < 1:
            raise BadRequest("patches must be at least 1", "patches")
        patches = ask.patches
        call = PipelineCall(prompt=ask.prompt, negative_prompt=ask.negative_prompt, steps=ask.steps,
                            height=ask.height, width=ask.width, frames=ask.frames, seed=ask.seed)
        t0 = time.perf_counter()
        pipe = self.pool.take(cancel)
        try:
            try:
                kwargs = call_kwargs(call, pipe, self.info)
            except DiffuseError as exc:
                raise BadRequest(str(exc)) from None
            counter = {"steps": 0}
            sched = pipe.scheduler
            original = sched.step

            import functools

            @functools.wraps(original)
            def step(*args, **kw):
                cancel.check()
                out = original(*args, **kw)
                counter["steps"] += 1
                if on_step is not None:
                    total = len(sched.timesteps) if getattr(sched, "timesteps", None) is not None else None
                    on_step(counter["steps"], total)
                return out

            sched.step = step
            try:
                cancel.check()
                with self.split(pipe, patches=patches, request_id=cancel.request_id):
                    with torch.no_grad():
                        try:
                            result = pipe(**kwargs)
                        except ValueError as exc:  # the pipeline's own refusal of what was asked
                            raise BadRequest(f"{type(pipe).__name__} refuses this request: "
                                             f"{' '.join(str(exc).split())}") from None
            finally:
                del sched.step
                self.tally.stepped(counter["steps"])
        finally:
            self.pool.give(pipe)
        arr = output_array(result)
        rate = kwargs.get("frame_rate") or kwargs.get("fps") or self.info.draft.get("frame_rate")
        suffix = {"image": ".png", "video": ".mp4", "audio": ".wav"}[self.kind]
        sample_rate = self.info.draft.get("sample_rate")
        if self.kind == "audio" and not sample_rate:
            sample_rate = getattr(getattr(pipe, "vae", None), "config", {}).get("sampling_rate")
        data = write_bytes(arr, suffix, kind=self.kind, frame_rate=rate, sample_rate=sample_rate)
        return Picture(data, suffix, arr, time.perf_counter() - t0, counter["steps"])


def preview_png(arr, variant: str) -> bytes:
    """A video's first frame ("thumbnail") or all its frames side by side ("spritesheet"), as PNG."""
    import io

    import numpy as np
    from PIL import Image

    from diffuse.client.writers import to_uint8

    frames = arr[0] if arr.ndim == 5 else arr
    frames = to_uint8(np.asarray(frames))
    img = frames[0] if variant == "thumbnail" else np.concatenate(list(frames), axis=1)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()
