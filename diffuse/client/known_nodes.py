"""The client's trust in node keys: pinned with the address, or trusted on first use and remembered."""

from __future__ import annotations

import json
import os
import re

from diffuse.errors import DiffuseError, NodeError
from diffuse.home import config_home


def known_nodes_file() -> str:
    return os.path.join(config_home(), "known_nodes.json")


def _read_known(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            known = json.load(f)
    except (OSError, ValueError) as exc:
        raise DiffuseError(f"the known-nodes file {path} cannot be read ({exc}): fix it, or remove it "
                           "(each node's key is then trusted again on first use)") from None
    if not isinstance(known, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in known.items()):
        raise DiffuseError(f"the known-nodes file {path} is damaged (expected a JSON map of node address to hex "
                           "key): fix it, or remove it (each node's key is then trusted again on first use)")
    return known


def known_key(address: str) -> str | None:
    """The key remembered for ``address`` (hex), or None."""
    return _read_known(known_nodes_file()).get(address)


def pin_key(address: str, key: bytes, pinned: str | None) -> None:
    """Check a node's key against the one given with its address, or trust it on first use."""
    if pinned:
        if key.hex() != pinned.lower():
            raise NodeError(address, f"presented key {key.hex()[:16]}..., but {pinned[:16]}... was pinned: "
                            "refusing (wrong node, or someone in between)")
        return
    path = known_nodes_file()
    known = _read_known(path)
    if address in known and known[address] != key.hex():
        raise NodeError(address, f"key changed since first use (known: {known[address][:16]}..., now: "
                        f"{key.hex()[:16]}...); if the node was re-keyed on purpose, remove it from {path}")
    if address not in known:
        import sys

        print(f"node {address}: key {key.hex()[:16]}... trusted on first use and remembered in {path} (pin it "
              f"with {address}#{key.hex()} to check it from the start)", file=sys.stderr, flush=True)
        known[address] = key.hex()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(known, f, indent=1)
        os.replace(tmp, path)


def parse_node(item: str) -> tuple[str, str]:
    """One ``--nodes`` entry, ``SCHEME://WHERE`` optionally followed by ``#KEY`` (64 hex digits),
    checked: (address, key or "")."""
    address, _, key = item.strip().partition("#")
    if "://" not in address or not address.split("://", 1)[1]:
        raise DiffuseError(f"node address {address!r} has no scheme: write it as tcp://HOST:PORT "
                           "(optionally tcp://HOST:PORT#KEY, KEY being the node's public key, to pin it)")
    if address.startswith("tcp://"):
        host, sep, port = address[6:].rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise DiffuseError(f"node address {address!r}: expected tcp://HOST:PORT with a port from 1 to 65535")
    if key and not re.fullmatch(r"[0-9a-fA-F]{64}", key):
        raise DiffuseError(f"node {address}: #{key[:70]} is not a public key (64 hex digits, as the node prints)")
    return address, key


def parse_nodes(spec: str | list) -> list[tuple[str, str]]:
    """``--nodes "tcp://h1:7000#KEY,tcp://h2:7000"`` (or a list of such entries) as checked (address, key) pairs."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = [parse_node(i) for i in items if i.strip()]
    if not out:
        raise DiffuseError("--nodes names no node")
    return out
