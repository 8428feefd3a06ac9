"""The endpoints of ``diffuse serve`` that generate nothing: the page at ``/`` (its files in ``page/``), the models
(``/v1/models``), the ring's health (``/health``), the ring as the page draws it (``/ring``, and ``/ring/events``
as server-sent events each time it changes: ``diffuse.serve.ringview``) and the metrics (``/metrics``,
``diffuse.serve.metrics``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from fastapi import Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse

from diffuse.serve.plumbing import ApiError, _sse

RING_EVENTS_EVERY_S = 0.2  # how often a stream of the ring looks for a new version of it
RING_KEEPALIVE_S = 15.0  # a stream with nothing new says so this often (a comment line), so proxies keep it open

PAGE = Path(__file__).resolve().parent / "page"


def _info_routes(app, service) -> None:
    """The page, the models, the ring's health, the metrics."""


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

    @app.get("/v1/models/{name:path}")  # a Hub id's name holds a slash: ORG/NAME
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

    @app.get("/ring")
    async def ring():
        return app.state.ring.snapshot()

    @app.get("/ring/events")
    async def ring_events(request: Request):
        view = app.state.ring

        async def events():
            said, quiet_since = -1, time.monotonic()
            while not await request.is_disconnected():
                snap = view.snapshot()
                if snap["version"] != said:
                    said, quiet_since = snap["version"], time.monotonic()
                    yield _sse(snap)
                elif time.monotonic() - quiet_since > RING_KEEPALIVE_S:
                    quiet_since = time.monotonic()
                    yield b": nothing new\n\n"
                await asyncio.sleep(RING_EVENTS_EVERY_S)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/metrics", include_in_schema=False)
    async def metrics():
        from diffuse.plan.metrics import exposition

        body, content_type = exposition(service.registry)
        return Response(body, media_type=content_type)
