"""A node's metrics: the totals it keeps as it serves (``NodeTally``, also said by its ``status``), and, when it
is started with ``--metrics-port PORT``, an HTTP port answering Prometheus scrapes (``MetricsPort``), bound to
the host of its ``--listen`` (127.0.0.1 for a transport that has no host). Every metric carries the labels
``model`` (the name the service gives it: a Hub id as given, else its folder's name) and ``node`` (its control
address); the table of them all is in ``docs/operating.md``.

The port says only what ``status`` says to anyone who asks (totals, never a session's id, owner or contents),
plus this process's own ``process_*`` figures.
"""

from __future__ import annotations

import logging

from diffuse.plan.metrics import Latency, Tally, family, own_registry

log = logging.getLogger("diffuse.node")

REFUSALS = ("request", "wire", "replay", "client_key", "client_limit", "model", "error", "data_connection",
            "message", "queue_full", "fetching")  # the reasons a node refuses something, as its refusals are counted
EVICTIONS = ("full", "idle", "next_hop")  # why a node ended a session its client had not closed
LOOKS_FRESH_S = 1.0  # how long a node's ``looks`` is said again as it was
MAX_LINKS_SAID = 16  # next hops a status names (the most recently measured)


class NodeTally:
    """What a node has done since it started, kept as it works: passes run (by the compute thread), bytes on
    its hops, seconds busy, sessions opened, refusals and evictions by reason (by the control thread)."""

    def __init__(self):
        self.passes = 0  # calls run through this node's blocks and sent on (answered, or handed to the next hop)
        self.pass_errors = 0  # ... of which the answer was an error
        self.bytes_in = 0  # every data message taken from the hop into this node
        self.bytes_out = 0  # every data message sent to a session's next hop
        self.busy_s = 0.0  # seconds of work on calls (the compute thread's CPU time; an accelerator's own time)
        self.idle_s = 0.0  # seconds the compute thread waited for work (counted as each wait ends)
        self.pass_time = Latency()  # wall seconds from a call's arrival to its result sent
        self.opened = 0
        self.refusals = Tally()  # (reason,) -> count
        self.evictions = Tally()  # (reason,) -> count
        self._look: tuple[float, dict] | None = None  # (when, what) of the last ``looks``

    def refused(self, reason: str) -> None:
        self.refusals.add((reason,))

    def evicted(self, reason: str) -> None:
        self.evictions.add((reason,))

    def passed(self, seconds: float, busy: float, failed: bool) -> None:
        self.passes += 1
        self.pass_errors += failed
        self.busy_s += busy
        self.pass_time.observe(seconds)

    def report(self, node) -> dict:
        """The totals, as ``status`` says them."""
        refusals = {r: int(n) for (r,), n in self.refusals.items()}
        if node.refused_connections:
            refusals["data_connection"] = node.refused_connections
        return {"passes": self.passes, "pass_errors": self.pass_errors, "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out, "busy_s": round(self.busy_s, 6), "pass_s": round(self.pass_time.sum, 6),
                "sessions_opened": self.opened, "refusals": refusals,
                "evictions": {r: int(n) for (r,), n in self.evictions.items()}}

    def looks(self, node, now: float) -> dict:
        """What a service's view of the ring shows of this node, as ``status`` says it: its public key, device,
        memory held (weights, key/value state, buffers) and free, and its links to next hops as last measured.
        Worked out at most once a second (it walks the weights and the sessions), so a flood of status requests
        costs no more than one a second."""
        if self._look is not None and 0 <= now - self._look[0] < LOOKS_FRESH_S:
            return self._look[1]
        from diffuse.plan.reports import node_report

        report = node_report(node)
        with node.next_hops.lock:
            links = {a: round(k.rtt_s, 6) for a, k in list(node.next_hops.seen.items())[-MAX_LINKS_SAID:]}
        look = {"key": node.identity.public_hex, "device": report["device"], "dtype": report["dtype"],
                "memory": {"weights": weight_bytes(node.store), "state": node.state_bytes.total,
                           "buffers": node.sessions.buffer_bytes(), "free": report["memory"].get("available")},
                "links": links}
        self._look = (now, look)
        return look


def weight_bytes(store) -> int:
    """Bytes of the model's weights this node holds (a quantized weight as stored), from the parameters its
    block store read; 0 for a moment while another thread adds to them."""
    from diffuse.plan.quantize import tensor_bytes

    try:
        params = list(store._loaded)
    except RuntimeError:  # added to while read
        return 0
    return sum(tensor_bytes(p) for p in params if p.device.type != "meta")


class NodeCollector:
    """Reads a node's counts at each scrape."""

    def __init__(self, node, model: str):
        self.node = node
        self.labels = ["model", "node"]
        self.values = (model, node.endpoint.control_address)

    def _one(self, kind, name, doc, value, **more):
        return family(kind, name, doc, self.labels + list(more), [((*self.values, *more.values()), value)])

    def _by(self, kind, name, doc, label, counts: dict):
        return family(kind, name, doc, self.labels + [label], [((*self.values, k), v) for k, v in counts.items()])

    def collect(self):
        node, t = self.node, self.node.tally
        report = t.report(node)
        yield self._by("counter", "diffuse_node_passes", "Calls run through this node's blocks and sent on, by "
                       "outcome", "outcome", {"ok": t.passes - t.pass_errors, "error": t.pass_errors})
        yield family("histogram", "diffuse_node_pass_seconds", "Wall seconds from a call's arrival to its result "
                     "sent on", self.labels, [(self.values, t.pass_time)])
        yield self._one("counter", "diffuse_node_busy_seconds", "Seconds of work on calls (busy fraction: its rate)",
                        t.busy_s)
        yield self._one("counter", "diffuse_node_idle_seconds", "Seconds the compute thread waited for work "
                        "(counted as each wait ends)", t.idle_s)
        yield self._by("counter", "diffuse_node_bytes", "Bytes of data messages on this node's hops: in from the "
                       "hop before it, out to the next", "direction", {"in": t.bytes_in, "out": t.bytes_out})
        yield self._one("gauge", "diffuse_node_queue_depth", "Data messages waiting for the compute thread",
                        node.work.qsize())
        yield self._one("gauge", "diffuse_node_sessions", "Sessions open", len(node.sessions))
        yield self._one("gauge", "diffuse_node_sessions_max", "Sessions this node holds at once, at most",
                        node.max_sessions)
        yield self._one("counter", "diffuse_node_sessions_opened", "Sessions opened", t.opened)
        yield self._by("counter", "diffuse_node_evictions", "Sessions this node ended that their client had not "
                       "closed, by reason", "reason", {r: report["evictions"].get(r, 0) for r in EVICTIONS})
        yield self._by("counter", "diffuse_node_refusals", "Requests, connections and messages refused, by reason",
                       "reason", {r: report["refusals"].get(r, 0) for r in REFUSALS})
        yield self._by("gauge", "diffuse_node_memory_bytes", "Bytes held: the model's weights, sessions' "
                       "key/value caches (state), their slot caches and stale buffers (buffers)", "part",
                       {"weights": weight_bytes(node.store), "state": node.state_bytes.total,
                        "buffers": node.sessions.buffer_bytes()})
        with node.next_hops.lock:
            links = dict(node.next_hops.seen)
        yield self._by("gauge", "diffuse_node_link_rtt_seconds", "Round trip to each next hop, as last measured at "
                       "an open", "next", {a: k.rtt_s for a, k in links.items()})
        yield self._by("gauge", "diffuse_node_link_bytes_per_second", "Throughput to each next hop, as last "
                       "measured (absent: quicker than the probe tells)", "next",
                       {a: k.bytes_per_s for a, k in links.items() if k.bytes_per_s})
        fetching = getattr(node, "fetching", None)
        state = fetching.state() if fetching is not None else None
        yield self._by("gauge", "diffuse_node_fetch_bytes", "While --blocks fetches the slice: bytes fetched and in "
                       "all (absent otherwise)", "part",
                       {"done": state["bytes_done"], "total": state["bytes_total"]} if state else {})
        yield self._one("counter", "diffuse_node_batches", "Batches of several sessions' decoding passes run as one",
                        node.batches)
        yield self._one("counter", "diffuse_node_batched_rows", "Rows those batches carried", node.batched_rows)


def metrics_host(listen: str) -> str:
    """Where a node's metrics port binds: the host of its ``--listen`` (every address for ``*``), or
    127.0.0.1 for a transport without one (ipc://)."""
    if not listen.startswith("tcp://"):
        return "127.0.0.1"
    host = listen[6:].rpartition(":")[0].strip("[]")
    return "0.0.0.0" if host in ("*", "") else host


class MetricsPort:
    """A node's metrics port: open from before its blocks load (an empty answer but for ``process_*`` until
    then), its counts added once the node is built (``watch``)."""

    def __init__(self, listen: str, port: int):
        from prometheus_client import start_http_server

        from diffuse.errors import DiffuseError

        self.registry = own_registry(None)
        host = metrics_host(listen)
        try:
            self.server, self.thread = start_http_server(port, host, self.registry)  # a daemon thread
        except OSError as exc:
            raise DiffuseError(f"--metrics-port {port}: cannot listen on {host}:{port} ({exc.strerror or exc})") \
                from None
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.server.server_port}/metrics"
        log.info("metrics at %s", self.url)

    def watch(self, node, model: str) -> None:
        """Answer with ``node``'s counts from now on, labelled ``model`` (``diffuse.plan.resolve.model_name``)."""
        self.registry.register(NodeCollector(node, model))
        node.metrics_url = self.url
