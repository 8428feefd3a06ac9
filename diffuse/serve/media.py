"""The picture and sound endpoints of ``diffuse serve``: image generation (whole, or streamed with a progress
event per step), video jobs (create, follow, fetch, cancel; the jobs themselves are ``diffuse.serve.jobs``),
transcription and speech.
"""

from __future__ import annotations

import asyncio
import base64
import os
import tempfile
import time
from dataclasses import replace

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from diffuse.serve.engines import BadRequest
from diffuse.serve.language import LanguageEngine
from diffuse.serve.pipeline import Ask, PipelineEngine, preview_png
from diffuse.serve.plumbing import (ApiError, _as_api_error, _int, _quiet, _sse, cancel_for, find_engine, json_body,
                                    parse_size, request_id, run_in_thread)


def _image_routes(app, service) -> None:
    """Image generation, whole or streamed with a progress event per step."""


    @app.post("/v1/images/generations")
    async def images(request: Request):
        body = await json_body(request)
        e = find_engine(service, body.get("model"), ("image",), "image generation")
        if not isinstance(body.get("prompt"), str):
            raise BadRequest("prompt must be a string", "prompt")
        fmt = body.get("response_format") or "b64_json"
        if fmt != "b64_json":
            raise BadRequest("response_format: b64_json only (this service keeps no files to link to)",
                             "response_format")
        if body.get("output_format") not in (None, "png"):
            raise BadRequest("output_format: png only", "output_format")
        n = _int(body, "n", 1, lo=1)
        if n > 4:
            raise BadRequest("n: at most 4 images per request", "n")
        w, h = parse_size(body.get("size"))
        seed = _int(body, "seed", 0)
        ask = Ask(body["prompt"], body.get("negative_prompt"), width=w, height=h,
                  steps=_int(body, "steps", None, lo=1), seed=seed, patches=_int(body, "patches", 1, lo=1))
        if body.get("stream"):
            return stream_images(request, e, ask, n)
        cancel = cancel_for(request)

        def work():
            return [e.run(replace(ask, seed=seed + i), cancel) for i in range(n)]

        pics = await run_in_thread(request, work, cancel)
        return {"created": int(time.time()), "data": [{"b64_json": base64.b64encode(p.data).decode()} for p in pics],
                "output_format": "png", "size": f"{pics[0].array.shape[-2]}x{pics[0].array.shape[-3]}"}


def stream_images(request, e, ask: Ask, n: int):
    cancel = cancel_for(request)
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()

    def work():
        try:
            for i in range(n):
                def on_step(k, total, i=i):
                    loop.call_soon_threadsafe(q.put_nowait, ("step", (i, k, total)))

                p = e.run(replace(ask, seed=ask.seed + i), cancel, on_step=on_step)
                loop.call_soon_threadsafe(q.put_nowait, ("image", (i, p)))
            loop.call_soon_threadsafe(q.put_nowait, ("end", None))
        except BaseException as exc:
            loop.call_soon_threadsafe(q.put_nowait, ("error", exc))

    async def events():
        worker = loop.run_in_executor(None, work)
        try:
            while True:
                kind, value = await q.get()
                if kind == "step":
                    i, k, total = value
                    yield _sse({"type": "image_generation.progress", "image_index": i, "step": k,
                                "steps": total})
                elif kind == "image":
                    i, p = value
                    yield _sse({"type": "image_generation.completed", "image_index": i,
                                "b64_json": base64.b64encode(p.data).decode(), "output_format": "png",
                                "created_at": int(time.time())})
                elif kind == "end":
                    break
                else:
                    err = _as_api_error(value)
                    yield _sse({"type": "error", "error": {"message": err.message, "type": err.type,
                                                          "param": err.param, "code": err.code}})
                    break
            yield _sse("[DONE]")
        finally:
            cancel.set()
            worker.add_done_callback(_quiet)

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _video_routes(app, service) -> None:
    """Video jobs: create, follow, fetch, cancel."""


    @app.post("/v1/videos")
    async def create_video(request: Request):
        ctype = request.headers.get("content-type", "")
        if ctype.startswith("multipart/form-data") or ctype.startswith("application/x-www-form-urlencoded"):
            form = await request.form()
            body = {k: v for k, v in form.items() if isinstance(v, str)}
        else:
            body = await json_body(request)
        e = find_engine(service, body.get("model"), ("video",), "video generation")
        if not isinstance(body.get("prompt"), str) or not body["prompt"].strip():
            raise BadRequest("prompt must be a non-empty string", "prompt")
        w, h = parse_size(body.get("size"))
        frames = _int(body, "frames", None, lo=1)
        seconds = body.get("seconds")
        if frames is None and seconds not in (None, ""):
            try:
                secs = float(seconds)
            except ValueError:
                raise BadRequest(f"seconds {seconds!r}: a number", "seconds") from None
            fps = e.info.call_defaults().get("frame_rate") or e.info.draft.get("frame_rate") or 16
            frames = max(1, int(round(secs * fps)) + 1)
        ask = Ask(body["prompt"], body.get("negative_prompt"), width=w, height=h, steps=_int(body, "steps", None, lo=1),
                  frames=frames, seed=_int(body, "seed", 0), patches=_int(body, "patches", 1, lo=1))
        job = service.jobs.create(e, ask, size=body.get("size"), seconds=seconds, request_id=request_id(request))
        return job.describe()

    @app.get("/v1/videos")
    async def list_videos():
        return {"object": "list", "data": [j.describe() for j in service.jobs.all()]}

    @app.get("/v1/videos/{vid}")
    async def get_video(vid: str):
        return service.jobs.get(vid).describe()

    @app.delete("/v1/videos/{vid}")
    async def delete_video(vid: str):
        job = service.jobs.delete(vid)
        return {**job.describe(), "deleted": True}

    @app.get("/v1/videos/{vid}/content")
    async def video_content(vid: str, variant: str = "video"):
        job = service.jobs.get(vid)
        if job.status != "completed":
            raise ApiError(409 if job.status != "failed" else 400, f"video {vid} is {job.status}, not completed"
                           + (f": {job.error}" if job.error else ""), code="video_not_ready")
        if variant == "video":
            return Response(job.picture.data, media_type="video/mp4")
        if variant in ("thumbnail", "spritesheet"):
            return Response(preview_png(job.picture.array, variant), media_type="image/png")
        raise BadRequest("variant: video, thumbnail or spritesheet", "variant")


def _audio_routes(app, service) -> None:
    """Transcription and speech."""


    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request):
        form = await request.form()
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise BadRequest("file: the audio to transcribe (multipart)", "file")
        e = find_engine(service, form.get("model"), ("transcription",), "transcription")
        fmt = form.get("response_format") or "json"
        if fmt not in ("json", "text", "verbose_json"):
            raise BadRequest("response_format: json, text or verbose_json", "response_format")
        max_tokens = _int(dict(form), "max_tokens", None, lo=1)  # an extension: the answer's length at most
        suffix = os.path.splitext(upload.filename or "")[1] or ".wav"
        cancel = cancel_for(request)
        with tempfile.TemporaryDirectory(prefix="diffuse-serve-") as tmp:
            path = os.path.join(tmp, "audio" + suffix)
            with open(path, "wb") as f:
                f.write(await upload.read())
            r = await run_in_thread(request, lambda: e.transcribe(path, cancel, max_tokens), cancel)
        if fmt == "text":
            return Response(r.text, media_type="text/plain")
        out = {"text": r.text, "usage": {"type": "tokens", "input_tokens": r.prompt_tokens,
                                         "output_tokens": len(r.tokens), "total_tokens": r.prompt_tokens + len(r.tokens)}}
        if fmt == "verbose_json":
            out.update(task="transcribe", tokens=r.tokens)
        return out

    @app.post("/v1/audio/speech")
    async def speech(request: Request):
        body = await json_body(request)
        kinds = ("speech", "audio")
        e = find_engine(service, body.get("model"), kinds, "speech or sound")
        text = body.get("input")
        if not isinstance(text, str) or not text.strip():
            raise BadRequest("input: the text or description to voice", "input")
        if body.get("response_format") not in (None, "wav"):
            raise BadRequest("response_format: wav only", "response_format")
        cancel = cancel_for(request)
        if isinstance(e, LanguageEngine):
            gen = {"do_sample": False}
            data = await run_in_thread(request, lambda: e.speak(text, gen, _int(body, "seed"), cancel), cancel)
        else:
            assert isinstance(e, PipelineEngine)
            ask = Ask(text, body.get("negative_prompt"), steps=_int(body, "steps", None, lo=1),
                      seed=_int(body, "seed", 0))
            data = (await run_in_thread(request, lambda: e.run(ask, cancel), cancel)).data
        return Response(data, media_type="audio/wav")
