"""Byte ranges and digests of the files ``diffuse.plan.fetching`` holds in part or whole."""

from __future__ import annotations

import hashlib
import json
import os

CHUNK = 1 << 20  # bytes read and written at a time
GAP = 0  # ranges this close are fetched as one; none: a node takes no byte of another's tensors


def merged(spans) -> list[list[int]]:
    out: list[list[int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def missing(wanted, held) -> list[list[int]]:
    """The parts of ``wanted`` spans not in ``held`` (both lists of [start, stop)), merged across small gaps."""
    out = []
    held = merged(held)
    for a, b in merged(wanted):
        for ha, hb in held:
            if hb <= a or ha >= b:
                continue
            if ha > a:
                out.append([a, ha])
            a = max(a, hb)
            if a >= b:
                break
        if a < b:
            out.append([a, b])
    joined: list[list[int]] = []
    for a, b in out:
        if joined and a - joined[-1][1] <= GAP:
            joined[-1][1] = b
        else:
            joined.append([a, b])
    return joined


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK * 8), b""):
            h.update(chunk)
    return h.hexdigest()


def _git_blob(path: str) -> str:
    """A file's git blob id (sha1 of ``blob <size>\\0`` and its bytes), as the Hub lists a file kept in git."""
    h = hashlib.sha1(f"blob {os.path.getsize(path)}\0".encode())
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK * 8), b""):
            h.update(chunk)
    return h.hexdigest()


def _range_start(content_range: str | None) -> int | None:
    """The first byte a ``Content-Range: bytes A-B/SIZE`` answer holds."""
    try:
        return int(content_range.split()[1].split("-")[0])
    except (AttributeError, IndexError, ValueError):
        return None


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
