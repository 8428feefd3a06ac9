"""The HTTP side of ``diffuse serve``: OpenAI-shaped endpoints over the engines (``diffuse.serve.engines``).

Errors are ``{"error": {"message", "type", "param", "code"}}`` with the status OpenAI gives them; nothing
raised inside a request reaches the client as a traceback, and the service keeps serving. Work runs in
worker threads; the event loop only waits on it and notices a client that went away (the request is then
cancelled, which closes its sessions on the nodes).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
import logging
import os
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from diffuse.errors import DiffuseError
from diffuse.serve.engines import Ask, BadRequest, Busy, Cancel, Cancelled, LanguageEngine, PipelineEngine, \
    generation_kwargs, preview_png

log = logging.getLogger("diffuse.serve")
PAGE = Path(__file__).resolve().parent / "page"


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers or {}


def error_response(status: int, message: str, type_: str, code=None, param=None, headers=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status, headers=headers)


def _as_api_error(exc: BaseException) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, Busy):
        return ApiError(429, str(exc), "rate_limit_error", "busy", headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, BadRequest):
        return ApiError(400, str(exc), param=exc.param)
    if isinstance(exc, DiffuseError):  # the ring or the model refused: a node lost with no replica, say
        return ApiError(502, str(exc), "server_error", "ring_error")
    return ApiError(500, f"internal error: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
                    "server_error", "internal_error")


class BodyLimit:
    """Refuses a request body over ``limit`` bytes with 413, whether or not it declares its length."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_big = error_response(413, f"the request body is over {self.limit // (1 << 20)} MiB, this service's "
                                 "limit (--max-body-mb)", "invalid_request_error", "body_too_large")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await too_big(scope, receive, send)
        seen = 0
        started = False

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooBig()
            return message

        async def tracked_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted, tracked_send)
        except _TooBig:
            if not started:
                await too_big(scope, receive, send)


class _TooBig(Exception):
    pass


async def run_in_thread(request: Request, fn, cancel: Cancel):
    """``fn()`` in a worker thread; if the client goes away meanwhile, ``cancel`` is set (the work stops at its
    next token or step) and the request ends."""
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(None, fn)
    while True:
        done, _ = await asyncio.wait({future}, timeout=0.25)
        if done:
            return future.result()
        if await request.is_disconnected():
            cancel.set()
            raise Cancelled()


def _sse(data) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def decode_data_url(url: str, what: str) -> bytes:
    if not isinstance(url, str) or not url.startswith("data:") or "," not in url:
        raise BadRequest(f"{what} must be a data URL (data:...;base64,...): this service fetches nothing", "messages")
    head, _, payload = url.partition(",")
    try:
        return base64.b64decode(payload, validate=True) if head.endswith(";base64") else payload.encode()
    except (binascii.Error, ValueError):
        raise BadRequest(f"{what}: the data URL's base64 does not decode", "messages") from None


def parse_size(size, param: str = "size") -> tuple[int | None, int | None]:
    if size in (None, "", "auto"):
        return None, None
    try:
        w, h = (int(x) for x in str(size).lower().split("x"))
    except ValueError:
        raise BadRequest(f"size {size!r}: expected WIDTHxHEIGHT, e.g. 32x32", param) from None
    if w < 1 or h < 1:
        raise BadRequest(f"size {size!r}: both sides must be at least 1", param)
    return w, h


def _int(body: dict, key: str, default=None, lo: int | None = None):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise BadRequest(f"{key} must be a whole number", key)
    try:
        v = int(v)
    except ValueError:
        raise BadRequest(f"{key} must be a whole number", key) from None
    if lo is not None and v < lo:
        raise BadRequest(f"{key} {v}: must be at least {lo}", key)
    return v


def _float(body: dict, key: str):
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest(f"{key} must be a number", key)
    return float(v)


class Messages:
    """OpenAI chat messages as ``diffuse.lm.client_media.chat_inputs`` takes them: images decoded from data URLs
    into the parts they came in, audio written to a file for the model's processor."""

    def __init__(self, raw, tmp: str):
        if not isinstance(raw, list) or not raw:
            raise BadRequest("messages must be a non-empty list", "messages")
        self.images: list = []
        self.audio: str | None = None
        self.messages: list[dict] = []
        for m in raw:
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
                raise BadRequest("each message needs a role of system, user or assistant", "messages")
            role = "system" if m["role"] == "developer" else m["role"]
            content = m.get("content")
            if isinstance(content, str):
                self.messages.append({"role": role, "content": content})
                continue
            if not isinstance(content, list):
                raise BadRequest("a message's content is a string or a list of parts", "messages")
            parts = []
            for p in content:
                kind = p.get("type") if isinstance(p, dict) else None
                if kind == "text" and isinstance(p.get("text"), str):
                    parts.append({"type": "text", "text": p["text"]})
                elif kind == "image_url":
                    url = p.get("image_url", {}).get("url") if isinstance(p.get("image_url"), dict) else p.get("image_url")
                    self.images.append(_image(decode_data_url(url, "image_url")))
                    parts.append({"type": "image"})
                elif kind == "input_audio" and isinstance(p.get("input_audio"), dict):
                    a = p["input_audio"]
                    try:
                        data = base64.b64decode(a.get("data", ""), validate=True)
                    except (binascii.Error, ValueError):
                        raise BadRequest("input_audio.data is not base64", "messages") from None
                    fmt = str(a.get("format") or "wav").lower()
                    if fmt not in ("wav", "mp3", "flac", "ogg"):
                        raise BadRequest(f"input_audio.format {fmt!r}: wav, mp3, flac or ogg", "messages")
                    if self.audio is not None:
                        raise BadRequest("one audio part per request", "messages")
                    self.audio = os.path.join(tmp, "audio." + fmt)
                    with open(self.audio, "wb") as f:
                        f.write(data)
                else:
                    raise BadRequest(f"unsupported content part {kind!r} (text, image_url, input_audio)", "messages")
            if not self.images and all(p["type"] == "text" for p in parts):
                self.messages.append({"role": role, "content": "".join(p["text"] for p in parts)})
            else:
                self.messages.append({"role": role, "content": parts})
        if self.audio is not None:  # the model's processor takes the audio and the text of the one user turn
            self.messages = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
                              "".join(p.get("text", "") for p in m["content"])} for m in self.messages]


def _image(data: bytes):
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (UnidentifiedImageError, OSError):
        raise BadRequest("image_url: not an image this service can read (PNG, JPEG, WebP, GIF)", "messages") from None
    return img.convert("RGB")


def make_app(service) -> FastAPI:
    """``service``: a ``diffuse.serve.Service`` (engines by name, jobs, the API key)."""
    # every request works in a thread, and so does one that waits for a copy of its model: the threads are sized
    # for all of them (the event loop's default would run a handful and leave the rest, /health too, queued)
    workers = sum(e.pool.size + e.pool.max_waiting for e in service.engines.values()) + 16

    @asynccontextmanager
    async def lifespan(_app):
        executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="diffuse-serve")
        asyncio.get_running_loop().set_default_executor(executor)
        yield

    app = FastAPI(title="Diffuse", description="An OpenAI-compatible service over models split across a ring of "
                  "nodes.", version=service.version, docs_url="/docs", redoc_url=None, lifespan=lifespan)
    _error_handlers(app)
    _auth_and_log(app, service)
    _info_routes(app, service)
    _text_routes(app, service)
    _image_routes(app, service)
    _video_routes(app, service)
    _audio_routes(app, service)
    return app


def _error_handlers(app) -> None:
    """Every error in the OpenAI shape; a fault of this service keeps its traceback in the log."""

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.type, exc.code, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return error_response(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}",
                              "invalid_request_error", param=where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error",
                              "not_found" if exc.status_code == 404 else None)

    @app.exception_handler(DiffuseError)
    async def _refused(request, exc: DiffuseError):  # a bad request, a busy model, a ring that failed
        err = _as_api_error(exc)
        if err.status >= 500:
            log.error("%s %s: %s", request.method, request.url.path, err.message)
        return error_response(err.status, err.message, err.type, err.code, err.param, err.headers)

    @app.exception_handler(Exception)
    async def _any(request, exc: Exception):  # a fault of this service: the log keeps its traceback
        err = _as_api_error(exc)
        log.error("%s %s: %s", request.method, request.url.path, err.message)
        return error_response(err.status, err.message, err.type, err.code, err.param, err.headers)


def _auth_and_log(app, service) -> None:
    """The bearer key where one is set; one log line per request (a stream's when it ends)."""

    @app.middleware("http")
    async def _auth_and_log(request: Request, call_next):
        t0 = time.perf_counter()
        path = request.url.path
        if service.api_key and (path.startswith("/v1/") or path == "/health"):
            got = request.headers.get("authorization", "")
            if got != f"Bearer {service.api_key}":
                response = error_response(401, "missing or wrong API key: send Authorization: Bearer KEY",
                                          "invalid_request_error", "invalid_api_key")
                log_line(request, response.status_code, t0)
                return response
        try:
            response = await call_next(request)
        except Cancelled:
            response = Response(status_code=499)
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            inner = response.body_iterator

            async def logged():  # a stream's line says how long the whole answer took
                try:
                    async for part in inner:
                        yield part
                finally:
                    log_line(request, response.status_code, t0, " (stream)")

            response.body_iterator = logged()
        else:
            log_line(request, response.status_code, t0)
        return response


def log_line(request, status, t0, note=""):
    log.info("%s %s %s %.0f ms%s", request.method, request.url.path, status, 1000 * (time.perf_counter() - t0),
             note)


def find_engine(service, name, kinds: tuple[str, ...], what: str):
    """The model a request names (or the first that does ``what``), or the error to answer with."""
    if not name:
        candidates = [e for e in service.engines.values() if e.kind in kinds]
        if not candidates:
            raise ApiError(404, f"no model here does {what}", code="model_not_found", param="model")
        return candidates[0]
    e = service.engines.get(name)
    if e is None:
        raise ApiError(404, f"the model {name!r} does not exist here; see GET /v1/models "
                       f"({', '.join(service.engines)})", code="model_not_found", param="model")
    if e.kind not in kinds:
        raise ApiError(400, f"{name} is a {e.kind} model and does not do {what}", code="wrong_model_kind",
                       param="model")
    return e


async def json_body(request: Request) -> dict:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "the body is not JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    return body


def _info_routes(app, service) -> None:
    """The page, the models, the ring's health."""


    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(PAGE / "index.html", media_type="text/html")

    @app.get("/page/{name}", include_in_schema=False)
    async def page_file(name: str):
        f = PAGE / name
        if "/" in name or not f.is_file():
            raise ApiError(404, f"no such file: {name}", code="not_found")
        types = {".js": "text/javascript", ".css": "text/css"}
        return FileResponse(f, media_type=types.get(f.suffix, "application/octet-stream"))

    # ------------------------------------------------------------------------------------------- models and health

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [e.describe() for e in service.engines.values()]}

    @app.get("/v1/models/{name}")
    async def model(name: str):
        e = service.engines.get(name)
        if e is None:
            raise ApiError(404, f"the model {name!r} does not exist here", code="model_not_found", param="model")
        return e.describe()

    @app.get("/health")
    async def health():
        loop = asyncio.get_running_loop()
        rows = {}
        for name, e in service.engines.items():
            nodes = await loop.run_in_executor(None, e.nodes.health)
            rows[name] = {"kind": e.kind, "nodes": nodes, **e.load_status()}
        ok = all(n["alive"] for r in rows.values() for n in r["nodes"])
        return JSONResponse({"ok": ok, "models": rows, "uptime_s": round(time.time() - service.started, 1)},
                            status_code=200 if ok else 503)


def _text_routes(app, service) -> None:
    """Chat and text completions."""

    def _text_request(body: dict, kinds=("chat",), what="chat"):
        e = find_engine(service, body.get("model"), kinds, what)
        max_tokens = _int(body, "max_completion_tokens") or _int(body, "max_tokens")
        if _int(body, "n", 1) != 1:
            raise BadRequest("n: one answer per request", "n")
        gen = generation_kwargs(max_tokens, _float(body, "temperature"), _float(body, "top_p"),
                                e.default_max_tokens)
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
            raise BadRequest("stop: up to 4 non-empty strings", "stop")
        return TextAsk(e, gen, _int(body, "seed"), stop)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await json_body(request)
        ask = _text_request(body)
        e = ask.engine
        with tempfile.TemporaryDirectory(prefix="diffuse-serve-") as tmp:
            msgs = Messages(body.get("messages"), tmp)
            loop = asyncio.get_running_loop()
            inputs = await loop.run_in_executor(None, e.chat_inputs, msgs.messages, msgs.images, msgs.audio)
        return await answer_text(request, body, replace(ask, inputs=inputs), "chat.completion")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await json_body(request)
        ask = _text_request(body, what="completions")
        e = ask.engine
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise BadRequest("prompt: one non-empty string", "prompt")
        loop = asyncio.get_running_loop()
        inputs = await loop.run_in_executor(None, e.prompt_inputs, prompt)
        return await answer_text(request, body, replace(ask, inputs=inputs), "text_completion")


@dataclass(frozen=True)
class TextAsk:
    """What one chat or completion request asks: its engine, the generation's arguments, seed and stop strings,
    and the model's inputs once made."""

    engine: LanguageEngine
    gen: dict
    seed: int | None
    stop: list
    inputs: dict | None = None

    def generate(self, cancel: Cancel, on_delta=None):
        return self.engine.generate_text(self.inputs, self.gen, self.seed, self.stop, cancel, on_delta)


async def answer_text(request, body, ask: TextAsk, obj: str):
    """A chat ("chat.completion") or text completion ("text_completion"), whole or streamed."""
    e = ask.engine
    rid = f"{'chatcmpl' if obj == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunks = "chat.completion.chunk" if obj == "chat.completion" else obj
        return stream_text(request, ask, rid, chunks, include_usage)
    cancel = Cancel()
    r = await run_in_thread(request, lambda: ask.generate(cancel), cancel)
    choice = {"index": 0, "finish_reason": r.finish_reason, "logprobs": None}
    if obj == "chat.completion":
        choice["message"] = {"role": "assistant", "content": r.text}
    else:
        choice["text"] = r.text
    return {"id": rid, "object": obj, "created": int(time.time()), "model": e.name, "choices": [choice],
            "usage": _usage(r)}


def stream_text(request, ask: TextAsk, rid: str, obj: str, include_usage: bool):
    e = ask.engine
    cancel = Cancel()
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    created = int(time.time())

    def on_delta(text):
        loop.call_soon_threadsafe(q.put_nowait, ("delta", text))

    def work():
        try:
            r = ask.generate(cancel, on_delta)
            loop.call_soon_threadsafe(q.put_nowait, ("done", r))
        except BaseException as exc:  # reported in the stream, never raised into the loop
            loop.call_soon_threadsafe(q.put_nowait, ("error", exc))

    def chunk(delta=None, finish=None, usage=None):
        if obj == "text_completion":
            choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "delta": delta if isinstance(delta, dict) else
                      ({"content": delta} if delta else {}), "finish_reason": finish, "logprobs": None}
        c = {"id": rid, "object": obj, "created": created, "model": e.name, "choices": [choice] if usage is None
             else []}
        if usage is not None:
            c["usage"] = usage
        return _sse(c)

    async def events():
        worker = loop.run_in_executor(None, work)
        try:
            if obj != "text_completion":
                yield chunk({"role": "assistant", "content": ""})
            while True:
                kind, value = await q.get()
                if kind == "delta":
                    yield chunk(value)
                elif kind == "done":
                    yield chunk(finish=value.finish_reason)
                    if include_usage:
                        yield chunk(usage=_usage(value))
                    break
                else:
                    err = _as_api_error(value)
                    if not isinstance(value, Cancelled):
                        log.error("%s stream failed: %s", request.url.path, err.message)
                    yield _sse({"error": {"message": err.message, "type": err.type, "param": err.param,
                                          "code": err.code}})
                    break
            yield _sse("[DONE]")
        finally:  # the stream ended or its client went away: the work stops at its next token, closing its sessions
            cancel.set()
            worker.add_done_callback(_quiet)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


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
        cancel = Cancel()

        def work():
            return [e.run(replace(ask, seed=seed + i), cancel) for i in range(n)]

        pics = await run_in_thread(request, work, cancel)
        return {"created": int(time.time()), "data": [{"b64_json": base64.b64encode(p.data).decode()} for p in pics],
                "output_format": "png", "size": f"{pics[0].array.shape[-2]}x{pics[0].array.shape[-3]}"}


def stream_images(request, e, ask: Ask, n: int):
    cancel = Cancel()
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
        job = service.jobs.create(e, ask, size=body.get("size"), seconds=seconds)
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
        cancel = Cancel()
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
        cancel = Cancel()
        if isinstance(e, LanguageEngine):
            gen = {"do_sample": False}
            data = await run_in_thread(request, lambda: e.speak(text, gen, _int(body, "seed"), cancel), cancel)
        else:
            assert isinstance(e, PipelineEngine)
            ask = Ask(text, body.get("negative_prompt"), steps=_int(body, "steps", None, lo=1),
                      seed=_int(body, "seed", 0))
            data = (await run_in_thread(request, lambda: e.run(ask, cancel), cancel)).data
        return Response(data, media_type="audio/wav")



def _quiet(future) -> None:
    """A worker's outcome after its stream is gone: nothing is left to tell it to."""
    if not future.cancelled():
        future.exception()


def _usage(r) -> dict:
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": len(r.tokens),
            "total_tokens": r.prompt_tokens + len(r.tokens)}


class Jobs:
    """Video jobs: run one after another in a thread of their own (the pipeline's pool bounds them), kept until
    deleted or until ``keep`` newer ones push them out."""

    def __init__(self, keep: int = 64, max_queued: int = 16):
        self.keep, self.max_queued = keep, max_queued
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()

    def create(self, engine, ask: Ask, size, seconds) -> "Job":
        with self._lock:
            queued = sum(1 for j in self._jobs.values() if j.status in ("queued", "in_progress"))
            if queued >= self.max_queued:
                raise ApiError(429, f"{queued} video jobs are queued or running, this service's limit",
                               "rate_limit_error", "busy", headers={"Retry-After": "30"})
            job = Job(engine, ask, size, seconds)
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
    def __init__(self, engine, ask: Ask, size, seconds):
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
        self.cancel = Cancel()

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
