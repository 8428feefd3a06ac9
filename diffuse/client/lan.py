"""Nodes found on the local network for ``--nodes auto``: listening for announcements, and the nodes that serve a model."""

from __future__ import annotations

import logging
import threading
import time

from diffuse.errors import DiffuseError
from diffuse.wire.discovery import (DEFAULT_SECONDS, MAX_FOUND, MAX_SECONDS, RESOLVE_S, SERVICE_TYPE, Announced,
                                    zeroconf_library)

log = logging.getLogger("diffuse.client.lan")


def discover(seconds: float = DEFAULT_SECONDS) -> tuple[list[Announced], list[str]]:
    """Listen ``seconds`` for announced nodes: those heard, and a line for each announcement ignored."""
    zc = zeroconf_library()
    names: dict[str, None] = {}
    lock = threading.Lock()

    def heard(zeroconf, service_type, name, state_change) -> None:
        with lock:
            if state_change is zc.ServiceStateChange.Removed:
                names.pop(name, None)
            elif len(names) < MAX_FOUND:
                names[name] = None

    conf = zc.Zeroconf(ip_version=zc.IPVersion.V4Only)
    try:
        browser = zc.ServiceBrowser(conf, SERVICE_TYPE, handlers=[heard])
        time.sleep(seconds)
        browser.cancel()
        with lock:
            heard_names = list(names)
        found, ignored = [], []
        for name in heard_names:
            info = conf.get_service_info(SERVICE_TYPE, name, timeout=int(RESOLVE_S * 1000))
            if info is None:
                ignored.append(f"  {name}: announced, but its address did not come within {RESOLVE_S:g} s: ignored")
                continue
            try:
                found.append(Announced.from_record(name, info.parsed_addresses(zc.IPVersion.V4Only), info.port or 0,
                                                   info.properties or {}))
            except (DiffuseError, ValueError) as exc:
                ignored.append(f"  {name[:80]!r}: {exc}: ignored")
        return found, ignored
    finally:
        conf.close()


def nodes_for(found: list[Announced], model_hash: str) -> str:
    """The ``--nodes`` list of the announced nodes that serve the model of ``model_hash``: nodes holding fixed
    slices first, in the order of their slices, then the others by address. A key announced for an address
    whose key is remembered otherwise is refused here, as its hello would be; the list carries no key, so
    each hello is checked against the known-nodes file, or trusted on first use, as for an address given by
    hand."""
    from diffuse.client.known_nodes import known_key, known_nodes_file

    mine = sorted((n for n in found if n.model_hash == model_hash), key=lambda n: (n.first_block(), n.address))
    for n in mine:
        known = known_key(n.address)
        if known is not None and known != n.key:
            raise DiffuseError(f"node {n.address} announces key {n.key[:16]}..., but {known[:16]}... is remembered "
                               f"for it in {known_nodes_file()}: refusing (wrong node, or someone in between); if "
                               "the node was re-keyed on purpose, remove it from that file")
    return ",".join(n.address for n in mine)


def heard_nodes(subject, seconds: float | None, say) -> str:
    """The nodes announced on the local network that serve ``subject``'s model (a ``ModelSubject``), heard for
    ``seconds``, one line handed to ``say`` per node heard; from then on the run is the same as with those
    addresses given by hand, keys checked at hello or trusted on first use."""
    return nodes_on_lan([subject.content_hash()], seconds, say)[0]


def nodes_on_lan(model_hashes: list[str], seconds: float | None, say) -> list[str]:
    """``--nodes auto``: listen once, say what was heard (one line a node), and return, for each model hash,
    the ``--nodes`` list of the nodes serving that model; one line refusing where there are none."""
    seconds = DEFAULT_SECONDS if seconds is None else seconds
    zeroconf_library()  # or how to install it, before anything is said
    say(f"--nodes auto: listening {seconds:g} s for nodes announced on the local network")
    found, ignored = discover(seconds)
    for line in ignored:
        say(line)
    for n in found:
        say(f"  found {n.line()}" + ("" if n.model_hash in model_hashes else "  -- another model: not used"))
    return [_serving(found, h, seconds) for h in model_hashes]


def check_auto(nodes, seconds) -> None:
    """``diffuse.split``'s ``nodes="auto"`` and ``discover_seconds``, checked before anything loads: the seconds
    a number above 0 (at most ``MAX_SECONDS``), given only with ``nodes="auto"``, and the library there."""
    if seconds is not None:
        if nodes != "auto":
            raise DiffuseError('discover_seconds applies with nodes="auto"')
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= MAX_SECONDS:
            raise DiffuseError(f"discover_seconds={seconds!r}: a number of seconds above 0, at most {MAX_SECONDS:g}")
    if nodes == "auto":
        zeroconf_library()  # or how to install it, in one line


def auto_nodes(model_hash: str, seconds: float | None, said: list[str]) -> str:
    """``diffuse.split(..., nodes="auto")``: the nodes announced on the local network that serve the model of
    ``model_hash``, as a ``nodes`` list (what ``--nodes auto`` finds); each line it says is logged and appended
    to ``said``."""

    def say(line: str) -> None:
        log.info("%s", line)
        said.append(line)

    return nodes_on_lan([model_hash], seconds, say)[0]


def _serving(found: list[Announced], model_hash: str, seconds: float) -> str:
    spec = nodes_for(found, model_hash)
    if spec:
        return spec
    start = "python -m diffuse.node --model MODEL --listen tcp://0.0.0.0:7000 --announce"
    if not found:
        raise DiffuseError(f"--nodes auto: no node announced itself on this network in {seconds:g} s; start one "
                           f"with `{start}` on a machine of this network, or give --nodes ADDR,...")
    raise DiffuseError(f"--nodes auto: {len(found)} node(s) announced, none serving this model (content hash "
                       f"{model_hash[:12]}...); start one with `{start}` and the same model folder")
