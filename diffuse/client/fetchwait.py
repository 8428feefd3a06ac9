"""A node still fetching its slice: the client says so and waits for it.

A node started with ``--blocks`` on a model named by Hub id fetches its slice before it serves; meanwhile its
hello carries ``fetch`` (bytes done and in all, rate, seconds left: ``diffuse.plan.fetchprogress``) and it
refuses opens. The handshake (``diffuse.client.handshake``) then waits here, saying every ``SAY_EVERY_S`` a
line naming the node and how far it got, and asking hello again every ``POLL_S``, until a hello says no more
``fetch``; once the fetch ends the node loads its slice and answers nothing for a while, which is waited for
too. All of it within the client's ``--timeout``: past it, the node is named with where its fetch stood.
"""

from __future__ import annotations

import sys
import time

from diffuse.errors import NodeError
from diffuse.plan.fetchprogress import fetch_text

POLL_S = 1.0  # between two hellos to a node that is fetching
SAY_EVERY_S = 5.0  # between two lines about it


def until_fetched(address: str, hello: dict, ask, wait_s: float, say=None,
                  clock=time.monotonic, sleep=time.sleep) -> tuple[dict, float]:
    """The first hello of the node at ``address`` that says no ``fetch`` (``hello`` is the one that did), and
    its round trip. ``ask(timeout_s)``: a hello again (NodeError where none comes). ``say``: where the lines go
    (default: standard error). NodeError once ``wait_s`` seconds pass with the node still fetching or loading."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    deadline = clock() + wait_s
    said, fetch, silent = None, hello["fetch"], None
    while True:
        now = clock()
        if now >= deadline:
            where = (f"it was fetching its slice ({fetch_text(fetch)})" if silent is None
                     else f"it fetched its slice and has not answered since ({silent})")
            raise NodeError(address, f"not ready after {wait_s:.0f} s (the client's --timeout): {where}; "
                            "run the client again once the node prints its address, or give a longer --timeout")
        if said is None or now - said >= SAY_EVERY_S:
            said = now
            say(f"node {address} is still fetching its slice: {fetch_text(fetch)}; waiting"
                if silent is None else f"node {address} fetched its slice and is loading it; waiting")
        sleep(max(0.0, min(POLL_S, deadline - clock())))
        t0 = clock()
        try:
            again = ask(max(0.5, min(10.0, deadline - t0)))
        except NodeError as exc:  # loading what it fetched: no control request is answered meanwhile
            silent = exc.message
            continue
        rtt = clock() - t0
        if not again.get("ok") or not isinstance(again.get("fetch"), dict):
            return again, rtt
        fetch, silent = again["fetch"], None
