"""What a client has heard of its nodes: each node's last hello (its ``NodeReport``) and the links measured.

The handshake notes every hello (``note_hello``) and every link, the client's own to a node measured at its
first hello and each node's to its next hop said at open (``note_link``); the planner reads them
(``report_of``, ``link``: ``diffuse.client.routing``) and a run's summary prints them (``route_lines``). One
``Heard`` belongs to whoever opens rings: a ``diffuse.split`` makes its own, a service one for its models,
so two of them in one process never see each other's nodes. Both tables are bounded, oldest out first.
It also keeps the block costs placement read from a model's headers (``costs``), so a repair plans
without reading them again.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from diffuse.errors import DiffuseError, WireError
from diffuse.plan.reports import MAX_REPORTS, REPORT_FRESH_S, NodeReport
from diffuse.wire import sealing
from diffuse.wire.links import CLIENT, FRESH_S, MAX_LINKS, Link, measure, route_ends


class Heard:
    def __init__(self, max_reports: int = MAX_REPORTS, max_links: int = MAX_LINKS):
        self.max_reports, self.max_links = max_reports, max_links
        self._reports: OrderedDict[str, NodeReport] = OrderedDict()
        self._links: OrderedDict[tuple[str, str], Link] = OrderedDict()
        self._lock = threading.Lock()
        self.costs: dict = {}  # the block costs read for placement, by model, stacks and dtype (block_costs)

    def note_hello(self, address: str, hello: dict, rtt_s: float | None = None) -> None:
        """Remember what a node's hello said of it (the handshake calls this for every hello)."""
        report = NodeReport.from_hello(address, hello, rtt_s)
        if report is not None:
            self._keep(self._reports, address, report, self.max_reports)

    def report_of(self, address: str) -> NodeReport | None:
        """The node's latest report, if it came in the last ``REPORT_FRESH_S``."""
        with self._lock:
            r = self._reports.get(address)
        return r if r is not None and time.monotonic() - r.at <= REPORT_FRESH_S else None

    def ask(self, address: str, timeout_s: float = 10.0) -> NodeReport | None:
        """A plain hello to the node at ``address`` now (no session, nothing sealed), noted and returned: what
        it says of its memory, what it holds, its device and the speeds it measured."""
        from diffuse.plan.contracts import WIRE_VERSIONS
        from diffuse.wire.transport import transport_for

        self.note_hello(address, transport_for(address).request(address, {"op": "hello", "wire": list(WIRE_VERSIONS)},
                                                                timeout_s))
        return self.report_of(address)

    def note_link(self, src: str, dst: str, link: Link | None) -> None:
        """Keep ``link`` as the one from ``src`` to ``dst`` (addresses, or ``CLIENT``)."""
        if link is not None:
            self._keep(self._links, (src, dst), link, self.max_links)

    def link(self, src: str, dst: str, fresh_s: float = FRESH_S) -> Link | None:
        """The link from ``src`` to ``dst`` measured in the last ``fresh_s``; a client's link is taken as the
        same both ways."""
        now = time.monotonic()
        with self._lock:
            for key in ((src, dst), (dst, src)) if CLIENT in (src, dst) else ((src, dst),):
                link = self._links.get(key)
                if link is not None and now - link.at <= fresh_s:
                    return link
        return None

    def client_link(self, transport, address: str, own: sealing.Identity, peer_key: bytes) -> Link | None:
        """The client's link to a node, measured unless a fresh one is known; None where the node does not
        take link pings (an older node) or does not answer them."""
        link = self.link(CLIENT, address)
        if link is not None:
            return link
        try:
            link = measure(transport, address, own, peer_key)
        except (DiffuseError, WireError):
            return None
        self.note_link(CLIENT, address, link)
        return link

    def route_lines(self, addresses: list[str]) -> list[str]:
        """Each hop of a route with its link as measured (or "not measured")."""
        out = []
        for src, dst in route_ends(addresses):
            link = self.link(src, dst)
            out.append(f"{src} -> {dst}: {link.describe() if link else 'not measured'}")
        return out

    def _keep(self, table: OrderedDict, key, value, most: int) -> None:
        with self._lock:
            table.pop(key, None)
            table[key] = value
            while len(table) > most:
                table.popitem(last=False)
