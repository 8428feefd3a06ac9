"""CBOR from peers, decoded within limits checked on the raw bytes first.

``cbor2.loads`` builds whatever the bytes describe: a map of tens of thousands of
keys whose hashes collide (seconds of CPU per message), a structure of shared
references that is small on the wire and endless when walked, string
references, tags that construct arbitrary objects. ``loads`` here first walks the
item heads (no object is built) and refuses, as a WireError, anything beyond its
``Limits``: size, total items, nesting depth, keys per map, map keys that are not
text, indefinite lengths, simple values, and every tag but bignums (2, 3) of a
few bytes. Only what passes is handed to cbor2, and then it is plain data: maps
with text keys, lists, strings, bytes, numbers, booleans and null.
"""

from __future__ import annotations

from dataclasses import dataclass

import cbor2

from diffuse.errors import WireError

_FLOAT_OR_CONSTANT = {20, 21, 22, 23, 25, 26, 27}  # false, true, null, undefined; half, single, double
_BIGNUM_TAGS = {2, 3}
_KINDS = ("int", "int", "bytes", "str", "list", "map", "tagged item", "float or simple value")
_BIGNUM_BYTES = 16  # enough for any integer a message field may hold (counters stop at 2**64)


@dataclass(frozen=True)
class Limits:
    max_bytes: int
    max_items: int  # every item counts: a map of n pairs is 1 + 2n
    max_depth: int  # nested lists/maps
    max_keys: int  # pairs in one map


ENVELOPE = Limits(max_bytes=256, max_items=16, max_depth=2, max_keys=8)
CONTROL = Limits(max_bytes=256 << 10, max_items=4096, max_depth=16, max_keys=64)  # requests, sealed payloads
REPLY = Limits(max_bytes=64 << 20, max_items=1 << 20, max_depth=32, max_keys=4096)  # a node's answers
HEADER = Limits(max_bytes=16 << 20, max_items=1 << 18, max_depth=64, max_keys=4096)  # authenticated data headers


def check(raw: bytes, limits: Limits, what: str = "message") -> None:
    """WireError unless ``raw`` is exactly one CBOR map within ``limits`` (see the module's docstring). One
    loop over the item heads with everything in local names: every data message's header and envelope pass
    here, a few hundred items at most, so the per-item cost is what a message pays."""
    n = len(raw)
    if n > limits.max_bytes:
        raise WireError(f"{what} of {n} bytes is over the {limits.max_bytes}-byte limit")
    if not n or raw[0] & 0x1F > 27 or raw[0] == 0xF8:
        raise WireError(f"{what} is not CBOR")
    if raw[0] >> 5 not in (5, 6):  # (a tag is refused below, by its number)
        raise WireError(f"{what} is a {_KINDS[raw[0] >> 5]}, not a map")
    max_items, max_depth, max_keys = limits.max_items, limits.max_depth, limits.max_keys
    pos = items = 0
    left: list[int] = []  # per open list or map: items still to come
    maps: list[bool] = []  # per open list or map: whether it is a map
    while True:
        while left and left[-1] == 0:
            left.pop()
            maps.pop()
        if items and not left:
            break
        is_key = False
        if left:
            k = left[-1]
            is_key = maps[-1] and not k & 1
            left[-1] = k - 1
        if pos >= n:
            raise WireError(f"{what} is not CBOR (truncated)")
        b = raw[pos]
        major, info = b >> 5, b & 0x1F
        pos += 1
        if info < 24 or info == 31:
            value = info
        elif info > 27:
            raise WireError(f"{what} is not CBOR (a malformed item head)")
        else:
            width = 1 << (info - 24)
            if pos + width > n:
                raise WireError(f"{what} is not CBOR (truncated)")
            value = int.from_bytes(raw[pos:pos + width], "big")
            pos += width
        items += 1
        if items > max_items:
            raise WireError(f"{what} holds more than {max_items} CBOR items")
        if is_key and major != 3:
            raise WireError(f"{what} has a map key that is not text")
        if info == 31:
            raise WireError(f"{what} uses an indefinite-length item")
        if major == 2 or major == 3:
            if value > n - pos:
                raise WireError(f"{what} is not CBOR (truncated: a string runs past its end)")
            pos += value
        elif major == 4 or major == 5:
            count = value * 2 if major == 5 else value
            if major == 5 and value > max_keys:
                raise WireError(f"{what} has a map of more than {max_keys} keys")
            if count > n - pos:  # every item takes at least one byte
                raise WireError(f"{what} is not CBOR (truncated: a {'map' if major == 5 else 'list'} claims {value} entries)")
            if count:
                left.append(count)
                maps.append(major == 5)
                if len(left) > max_depth:
                    raise WireError(f"{what} nests deeper than {max_depth}")
        elif major == 6:
            if value not in _BIGNUM_TAGS or not left:
                raise WireError(f"{what} uses CBOR tag {value}, which is not accepted")
            major, info, value, pos = _head(raw, pos, what)
            if major != 2 or info == 31 or value > _BIGNUM_BYTES or value > n - pos:
                raise WireError(f"{what} has a malformed or oversized big integer")
            pos += value
        elif major == 7 and info not in _FLOAT_OR_CONSTANT:
            raise WireError(f"{what} uses a CBOR simple value, which is not accepted")
    if pos != n:
        raise WireError(f"{what} is not CBOR ({n - pos} bytes after its end)")


def _head(raw: bytes, pos: int, what: str) -> tuple[int, int, int, int]:
    """(major type, additional info, argument, position after the head) of the item at ``pos``."""
    if pos >= len(raw):
        raise WireError(f"{what} is not CBOR (truncated)")
    b = raw[pos]
    major, info = b >> 5, b & 0x1F
    pos += 1
    if info < 24 or info == 31:
        return major, info, info, pos
    if info > 27:
        raise WireError(f"{what} is not CBOR (a malformed item head)")
    width = 1 << (info - 24)
    if pos + width > len(raw):
        raise WireError(f"{what} is not CBOR (truncated)")
    return major, info, int.from_bytes(raw[pos:pos + width], "big"), pos + width


def loads(raw, limits: Limits, what: str = "message") -> dict:
    """The map ``raw`` holds, decoded only after ``check`` passed; WireError otherwise."""
    raw = bytes(raw)
    check(raw, limits, what)
    try:
        value = cbor2.loads(raw)
    except Exception as exc:  # well-formed heads, bad content (e.g. text that is not UTF-8)
        raise WireError(f"{what} is not CBOR: {type(exc).__name__}") from None
    if not isinstance(value, dict):
        raise WireError(f"{what} is not a map")
    return value
