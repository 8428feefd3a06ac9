"""Nodes found on the local network: announced by mDNS / DNS-SD, collected by ``--nodes auto``.

A node started with ``--announce`` registers one service of type ``_diffuse._tcp.local.``: its IPv4
addresses and control port, and a TXT record saying what a client needs to dial it and to check it
(``Announced``): the node's public key, its model's name and content hash, the blocks it holds when
it was started with ``--blocks``, the wire versions it speaks, its data port. The announcement is
withdrawn (goodbye packets) when the node stops.

A client given ``--nodes auto`` listens for a few seconds, prints one line per node it heard, keeps
those that serve its model (the content hash), and goes on exactly as with the same addresses given by
hand: each node's key is checked at hello against the known-nodes file or trusted on first use there
(``diffuse.client.known_nodes``). An announcement only says where to look: a key it carries that differs from
the one remembered for that address is refused before anything is dialled, and one seen for the first
time is trusted no more than a first hello would be. Multicast DNS stays on the local link (routers do
not forward it), so discovery finds nodes on this network only.

Everything here needs the ``zeroconf`` library (``pip install 'diffuse[lan]'``), imported only when a
node announces or a client discovers.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import re
import socket
import threading
import time
from dataclasses import dataclass

from diffuse.errors import DiffuseError

log = logging.getLogger("diffuse.wire.discovery")

SERVICE_TYPE = "_diffuse._tcp.local."
TXT_VERSION = "1"  # the TXT record's own layout, told apart from the wire versions the node speaks
DEFAULT_SECONDS = 3.0
MAX_SECONDS = 600.0  # the longest listening window diffuse.split takes
MAX_FOUND = 64  # announcements kept from one listening window; more are ignored, and said to be
RESOLVE_S = 1.0  # a found service's records, when the browse did not already bring them in
MAX_MODEL_NAME = 100
INSTALL = "pip install 'diffuse[lan]'"
_HEX = re.compile(r"[0-9a-f]+")
_BLOCKS = re.compile(r"[A-Za-z_][\w.]*\[\d+:\d+\](,[A-Za-z_][\w.]*\[\d+:\d+\])*")


def zeroconf_library():
    """The ``zeroconf`` module, or one line saying how to install it."""
    try:
        import zeroconf
    except ImportError:
        raise DiffuseError(f"LAN discovery (--announce, --nodes auto) needs the zeroconf library: {INSTALL}") \
            from None
    return zeroconf


# ---------------------------------------------------------------- what is announced

@dataclass(frozen=True)
class Announced:
    """One node as its announcement describes it; ``properties`` and ``from_record`` are the TXT record's
    two directions, and ``from_record`` checks every field of what a peer sent before any is used."""

    name: str  # the service instance's full name
    addresses: tuple[str, ...]  # IPv4 addresses, as announced
    port: int  # the control port
    key: str  # the node's public key, 64 hex digits
    model: str  # the model's folder name, as the node was given it
    model_hash: str  # diffuse.plan.modelfiles.content_hash of its blocks' component(s)
    blocks: str  # "blocks[0:2]" (several: comma-separated) for a node started with --blocks, else ""
    wire: tuple[int, ...]  # the wire versions it speaks
    data_port: int | None = None

    def properties(self) -> dict[str, str]:
        props = {"txtvers": TXT_VERSION, "key": self.key, "model": self.model[:MAX_MODEL_NAME],
                 "hash": self.model_hash, "wire": ",".join(map(str, self.wire))}
        if self.blocks:
            props["blocks"] = self.blocks
        if self.data_port is not None:
            props["data"] = str(self.data_port)
        return props

    @classmethod
    def from_record(cls, name: str, addresses: list[str], port: int, properties: dict) -> "Announced":
        """From what a browse resolved; ``DiffuseError`` naming the first field that is wrong."""
        p = {_text(k): _text(v) for k, v in list(properties.items())[:32] if k is not None}
        if p.get("txtvers") != TXT_VERSION:
            raise DiffuseError(f"TXT record version {(p.get('txtvers') or '')[:20]!r}, this client reads "
                               f"{TXT_VERSION}")
        key, digest = p.get("key") or "", p.get("hash") or ""
        if len(key) != 64 or not _HEX.fullmatch(key):
            raise DiffuseError("its key is not 64 lower-case hex digits")
        if not 0 < len(digest) <= 64 or not _HEX.fullmatch(digest):
            raise DiffuseError("its model hash is not hex digits")
        model = p.get("model") or ""
        if not 0 < len(model) <= MAX_MODEL_NAME or not model.isprintable():
            raise DiffuseError("its model name is empty, too long or not printable")
        blocks = p.get("blocks") or ""
        if blocks and not _BLOCKS.fullmatch(blocks):
            raise DiffuseError(f"its blocks {blocks[:80]!r} are not STACK[START:STOP],...")
        wire = p.get("wire") or ""
        if not re.fullmatch(r"\d{1,3}(,\d{1,3})*", wire):
            raise DiffuseError(f"its wire versions {wire[:40]!r} are not numbers, comma-separated")
        data = p.get("data")
        if data is not None and not (data.isdigit() and 0 < int(data) < 65536):
            raise DiffuseError(f"its data port {data[:20]!r} is not a port")
        if not 0 < port < 65536:
            raise DiffuseError(f"its port {port} is not a port")
        checked = tuple(str(ipaddress.IPv4Address(a)) for a in addresses[:16])
        if not checked:
            raise DiffuseError("it has no IPv4 address")
        return cls(name, checked, port, key, model, digest, blocks, tuple(sorted({int(v) for v in wire.split(",")})),
                   int(data) if data is not None else None)

    @property
    def address(self) -> str:
        """The control address to dial: the announced address on one of this machine's networks, else the first."""
        return f"tcp://{pick_address(self.addresses)}:{self.port}"

    def first_block(self) -> int:
        """Where its fixed slice starts (a node without one sorts last): fixed nodes go round the ring in order."""
        m = re.search(r"\[(\d+):", self.blocks)
        return int(m.group(1)) if m else 1 << 30

    def line(self) -> str:
        held = self.blocks or "blocks as planned"
        return (f"{self.address}  key {self.key[:16]}...  {self.model} ({held}; wire "
                f"{','.join(map(str, self.wire))})")


def _text(value) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return "" if value is None else str(value)


def local_networks() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks of this machine's interfaces, loopback left out."""
    import ifaddr

    nets = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str) and not ip.ip.startswith("127."):
                nets.append(ipaddress.IPv4Network(f"{ip.ip}/{ip.network_prefix}", strict=False))
    return nets


def pick_address(addresses: tuple[str, ...]) -> str:
    nets = local_networks()
    for a in addresses:
        if any(ipaddress.IPv4Address(a) in n for n in nets):
            return a
    return addresses[0]


# ---------------------------------------------------------------- the node's side

class Announcer:
    """A node's announcement, checked when the flags are (``Announcer(listen)``: the library is there, the
    node listens where other machines reach it), made once it serves (``announced``)."""

    def __init__(self, listen: str):
        self.zc_module = zeroconf_library()
        if not listen.startswith("tcp://"):
            raise DiffuseError(f"--announce: {listen} is not a tcp:// address; other machines reach a node by "
                               "address and port")
        host = listen[6:].rpartition(":")[0].strip("[]")
        if ":" in host:
            raise DiffuseError(f"--announce: {listen}: announcements carry IPv4 addresses; listen on one, or on "
                               "0.0.0.0")
        try:
            self.host = "0.0.0.0" if host in ("*", "0.0.0.0", "") else socket.gethostbyname(host)
        except OSError as exc:
            raise DiffuseError(f"--announce: {listen}: {host} does not resolve to an address ({exc})") from None
        if self.host.startswith("127."):
            raise DiffuseError(f"--announce: this node listens on {listen}, which no other machine reaches: give "
                               "--listen tcp://0.0.0.0:PORT (every interface) or this machine's LAN address")

    def addresses(self) -> list[str]:
        if self.host != "0.0.0.0":
            return [self.host]
        import ifaddr

        found = [ip.ip for adapter in ifaddr.get_adapters() for ip in adapter.ips
                 if isinstance(ip.ip, str) and not ip.ip.startswith("127.")]
        if not found:
            raise DiffuseError("--announce: this machine has no IPv4 address beside loopback to announce")
        return sorted(set(found))

    def record(self, control: str, key: str, model: str, model_hash: str, blocks: str, wire,
               data: str) -> Announced:
        port = int(control.rpartition(":")[2])
        data_port = data.rpartition(":")[2]
        host = socket.gethostname().split(".")[0][:24] or "node"
        name = f"{host}-{port}-{key[:8]}.{SERVICE_TYPE}"
        return Announced(name, tuple(self.addresses()), port, key, model, model_hash, blocks, tuple(wire),
                         int(data_port) if data_port.isdigit() else None)

    def start(self, record: Announced) -> None:
        zc = self.zc_module
        self.zc = zc.Zeroconf(interfaces=zc.InterfaceChoice.All if self.host == "0.0.0.0" else [self.host],
                              ip_version=zc.IPVersion.V4Only)
        self.info = zc.ServiceInfo(SERVICE_TYPE, record.name, port=record.port, properties=record.properties(),
                                   addresses=[socket.inet_aton(a) for a in record.addresses],
                                   server=f"diffuse-{record.key[:12]}.local.")
        try:
            self.zc.register_service(self.info, allow_name_change=True)
        except Exception:
            self.zc.close()
            raise
        log.info("announced on the local network as %r (%s, port %d)", self.info.name,
                 ", ".join(record.addresses), record.port)

    def stop(self) -> None:
        """Withdraw the announcement (goodbye packets), then close the responder."""
        try:
            self.zc.unregister_service(self.info)
            log.info("announcement withdrawn")
        except Exception as exc:  # the node stops all the same
            log.warning("withdrawing the announcement failed: %s", exc)
        finally:
            self.zc.close()


@contextlib.contextmanager
def announced(announcer: Announcer | None, node, model: str, wire):
    """``with announced(announcer, node, model, wire):`` the node is announced while the block runs, and
    withdrawn however it ends (nothing when ``announcer`` is None)."""
    if announcer is None:
        yield
        return
    blocks = ",".join(str(s) for s in node.store.fixed or [])
    announcer.start(announcer.record(node.endpoint.control_address, node.identity.public_hex,
                                     os.path.basename(model.rstrip("/")), node.store.model_hash,
                                     blocks if len(blocks) <= 200 else "", wire, node.data_address))
    try:
        yield
    finally:
        announcer.stop()


# ---------------------------------------------------------------- the client's side
