"""What every endpoint of ``diffuse serve`` shares: the service's log, errors in the OpenAI shape (``ApiError``,
and the engines' refusals mapped to their status), the request's JSON body and number fields, the model a request
names, work run in a worker thread that stops when the client goes away, and server-sent events.
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import Request
from fastapi.responses import JSONResponse

from diffuse.errors import DiffuseError
from diffuse.serve.engines import BadRequest, Busy, Cancel, Cancelled

log = logging.getLogger("diffuse.serve")
REQUEST_ID_HEADER = "X-Request-Id"


def request_id(request: Request) -> str | None:
    """The request's id (``diffuse.plan.logs``), as the middleware set it (``diffuse.serve.app``)."""
    return getattr(request.state, "request_id", None)


def cancel_for(request: Request) -> Cancel:
    """The request's ``Cancel``, carrying its id to the work and the sessions it opens."""
    return Cancel(request_id(request))


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


def _quiet(future) -> None:
    """A worker's outcome after its stream is gone: nothing is left to tell it to."""
    if not future.cancelled():
        future.exception()
