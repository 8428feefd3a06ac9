"""Links: the round trip and throughput between two ends of a ring, measured with sealed pings.

At its first hello to a node (and again once ``FRESH_S`` has passed), the client sends the node
``PINGS`` small sealed ``link`` pings and ``PROBES`` of ``PROBE_BYTES`` on one connection
(``measure``); nothing else travels, and the node answers each with the count of bytes it received,
sealed to the asker. The round trip is the quickest small ping after the first (which also pays for the
connection, as a data hop does once); the throughput is a large ping's bytes over the quicker one's time
less that round trip (what sealing and copying the bytes cost counts as the link's: a data hop pays
them too).
When a route is built, each node measures its next hop the same way at ``open`` (the client names the
next node's control address and key inside the sealed open) and says what it found in its reply. The
client keeps both, per pair of ends, in what it has heard of its nodes (``diffuse.client.heard``), for the
planner (a hop costs half its link's round trip plus the bytes it carries over the throughput) and for a
run's summary.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass

from diffuse.wire import sealing
from diffuse.errors import DiffuseError, NodeError, WireError

CLIENT = "client"  # the client's end of a link in the table
PINGS = 4  # small pings; the first also pays for the connection
PROBE_BYTES = 160 << 10  # a large ping's padding (a sealed control payload may hold 256 KiB)
PROBES = 2  # large pings (the quicker counts: on a busy machine one may wait for a core)
FRESH_S = 600.0  # a link measured longer ago than this is measured again at the next hello
TIMEOUT_S = 2.5  # for each ping's answer (a node that does not answer one in time is left unmeasured)
MAX_LINKS = 4096  # links the table keeps (the most recent)


@dataclass(frozen=True)
class Link:
    """One measured link: its round trip, and its throughput (None: quicker than the probe can tell)."""

    rtt_s: float
    bytes_per_s: float | None = None
    at: float = 0.0  # when it was measured (time.monotonic, on the machine that keeps it)

    def hop_s(self, nbytes: int = 0) -> float:
        """One way across it with ``nbytes``: half the round trip, plus the bytes at its throughput."""
        return self.rtt_s / 2 + (nbytes / self.bytes_per_s if self.bytes_per_s else 0.0)

    def to_dict(self) -> dict:
        return {"rtt_s": self.rtt_s, "bytes_per_s": self.bytes_per_s}

    @classmethod
    def from_dict(cls, d) -> "Link | None":
        """A link as a peer described it; None where it is missing or malformed."""
        if not isinstance(d, dict):
            return None
        rtt, bps = d.get("rtt_s"), d.get("bytes_per_s")

        def ok(x):
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0

        if not ok(rtt) or rtt > 600 or not (bps is None or ok(bps)):
            return None
        return cls(float(rtt), float(bps) if bps is not None else None, time.monotonic())

    def describe(self) -> str:
        rate = f"{self.bytes_per_s * 8 / 1e6:,.0f} Mbit/s" if self.bytes_per_s else "quicker than the probe tells"
        return f"{self.rtt_s * 1000:.2f} ms round trip, {rate}"


def _ping(own: sealing.Identity, peer_key: bytes, nbytes: int) -> tuple[dict, bytes]:
    challenge = os.urandom(16)
    payload = {"op": "link", "pad": bytes(nbytes), "challenge": challenge}
    return dict(sealing.seal_control(payload, peer_key, own), op="link"), challenge


def _check(reply: dict, own: sealing.Identity, peer_key: bytes, address: str, nbytes: int, challenge: bytes) -> None:
    if "box" not in reply:
        raise NodeError(address, str(reply.get("error", "refused a link ping"))[:200])
    try:
        inner, sender = sealing.open_control(reply, own)
    except WireError as exc:
        raise NodeError(address, f"its link reply failed to open ({exc})") from None
    if (sender != peer_key or not isinstance(inner, dict) or inner.get("re") != "link" or not inner.get("ok")
            or inner.get("n") != nbytes or inner.get("challenge") != challenge):
        raise NodeError(address, "its link reply does not answer the ping sent")


def measure(transport, address: str, own: sealing.Identity, peer_key: bytes, pings: int = PINGS,
            probe: int = PROBE_BYTES, timeout_s: float = TIMEOUT_S) -> Link:
    """The link to the node at control ``address`` whose key is ``peer_key`` (see the module's docstring);
    NodeError if it does not answer every ping, sealed by that key."""
    sent = [_ping(own, peer_key, 0) for _ in range(pings)] + [_ping(own, peer_key, probe) for _ in range(PROBES)]
    exchange = getattr(transport, "exchange", None)
    if exchange is not None:
        replies = exchange(address, [m for m, _ in sent], timeout_s)
    else:  # each request on its own connection: the round trip includes making it
        replies = []
        for m, _ in sent:
            t0 = time.perf_counter()
            replies.append((transport.request(address, m, timeout_s), time.perf_counter() - t0))
    if len(replies) != len(sent):
        raise NodeError(address, "answered fewer link pings than were sent")
    for (reply, _), (_, challenge), n in zip(replies, sent, [0] * pings + [probe] * PROBES):
        _check(reply, own, peer_key, address, n, challenge)
    times = [t for _, t in replies]
    small = times[1:pings] if exchange is not None and pings > 1 else times[:pings]
    rtt = max(min(small), 1e-6)
    extra = min(times[pings:]) - rtt
    return Link(rtt, probe / extra if extra > 0 else None, time.monotonic())


def route_ends(addresses: list[str]) -> list[tuple[str, str]]:
    """The hops of a route through ``addresses``: the client to the first, node to node, the last home."""
    ends = [CLIENT, *addresses, CLIENT]
    return list(zip(ends, ends[1:]))


class NextHop:
    """A node's measurements of the next hops it was given, kept ``FRESH_S`` per address."""

    def __init__(self):
        self.seen: dict[str, Link] = {}
        self.lock = threading.Lock()

    def measure(self, transport, address, key, own: sealing.Identity) -> Link | None:
        """The link to the next node at control ``address`` with ``key`` (None where either is malformed or the
        next node does not answer)."""
        if not (isinstance(address, str) and 0 < len(address) <= 512 and isinstance(key, bytes)
                and len(key) == sealing.PUBLIC_BYTES):
            return None
        with self.lock:
            link = self.seen.get(address)
        if link is not None and time.monotonic() - link.at <= FRESH_S:
            return link
        try:
            link = measure(transport, address, own, key)
        except (DiffuseError, WireError, ValueError):
            return None
        with self.lock:
            self.seen[address] = link
            while len(self.seen) > 256:
                self.seen.pop(next(iter(self.seen)))
        return link
