"""The HTTP app of ``diffuse serve``: ``make_app`` puts the endpoints (``diffuse.serve.info``, ``diffuse.serve.chat``,
``diffuse.serve.media``) on one FastAPI app over the engines, with the bearer key, a log line per request, every
error in the OpenAI shape, and ``BodyLimit`` around it.

Errors are ``{"error": {"message", "type", "param", "code"}}`` with the status OpenAI gives them; nothing
raised inside a request reaches the client as a traceback, and the service keeps serving. Work runs in
worker threads; the event loop only waits on it and notices a client that went away (the request is then
cancelled, which closes its sessions on the nodes).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from diffuse.errors import DiffuseError
from diffuse.serve.chat import _text_routes
from diffuse.serve.engines import Cancelled
from diffuse.serve.info import _info_routes
from diffuse.serve.media import _audio_routes, _image_routes, _video_routes
from diffuse.plan.logs import clean_request_id
from diffuse.serve.plumbing import REQUEST_ID_HEADER, ApiError, _as_api_error, error_response, log, request_id


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


def make_app(service) -> FastAPI:
    """``service``: a ``diffuse.serve.command.Service`` (engines by name, jobs, the API key)."""
    # every request works in a thread, and so does one that waits for a copy of its model: the threads are sized
    # for all of them (the event loop's default would run a handful and leave the rest, /health too, queued)
    workers = sum(e.pool.size + e.pool.max_waiting for e in service.engines.values()) + 16

    @asynccontextmanager
    async def lifespan(_app):
        executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="diffuse-serve")
        asyncio.get_running_loop().set_default_executor(executor)
        view.start()
        try:
            yield
        finally:
            view.stop()

    app = FastAPI(title="Diffuse", description="An OpenAI-compatible service over models split across a ring of "
                  "nodes.", version=service.version, docs_url="/docs", redoc_url=None, lifespan=lifespan)
    from diffuse.serve.ringview import RingView

    view = app.state.ring = RingView(service.engines)  # what the page draws: the nodes' status, polled
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
            log.error("%s %s: %s", request.method, request.url.path, err.message, extra=_failed(request, err))
        return error_response(err.status, err.message, err.type, err.code, err.param, err.headers)

    @app.exception_handler(Exception)
    async def _any(request, exc: Exception):  # a fault of this service: the log keeps its traceback
        err = _as_api_error(exc)
        log.error("%s %s: %s", request.method, request.url.path, err.message, extra=_failed(request, err))
        return error_response(err.status, err.message, err.type, err.code, err.param, err.headers)


def _failed(request, err) -> dict:
    """A failed request's log fields."""
    return {"event": "request_failed", "request_id": request_id(request), "status": err.status, "code": err.code}


def _auth_and_log(app, service) -> None:
    """The bearer key where one is set; one log line per request (a stream's when it ends)."""

    @app.middleware("http")
    async def _auth_and_log(request: Request, call_next):
        t0 = time.perf_counter()
        path = request.url.path
        # the request's id: the caller's X-Request-Id when it is short and plain, else a new one; it ties the
        # service's, the client's and the nodes' lines of this request together (diffuse.plan.logs)
        rid = request.state.request_id = clean_request_id(request.headers.get(REQUEST_ID_HEADER)) or uuid.uuid4().hex
        if service.api_key and (path.startswith("/v1/") or path in ("/health", "/metrics", "/ring", "/ring/events")):
            got = request.headers.get("authorization", "")
            if got != f"Bearer {service.api_key}":
                response = error_response(401, "missing or wrong API key: send Authorization: Bearer KEY",
                                          "invalid_request_error", "invalid_api_key")
                response.headers[REQUEST_ID_HEADER] = rid
                log_line(request, response.status_code, t0)
                return response
        try:
            response = await call_next(request)
        except Cancelled:
            response = Response(status_code=499)
        response.headers[REQUEST_ID_HEADER] = rid
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
    ms = 1000 * (time.perf_counter() - t0)
    log.info("%s %s %s %.0f ms%s", request.method, request.url.path, status, ms, note, extra={
        "event": "request", "request_id": request_id(request), "method": request.method, "path": request.url.path,
        "status": status, "ms": round(ms, 1)})
