"""Prometheus metrics, as both the service (``GET /metrics``, ``diffuse.serve.metrics``) and a node
(``--metrics-port``, ``diffuse.node.metrics``) export them: the counts they keep as they work, and the families a
collector makes of those counts when scraped.

A service or node keeps plain counts (``Tally``: totals by label values; ``Latency``: a histogram's buckets)
in objects it owns, and registers one collector in a ``CollectorRegistry`` of its own (never the library's
global one), which reads them at each scrape: nothing is counted twice, and nothing here is global. Every metric
is listed in ``docs/operating.md``.

>>> t = Tally()
>>> t.add(("chat", "ok")); t.add(("chat", "ok")); t.add(("chat", "busy"))
>>> sorted(t.items())
[(('chat', 'busy'), 1.0), (('chat', 'ok'), 2.0)]
>>> lat = Latency((0.1, 1.0))
>>> lat.observe(0.05); lat.observe(0.5); lat.observe(3.0)
>>> lat.cumulative(), lat.count, lat.sum
([('0.1', 1), ('1.0', 2), ('+Inf', 3)], 3, 3.55)
"""

from __future__ import annotations

import threading

# seconds: from a token's few milliseconds to a video's minutes
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Tally:
    """Totals by a tuple of label values, added to from any thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts: dict[tuple, float] = {}

    def add(self, key: tuple, n: float = 1) -> None:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + float(n)

    def items(self) -> list[tuple[tuple, float]]:
        with self._lock:
            return list(self._counts.items())

    def get(self, key: tuple) -> float:
        with self._lock:
            return self._counts.get(key, 0.0)


class Latency:
    """A histogram's counts (how many observations fell at or under each bound, their sum), kept by hand so that
    an engine or node owns it as it owns its other counts."""

    def __init__(self, bounds: tuple = BUCKETS):
        self.bounds = tuple(bounds)
        self._lock = threading.Lock()
        self._in = [0] * (len(self.bounds) + 1)  # per bucket, the last one past every bound
        self.count = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        k = next((i for i, b in enumerate(self.bounds) if seconds <= b), len(self.bounds))
        with self._lock:
            self._in[k] += 1
            self.count += 1
            self.sum = round(self.sum + seconds, 9)

    def cumulative(self) -> list[tuple[str, int]]:
        """(upper bound, observations at or under it), as the exposition format counts them."""
        with self._lock:
            counts = list(self._in)
        out, total = [], 0
        for bound, n in zip([*map(str, self.bounds), "+Inf"], counts):
            total += n
            out.append((bound, total))
        return out


def family(kind: str, name: str, doc: str, labels: list[str], rows):
    """A metric family of ``kind`` ("counter", "gauge" or "histogram") named ``name`` (a counter's without its
    ``_total``), with one sample per (label values, value) of ``rows`` (a histogram's value: a ``Latency``)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    if kind == "histogram":
        fam = HistogramMetricFamily(name, doc, labels=labels)
        for values, lat in rows:
            fam.add_metric(list(values), lat.cumulative(), lat.sum)
        return fam
    fam = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=labels)
    for values, value in rows:
        fam.add_metric(list(values), float(value))
    return fam


def own_registry(collector):
    """A registry of its own holding ``collector`` and the process's own metrics (resident memory, CPU seconds,
    open files: ``process_*``)."""
    from prometheus_client import CollectorRegistry, ProcessCollector

    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)
    if collector is not None:
        registry.register(collector)
    return registry


def exposition(registry) -> tuple[bytes, str]:
    """What a scrape of ``registry`` answers: the text format, and its content type."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return generate_latest(registry), CONTENT_TYPE_LATEST
