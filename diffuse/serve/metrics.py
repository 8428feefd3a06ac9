"""The service's metrics, answered at ``GET /metrics`` in Prometheus' text format (behind the bearer key where
one is set): each engine counts what its requests did (``EngineTally``: outcomes, times to the first token and to
each result, tokens, steps, what the ring carried and repaired), and one collector, registered in the service's
own registry, reads those counts, the engines' queues and the video jobs at each scrape. Every metric carries
the label ``model`` (the name the API gives the model); the table of them all is in ``docs/operating.md``.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from diffuse.plan.metrics import Latency, Tally, family, own_registry

OUTCOMES = ("ok", "bad_request", "busy", "cancelled", "ring_error", "error")


def outcome_of(exc: BaseException) -> str:
    """How a request that raised ``exc`` ended, as its HTTP answer says it (400, 429, 499, 502, 500): the
    engines' own exceptions name theirs (``outcome``)."""
    from diffuse.errors import DiffuseError

    own = getattr(exc, "outcome", None)
    if isinstance(own, str) and own in OUTCOMES:
        return own
    return "ring_error" if isinstance(exc, DiffuseError) else "error"


class EngineTally:
    """What one model's requests have done since the service started, counted by the worker threads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = Tally()  # (kind, outcome) -> requests
        self.first_token = Latency()  # from a text request's start (its wait for a turn included) to its first token
        self.to_result = Latency()  # ... from a request's start to its result: an answer, an image, a video, a sound
        self.prompt_tokens = 0
        self.tokens = 0  # new tokens generated
        self.generating_s = 0.0  # seconds from a generation's session opened to its last token
        self.steps = 0  # denoising steps
        self.ring = Tally()  # ("passes",), ("sent",), ("received",), ("repairs",): the ring as this model's client saw it
        self.sessions = 0  # ring sessions open now (one per request at work)

    @contextmanager
    def request(self, kind: str):
        """Count one request of ``kind`` by how it ends; its time to result when it succeeds."""
        t0, outcome = time.perf_counter(), "ok"
        try:
            yield t0
        except BaseException as exc:
            outcome = outcome_of(exc)
            raise
        finally:
            self.requests.add((kind, outcome))
            if outcome == "ok":
                self.to_result.observe(time.perf_counter() - t0)

    def generated(self, prompt_tokens: int, tokens: int, seconds: float, first_token_s: float | None) -> None:
        with self.lock:
            self.prompt_tokens += prompt_tokens
            self.tokens += tokens
            self.generating_s += seconds
        if first_token_s is not None:
            self.first_token.observe(first_token_s)

    def stepped(self, steps: int) -> None:
        with self.lock:
            self.steps += steps

    def opened(self) -> None:
        with self.lock:
            self.sessions += 1

    def closed(self, split) -> None:
        """A request's sessions closed: what its ring carried and how often it was repaired."""
        with self.lock:
            self.sessions -= 1
        stats = getattr(split, "stats", None)
        if stats is not None:
            self.ring.add(("passes",), stats.passes)
            self.ring.add(("sent",), stats.bytes_sent)
            self.ring.add(("received",), stats.bytes_received)
        self.ring.add(("repairs",), len(getattr(getattr(split, "ring", None), "repairs", None) or ()))


class ServiceCollector:
    """Reads the service's engines, their tallies and queues, and its video jobs at each scrape."""

    def __init__(self, service):
        self.service = service

    def collect(self):
        engines = list(self.service.engines.values())

        def each(kind, name, doc, value_of, labels=("model",)):
            return family(kind, name, doc, list(labels), [((e.name,), value_of(e)) for e in engines])

        rows = {}
        for e in engines:
            rows.update({(e.name, e.kind, "ok"): 0})  # said from the start, at zero
            rows.update({(e.name, *k): n for k, n in e.tally.requests.items()})
        yield family("counter", "diffuse_requests", "Requests a model's engine took, by kind and outcome",
                     ["model", "kind", "outcome"], list(rows.items()))
        yield each("gauge", "diffuse_requests_active", "Requests at work now", lambda e: e.pool.busy)
        yield each("gauge", "diffuse_requests_waiting", "Requests waiting for a turn (the queue's depth; beyond "
                   "--max-waiting they are refused with 429)", lambda e: e.pool.waiting)
        yield each("gauge", "diffuse_workers", "Requests a model answers at once, at most", lambda e: e.pool.size)
        jobs = Tally()
        for j in self.service.jobs.all():
            jobs.add((j.engine.name, j.status))
        yield family("gauge", "diffuse_video_jobs", "Video jobs kept, by status", ["model", "status"], jobs.items())
        yield family("histogram", "diffuse_time_to_first_token_seconds", "Seconds from a text request's start "
                     "(its wait for a turn included) to its first new token", ["model"],
                     [((e.name,), e.tally.first_token) for e in engines])
        yield family("histogram", "diffuse_time_to_result_seconds", "Seconds from a request's start (its wait "
                     "for a turn included) to its result: a whole answer, an image, a video, a sound", ["model"],
                     [((e.name,), e.tally.to_result) for e in engines])
        yield each("counter", "diffuse_prompt_tokens", "Prompt tokens read", lambda e: e.tally.prompt_tokens)
        yield each("counter", "diffuse_generated_tokens", "New tokens generated", lambda e: e.tally.tokens)
        yield each("counter", "diffuse_generation_seconds", "Seconds generating, from a request's session opened to "
                   "its last token (tokens/s: the rate of generated tokens over the rate of this)",
                   lambda e: e.tally.generating_s)
        yield each("counter", "diffuse_denoising_steps", "Denoising steps run", lambda e: e.tally.steps)
        yield each("gauge", "diffuse_ring_sessions", "Sessions open on the model's nodes (one per request at work)",
                   lambda e: e.tally.sessions)
        yield each("counter", "diffuse_ring_passes", "Passes sent around the ring", lambda e: e.tally.ring.get(("passes",)))
        yield family("counter", "diffuse_ring_bytes", "Bytes the service sent to the first node and received from "
                     "the last", ["model", "direction"],
                     [((e.name, d), e.tally.ring.get((d,))) for e in engines for d in ("sent", "received")])
        yield each("counter", "diffuse_ring_repairs", "Routes repaired onto another node after one failed",
                   lambda e: e.tally.ring.get(("repairs",)))


def service_registry(service):
    """The service's own registry: its collector and the process's ``process_*`` figures."""
    return own_registry(ServiceCollector(service))
