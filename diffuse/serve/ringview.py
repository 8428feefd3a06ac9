"""The ring as the service sees it, live, for its page (``GET /ring``, and ``GET /ring/events``: the same as
server-sent events, one each time it changes).

Every ``POLL_S`` the service asks each node of each model for its ``status`` (all at once, each within
``STATUS_TIMEOUT_S``) and puts together, per model, the chain its passes travel (the route of the request
running now, as repaired if it was, else of the last one) and a row per node: address, key fingerprint, slices,
device, memory held and free, recent pass time, its link to the next hop, and its state:

- ``serving``: in the chain, answering;
- ``slow``: answering, but its status took over ``SLOW_STATUS_S``, or its recent passes cost over
  ``SLOW_FACTOR`` times the quickest node's of the model, per block;
- ``spare``: answering, not in the chain (a replica waiting); ``ready``: answering, before any request;
- ``fetching``: still fetching its slice;
- ``dead``: no answer to status;
- ``replaced``: dead, and a node in the chain holds its blocks now.

A dead node whose blocks a live node holds (a replica) is also left out of the next requests' routes
(``NodeSet.down``), so that no request waits for its hello to time out.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

POLL_S = 1.0  # how often every node is asked for its status
STATUS_TIMEOUT_S = 2.0  # a node that does not answer status within this is dead
SLOW_STATUS_S = 1.0  # a status answer slower than this: the node is slow (starved, swapping, overloaded)
SLOW_FACTOR = 4.0  # recent seconds per pass and block this many times the model's quickest node's: slow
FINGERPRINT_HEX = 16  # hex digits of a node's public key shown (the start of what --nodes ADDR#KEY names)


def _slices_of(status_slices) -> list[tuple[str, int, int]] | None:
    if not isinstance(status_slices, list):
        return None
    out = []
    for s in status_slices[:16]:
        if isinstance(s, dict) and isinstance(s.get("stack"), str) and all(
                isinstance(s.get(k), int) for k in ("start", "stop")):
            out.append((s["stack"][:128], s["start"], s["stop"]))
    return out


def _overlap(a, b) -> bool:
    return any(x[0] == y[0] and x[1] < y[2] and y[1] < x[2] for x in a for y in b)


class NodeWatch:
    """What the service last heard from one node, and what it worked out from it."""

    def __init__(self, address: str, pinned: str):
        self.address, self.pinned = address, pinned  # pinned: the key --nodes gave with its address ("": none)
        self.key = pinned  # the pinned one, else what its status says
        self.key_differs = False  # its status names another key than the pinned one (sessions would refuse it)
        self.alive: bool | None = None  # None: not asked yet
        self.status: dict = {}
        self.status_s: float | None = None
        self.error = ""
        self.slices: list | None = None  # its fixed slices (--blocks), or those the route last gave it
        self.fixed = False
        self.passes, self.pass_s = None, None  # the totals at the last answer
        self.recent_pass_s: float | None = None  # wall seconds per pass, over the passes since the answer before

    def heard(self, status: dict | None, seconds: float, error: str = "") -> None:
        if status is None or not status.get("ok"):
            self.alive, self.error, self.status_s = False, error or str((status or {}).get("error", ""))[:200], None
            return
        self.alive, self.error, self.status, self.status_s = True, "", status, seconds
        about = status.get("about") if isinstance(status.get("about"), dict) else {}
        said = about.get("key")
        if isinstance(said, str):
            self.key = self.pinned or said[:64]
            self.key_differs = bool(self.pinned) and said.lower() != self.pinned.lower()
        fixed = _slices_of(status.get("slices"))
        if fixed:
            self.slices, self.fixed = fixed, True
        totals = status.get("totals") if isinstance(status.get("totals"), dict) else {}
        passes, pass_s = totals.get("passes"), totals.get("pass_s")
        if isinstance(passes, int) and isinstance(pass_s, (int, float)):
            if self.passes is not None and passes > self.passes and pass_s >= self.pass_s:
                self.recent_pass_s = (pass_s - self.pass_s) / (passes - self.passes)
            elif self.passes is not None and passes < self.passes:  # restarted: its counts began again
                self.recent_pass_s = None
            self.passes, self.pass_s = passes, pass_s

    def blocks(self) -> int:
        return sum(stop - start for _, start, stop in self.slices or ())


class RingView:
    """The service's live view of its models' rings; ``start`` polls in a thread of its own until ``stop``."""

    def __init__(self, engines: dict, poll_s: float = POLL_S):
        from diffuse.client.known_nodes import parse_nodes

        self.engines, self.poll_s = engines, poll_s
        self.watches = {name: [NodeWatch(address, key or "") for address, key in parse_nodes(e.nodes.specs)]
                        for name, e in engines.items()}
        self.version = 0
        self._said = ""
        self._snapshot: dict = {"version": 0, "at": None, "poll_s": poll_s, "models": []}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(max_workers=min(16, max(1, sum(map(len, self.watches.values())))),
                                        thread_name_prefix="diffuse-ring-view")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="diffuse-ring-view", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Poll no more (a poll under way ends on its own: its thread is a daemon, and nothing waits for it)."""
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for e in self.engines.values():
            e.nodes.down = frozenset()

    def snapshot(self) -> dict:
        return self._snapshot

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                self.poll()
            except Exception:  # never let the view take the service down; the next poll tries again
                if self._stop.is_set():  # stopped under it: its pool is gone
                    return
                import logging

                logging.getLogger("diffuse.serve").exception("the ring view's poll failed")
            self._stop.wait(max(0.05, self.poll_s - (time.monotonic() - t0)))

    def poll(self) -> None:
        """Ask every node for its status, then say the ring anew (a new version only when something changed)."""
        from diffuse.wire.transport import transport_for

        def ask(w: NodeWatch):
            t0 = time.perf_counter()
            try:
                st = transport_for(w.address).request(w.address, {"op": "status"}, STATUS_TIMEOUT_S)
                w.heard(st if isinstance(st, dict) else None, time.perf_counter() - t0)
            except Exception as exc:  # a dead or frozen node: said so, never raised
                w.heard(None, 0.0, " ".join(str(exc).split())[:200] or type(exc).__name__)

        every = [w for ws in self.watches.values() for w in ws]
        list(self._pool.map(ask, every))
        models = [self._model(name, e, self.watches[name]) for name, e in self.engines.items()]
        said = json.dumps(models, sort_keys=True)
        if said != self._said:
            self._said, self.version = said, self.version + 1
        self._snapshot = {"version": self.version, "at": round(time.time(), 3), "poll_s": self.poll_s,
                          "models": models}

    def _model(self, name: str, e, watches: list[NodeWatch]) -> dict:
        route = e.route()
        chain = [s.address for s in route]
        by = {w.address: w for w in watches}
        for stage in route:  # a node holding nothing fixed holds what the route gave it
            w = by.get(stage.address)
            if w is not None and not w.fixed:
                w.slices = [(s.stack, s.start, s.stop) for s in stage.slices]
        per_block = [w.recent_pass_s / w.blocks() for w in watches if w.alive and w.recent_pass_s and w.blocks()]
        quickest = min(per_block) if len(per_block) > 1 else None
        e.nodes.down = frozenset(w.address for w in watches if w.alive is False and w.fixed and any(
            o.alive and o.fixed and o.slices == w.slices for o in watches))
        return {"name": name, "kind": e.kind, "chain": chain, "links": self._links(chain, by),
                "running": len(e.open_splits), "nodes": [self._row(w, chain, by, quickest) for w in watches]}

    @staticmethod
    def _links(chain: list[str], by: dict) -> list:
        """Milliseconds of round trip of each hop of the chain, client first and back to it: the service's own
        status round trip to the first and last nodes, each node's measured link to the next between them."""
        if not chain:
            return []
        out = []
        first, last = by.get(chain[0]), by.get(chain[-1])
        out.append(_ms(first.status_s) if first else None)
        for a, b in zip(chain, chain[1:]):
            w = by.get(a)
            about = w.status.get("about") if w is not None and isinstance(w.status.get("about"), dict) else {}
            rtt = (about.get("links") or {}).get(b) if isinstance(about.get("links"), dict) else None
            out.append(_ms(rtt) if isinstance(rtt, (int, float)) else None)
        out.append(_ms(last.status_s) if last else None)
        return out

    @staticmethod
    def _row(w: NodeWatch, chain: list[str], by: dict, quickest: float | None) -> dict:
        st = w.status
        about = st.get("about") if isinstance(st.get("about"), dict) else {}
        mem = about.get("memory") if isinstance(about.get("memory"), dict) else {}
        held = sum(v for k, v in mem.items() if k in ("weights", "state", "buffers") and isinstance(v, int)) \
            if mem else None
        replaced_by = None
        if w.alive is None:
            state = "unknown"
        elif not w.alive:
            state = "dead"
            if w.address not in chain and w.slices:
                replaced_by = next((a for a in chain if a in by and by[a].slices and _overlap(by[a].slices, w.slices)),
                                   None)
                state = "replaced" if replaced_by else "dead"
        elif isinstance(st.get("fetch"), dict):
            state = "fetching"
        elif (w.status_s or 0) > SLOW_STATUS_S or (quickest is not None and w.recent_pass_s and w.blocks() and
                                                     w.recent_pass_s / w.blocks() > SLOW_FACTOR * quickest):
            state = "slow"
        else:
            state = "serving" if w.address in chain else "spare" if chain else "ready"
        if not w.alive:  # what it held and how fast it was are no longer so
            mem, held = {}, None
        return {"address": w.address, "key": w.key[:FINGERPRINT_HEX], "key_differs": w.key_differs, "state": state,
                "replaced_by": replaced_by,
                "slices": [f"{s}[{a}:{b}]" for s, a, b in w.slices or ()], "fixed": w.fixed,
                "device": about.get("device"), "dtype": about.get("dtype"),
                "memory": {"held": held, "weights": mem.get("weights"), "state": mem.get("state"),
                           "buffers": mem.get("buffers"), "free": mem.get("free")},
                "pass_ms": _ms(w.recent_pass_s) if w.alive else None, "status_ms": _ms(w.status_s),
                "sessions": st.get("sessions") if w.alive else None, "error": w.error or None,
                "fetching": st.get("fetch") if w.alive and isinstance(st.get("fetch"), dict) else None}


def _ms(seconds) -> float | None:
    return round(1000 * seconds, 2) if isinstance(seconds, (int, float)) else None
