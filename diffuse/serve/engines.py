"""What the service keeps warm for each model: its client ends, the nodes that hold its blocks, and a
bounded queue of requests.

Every request is its own session on the nodes (``diffuse.split`` opens one per request, ~25 ms on
loopback), run in a worker thread on a copy of the model's client ends taken from a pool: a language
model has ``parallel`` copies (concurrent chats, which the nodes batch), a pipeline one (diffusion
requests take turns). A request beyond the pool waits; beyond ``max_waiting`` waiters it is refused
(``Busy``, which the service answers with 429). A request whose ``Cancel`` is set stops at its next
token or step: its split closes, and with it its sessions on the nodes.

This is the engine base and its pool; the engines are ``diffuse.serve.language`` (a transformers model) and
``diffuse.serve.pipeline`` (a diffusers pipeline).
"""

from __future__ import annotations

import os
import queue
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from diffuse.errors import DiffuseError


class Busy(DiffuseError):
    """Every worker of the model is taken and its waiting line is full."""

    outcome = "busy"  # how its request is counted (diffuse.serve.metrics)

    def __init__(self, model: str, waiting: int, retry_after: int):
        super().__init__(f"{model} is busy: {waiting} requests already wait for it; retry in {retry_after} s")
        self.retry_after = retry_after


class Cancelled(Exception):
    """The request's client went away: its work stops at the next token or step."""

    outcome = "cancelled"


class BadRequest(DiffuseError):
    """What the request asks cannot be done with this model (answered with 400)."""

    outcome = "bad_request"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Cancel:
    """Set by the service when the request's client disconnects; checked between tokens and steps. It goes with
    the request's work, and so does the request's id (``request_id``), which its sessions tell the nodes."""

    def __init__(self, request_id: str | None = None):
        self._event = threading.Event()
        self.request_id = request_id

    def set(self) -> None:
        self._event.set()

    def __bool__(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        if self._event.is_set():
            raise Cancelled()


# Loading a copy builds models under patches that are global to the process (weightless construction), and
# opening a split plans and installs stand-ins: both take turns, whatever model they are for.
LOADING = threading.RLock()


@dataclass
class Pool:
    """Copies of a model's client ends, made on first need, at most ``size``, lent one per request."""

    make: object  # () -> a fresh copy
    size: int
    max_waiting: int
    name: str
    _free: queue.Queue = field(default_factory=queue.Queue)
    _made: int = 0
    _waiting: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    busy: int = 0

    def take(self, cancel: Cancel, wait_s: float = 3600.0):
        with self._lock:
            if self._free.empty() and self._made < self.size:
                self._made += 1
                make_one = True
            else:
                make_one = False
                if self._free.empty() and self._waiting >= self.max_waiting:
                    raise Busy(self.name, self._waiting, retry_after=max(1, self.busy))
                self._waiting += 1
        if make_one:
            try:
                with LOADING:
                    copy = self.make()
            except BaseException:
                with self._lock:
                    self._made -= 1
                raise
            with self._lock:
                self.busy += 1
            return copy
        try:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    copy = self._free.get(timeout=0.2)
                    break
                except queue.Empty:
                    cancel.check()
                    if time.monotonic() > deadline:
                        raise Busy(self.name, self._waiting, retry_after=5) from None
        finally:
            with self._lock:
                self._waiting -= 1
        with self._lock:
            self.busy += 1
        return copy

    def prewarm(self) -> None:
        """Make the first copy now."""
        with self._lock:
            if self._made:
                return
            self._made = 1
        with LOADING:
            self._free.put(self.make())

    def give(self, copy) -> None:
        with self._lock:
            self.busy -= 1
        self._free.put(copy)

    @property
    def waiting(self) -> int:
        return self._waiting


@dataclass
class NodeSet:
    """The nodes that hold one model's blocks: started here, or given by address."""

    specs: list[str]  # "ADDRESS#KEY" (or bare addresses, keys pinned on first use)
    local: object = None  # a diffuse.local.nodes.LocalNodes when started here
    # addresses the service's view of the ring finds dead while a live node holds the same blocks: a request's
    # route leaves them out rather than wait for each one's hello to time out (diffuse.serve.ringview)
    down: frozenset = frozenset()

    def usable(self) -> list[str]:
        """The specs a request's route is planned over: all but those found ``down``."""
        from diffuse.client.known_nodes import parse_nodes

        if not self.down:
            return list(self.specs)
        return [spec for spec, (address, _key) in zip(self.specs, parse_nodes(self.specs)) if address not in self.down]

    def stop(self) -> None:
        if self.local is not None:
            self.local.stop()
            self.local = None

    def health(self, timeout_s: float = 2.0) -> list[dict]:
        """Each node's answer to ``status`` (sessions, what it holds; while a node started with ``--blocks`` fetches
        its slice, ``fetch``: bytes done and in all, rate, seconds left, and ``fetching`` in words), or why it did
        not answer."""
        from diffuse.client.known_nodes import parse_nodes
        from diffuse.wire.transport import transport_for

        rows = []
        for address, _key in parse_nodes(self.specs):
            row: dict = {"address": address}
            try:
                st = transport_for(address).request(address, {"op": "status"}, timeout_s)
                row.update(alive=bool(st.get("ok")), sessions=st.get("sessions"), slices=st.get("slices"),
                           max_sessions=st.get("max_sessions"), batches=st.get("batches"),
                           **({"metrics": st["metrics"]} if isinstance(st.get("metrics"), str) else {}))
                if isinstance(st.get("fetch"), dict):  # not serving yet: its slice is still coming
                    from diffuse.plan.fetchprogress import checked_state, fetch_text

                    row.update(fetch=checked_state(st["fetch"]), fetching=fetch_text(st["fetch"]))
            except Exception as exc:  # a dead or frozen node: said so, never raised
                row.update(alive=False, error=" ".join(str(exc).split())[:200] or type(exc).__name__)
            rows.append(row)
        return rows


class Engine:
    """One model the service answers for."""

    kind = "?"  # "chat" | "image" | "video" | "audio" | "transcription" | "speech"

    def __init__(self, name: str, info, nodes: NodeSet, split_options: dict, created: int):
        self.name, self.info, self.nodes = name, info, nodes
        self.split_options = split_options
        self.created = created
        self.pool: Pool | None = None
        self.open_splits: list = []  # the splits of requests running now (their routes: diffuse.serve.ringview)
        self.last_route: tuple = ()  # the route the last finished request's passes took (Stages)
        from diffuse.serve.metrics import EngineTally

        self.tally = EngineTally()  # what its requests did, for GET /metrics (diffuse.serve.metrics)

    @contextmanager
    def split(self, target, **extra):
        """One request's sessions on the nodes, open for the ``with`` block."""
        from diffuse.client.api import Split

        split = Split(target, nodes=self.nodes.usable(), **self.split_options, **extra)
        with LOADING:
            split.__enter__()
        self.tally.opened()
        self.open_splits.append(split)
        try:
            try:
                yield split
            except BaseException as exc:
                split.__exit__(type(exc), exc, exc.__traceback__)
                raise
            split.__exit__(None, None, None)
        finally:
            self.open_splits.remove(split)
            self.last_route = tuple(split.plan.route) if split.plan is not None else self.last_route
            self.tally.closed(split)  # what its ring carried, and its repairs

    def route(self) -> tuple:
        """The route passes take now: the newest running request's (as repaired, if it was), else the last one's;
        () before any request."""
        running = list(self.open_splits)
        plan = running[-1].plan if running else None
        return tuple(plan.route) if plan is not None else self.last_route

    def describe(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "diffuse",
                "kind": self.kind, "path": self.info.path}

    def load_status(self) -> dict:
        p = self.pool
        return {"busy": p.busy if p else 0, "waiting": p.waiting if p else 0, "workers": p.size if p else 0}


def write_bytes(arr, suffix: str, kind: str, frame_rate=None, sample_rate=None) -> bytes:
    """The file the output writers make of ``arr`` (the same bytes ``diffuse query --out`` writes)."""
    from diffuse.plan.plugins import call_hook
    from diffuse.client.writers import OutputInfo

    with tempfile.TemporaryDirectory(prefix="diffuse-serve-") as tmp:
        path = os.path.join(tmp, "out" + suffix)
        info = OutputInfo(kind=kind, frame_rate=frame_rate, sample_rate=sample_rate)
        written = call_hook("diffuse_write_output", result=arr, path=path, info=info)
        if written is None:
            raise DiffuseError(f"no output writer takes {kind} to {suffix}")
        with open(written, "rb") as f:
            return f.read()
