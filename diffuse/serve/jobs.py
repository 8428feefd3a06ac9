"""The video jobs of ``diffuse serve``: each runs in a thread of its own on a ``PipelineEngine``, its progress
kept for ``GET /v1/videos/{id}``, its video kept until deleted or pushed out by newer jobs.
"""

from __future__ import annotations

import threading
import time
import uuid

from diffuse.serve.engines import Cancel, Cancelled
from diffuse.serve.pipeline import Ask
from diffuse.serve.plumbing import ApiError, _as_api_error, log


class Jobs:
    """Video jobs: run one after another in a thread of their own (the pipeline's pool bounds them), kept until
    deleted or until ``keep`` newer ones push them out."""

    def __init__(self, keep: int = 64, max_queued: int = 16):
        self.keep, self.max_queued = keep, max_queued
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()

    def create(self, engine, ask: Ask, size, seconds, request_id: str | None = None) -> "Job":
        with self._lock:
            queued = sum(1 for j in self._jobs.values() if j.status in ("queued", "in_progress"))
            if queued >= self.max_queued:
                raise ApiError(429, f"{queued} video jobs are queued or running, this service's limit",
                               "rate_limit_error", "busy", headers={"Retry-After": "30"})
            job = Job(engine, ask, size, seconds, request_id)
            self._jobs[job.id] = job
            done = [j for j in self._jobs.values() if j.status in ("completed", "failed")]
            for old in done[:max(0, len(self._jobs) - self.keep)]:
                self._jobs.pop(old.id, None)
        threading.Thread(target=job.run, name=f"video-{job.id}", daemon=True).start()
        return job

    def get(self, vid: str) -> "Job":
        job = self._jobs.get(vid)
        if job is None:
            raise ApiError(404, f"no video job {vid!r}", code="video_not_found", param="video_id")
        return job

    def delete(self, vid: str) -> "Job":
        job = self.get(vid)
        job.cancel.set()
        with self._lock:
            self._jobs.pop(vid, None)
        return job

    def all(self) -> list:
        return list(self._jobs.values())

    def stop(self) -> None:
        for job in self.all():
            job.cancel.set()


class Job:
    def __init__(self, engine, ask: Ask, size, seconds, request_id: str | None = None):
        self.id = f"video_{uuid.uuid4().hex[:24]}"
        self.engine, self.ask, self.size, self.seconds = engine, ask, size, seconds
        self.status = "queued"
        self.progress = 0
        self.step = 0
        self.steps = None
        self.created_at = int(time.time())
        self.completed_at = None
        self.error: str | None = None
        self.picture = None
        self.cancel = Cancel(request_id)

    def run(self) -> None:
        def on_step(k, total):
            self.status = "in_progress"
            self.step, self.steps = k, total
            if total:
                self.progress = min(99, int(100 * k / total))

        try:
            self.status = "in_progress"
            self.picture = self.engine.run(self.ask, self.cancel, on_step=on_step)
            self.progress, self.status = 100, "completed"
        except Cancelled:
            self.status, self.error = "failed", "cancelled"
        except BaseException as exc:
            self.status, self.error = "failed", _as_api_error(exc).message
            log.error("video %s failed: %s", self.id, self.error)
        self.completed_at = int(time.time())

    def describe(self) -> dict:
        shape = self.picture.array.shape if self.picture is not None else None
        size = f"{shape[-2]}x{shape[-3]}" if shape is not None else self.size
        frames = shape[-4] if shape is not None and len(shape) >= 4 else self.ask.frames
        return {"id": self.id, "object": "video", "model": self.engine.name, "status": self.status,
                "progress": self.progress, "created_at": self.created_at, "completed_at": self.completed_at,
                "expires_at": None, "size": size, "seconds": str(self.seconds) if self.seconds else None,
                "frames": frames, "step": self.step, "steps": self.steps, "prompt": self.ask.prompt,
                "seed": self.ask.seed,
                "error": {"message": self.error, "code": "generation_failed"} if self.error else None,
                "remixed_from_video_id": None}
