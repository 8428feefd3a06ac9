"""One data message: a plaintext envelope, a sealed CBOR header, sealed tensor frames.

Frame 0, the envelope, is CBOR ``{"v": the hop's wire version, "s": session id, "c": hop
counter, "n": frame count}``; it is authenticated (as associated data of every
other frame) but not secret, because a node must find the session's key before
it can open anything. Tensors travel as raw bytes in their own dtype, sealed
straight from the tensor's memory; a received tensor is opened straight from
the frame where the transport left it into fresh memory of its own, as a
locally computed one would be (no other copy on either side).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cbor2
import torch

from diffuse.plan.calltree import raw_bytes
from diffuse.errors import MalformedHeader, WireError
from diffuse.plan.contracts import SESSION_ID_BYTES
from diffuse.wire import safecbor
from diffuse.wire import sealing as seal
from diffuse.plan.contracts import is_int

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}




@dataclass
class Hop:
    """The key and counters for one direction of one hop of one session's ring."""

    session: bytes  # 16-byte session id
    key: bytes  # 32-byte XChaCha20-Poly1305 key
    sent: int = 0  # last counter sealed by us
    seen: int = 0  # last counter accepted by us
    wire: int = 1  # the wire version both ends of this hop speak (its envelopes' "v")


COUNTER_LIMIT = 1 << 64  # the nonce holds the counter in 8 bytes
MAX_ENVELOPE_BYTES = 256  # a real envelope is about 40 bytes; nothing larger is decoded
MAX_FRAMES = 1 << 16
MAX_DIMS = 32


def _check_meta(meta) -> tuple[torch.dtype, tuple[int, ...]]:
    """A tensor's description from an (authenticated) header, checked before it is trusted."""
    if not isinstance(meta, dict) or not isinstance(meta.get("dtype"), str) or not isinstance(meta.get("shape"), list):
        raise WireError("malformed tensor description in the header (expected {dtype: str, shape: [int, ...]})")
    dtype = _DTYPES.get(meta["dtype"])
    if dtype is None:
        raise WireError(f"unknown tensor dtype {meta['dtype'][:32]!r} on the wire")
    shape = meta["shape"]
    if len(shape) > MAX_DIMS or not all(is_int(d) and d >= 0 for d in shape):
        raise WireError(f"malformed tensor shape in the header (at most {MAX_DIMS} non-negative integers)")
    return dtype, tuple(shape)


def opened_tensor(hop, counter: int, index: int, raw_env: bytes, dtype: torch.dtype, shape: tuple[int, ...],
                  sealed) -> torch.Tensor:
    """A received tensor frame opened into fresh memory of its own (``sealing.open_frame_into``): the bytes the
    sender's tensor held, in a tensor no frame buffer backs."""
    nbytes = math.prod(shape) * dtype.itemsize
    if len(sealed) != nbytes + seal.TAG_BYTES:  # authenticated first: a frame cut short says it was tampered with
        got = len(seal.open_frame(hop.key, counter, index, raw_env, bytes(sealed)))
        raise WireError(f"tensor frame holds {got} bytes, its header promises {nbytes} "
                        f"for {str(dtype).removeprefix('torch.')}{list(shape)}")
    out = torch.empty(shape, dtype=dtype)
    if nbytes == 0:  # nothing to write: the frame is still authenticated
        seal.open_frame(hop.key, counter, index, raw_env, bytes(sealed))
    else:
        seal.open_frame_into(hop.key, counter, index, raw_env, sealed, out.data_ptr(), nbytes)
    return out


def tensor_meta(t: torch.Tensor) -> dict:
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}


def envelope_of(frames: list[bytes]) -> dict:
    """The plaintext envelope, checked for shape only (it is authenticated later, with the frames)."""
    if not frames:
        raise WireError("empty message")
    raw = bytes(frames[0])
    if len(raw) > MAX_ENVELOPE_BYTES:
        raise WireError(f"envelope of {len(raw)} bytes is too large to be one")
    env = safecbor.loads(raw, safecbor.ENVELOPE, "envelope")
    if not {"v", "s", "c", "n"} <= set(env):
        raise WireError("envelope lacks version, session, counter or frame count")
    if not is_int(env["v"]):
        raise WireError("envelope's wire version is not an integer")
    if not isinstance(env["s"], bytes) or len(env["s"]) != SESSION_ID_BYTES:
        raise WireError(f"envelope's session id is not {SESSION_ID_BYTES} bytes")
    if not is_int(env["c"]) or not 1 <= env["c"] < COUNTER_LIMIT:
        raise WireError("envelope's counter is not an integer in [1, 2**64)")
    if not is_int(env["n"]) or not 2 <= env["n"] <= MAX_FRAMES:
        raise WireError(f"envelope's frame count is not an integer in [2, {MAX_FRAMES}]")
    return env


def seal_message(hop, header: dict, tensors: list[torch.Tensor]) -> list[bytes]:
    if hop.sent + 1 >= COUNTER_LIMIT:
        raise WireError("this hop's counter is spent: open a new session")
    hop.sent += 1
    counter = hop.sent
    header = dict(header, tensors=[tensor_meta(t) for t in tensors])
    env = cbor2.dumps({"v": hop.wire, "s": hop.session, "c": counter, "n": 2 + len(tensors)})
    frames = [env, seal.seal_frame(hop.key, counter, 1, env, cbor2.dumps(header))]
    for i, t in enumerate(tensors):
        frames.append(_sealed_tensor(hop.key, counter, 2 + i, env, t))
    return frames


def _sealed_tensor(key: bytes, counter: int, index: int, env: bytes, t: torch.Tensor) -> bytearray:
    """A tensor's frame: sealed from where its bytes lie when they lie plainly in host memory (contiguous, on
    the CPU, no lazy conjugate or negation), else from ``raw_bytes``; the same bytes either way."""
    nbytes = t.nbytes
    if nbytes and t.is_cpu and t.is_contiguous() and not t.is_conj() and not t.is_neg():
        return seal.seal_frame_at(key, counter, index, env, t.data_ptr(), nbytes)
    return seal.seal_frame_from(key, counter, index, env, raw_bytes(t))


def check_envelope(hop, env: dict, frames: list[bytes]) -> None:
    """What the envelope says against the hop it arrived on: its wire version, session, a counter not yet
    accepted (no replay) and the frame count it has (nothing dropped)."""
    if env["v"] != hop.wire:
        raise WireError(f"wire version {env['v']} is not this hop's ({hop.wire})")
    if env["s"] != hop.session:
        raise WireError("message is for another session")
    if env["c"] <= hop.seen:
        raise WireError(f"replayed or reordered message: counter {env['c']}, last accepted {hop.seen}")
    if len(frames) != env["n"]:
        raise WireError(f"truncated message: {len(frames)} frames, envelope promises {env['n']}")


def open_message(hop, frames: list[bytes], env: dict | None = None, plain: bytes | None = None
                 ) -> tuple[dict, list[torch.Tensor]]:
    """Authenticate before parsing anything but the envelope; enforce the hop counter. ``env``: the envelope
    as ``envelope_of`` read it from these frames already; ``plain``: their header frame as ``sealing.open_frame``
    opened it under this hop's key already (a node's door does both before the message waits for its compute
    thread): neither is done twice. The counter is checked here whatever was given."""
    env = envelope_of(frames) if env is None else env
    check_envelope(hop, env, frames)
    counter = env["c"]
    raw_env = bytes(frames[0])
    if plain is None:
        plain = seal.open_frame(hop.key, counter, 1, raw_env, bytes(frames[1]))
    # authenticated from here on, but still checked: a bug on the sending side must not crash the receiver
    try:
        header = safecbor.loads(plain, safecbor.HEADER, "header")
        metas = header.pop("tensors", [])
        if not isinstance(metas, list):
            raise WireError("header's tensor list is not a list")
        if len(metas) != len(frames) - 2:
            raise WireError(f"header lists {len(metas)} tensors, message carries {len(frames) - 2}")
        checked = [_check_meta(m) for m in metas]  # every description, before any tensor is built
    except WireError as exc:  # authentic, so its counter is spent; its sender is told what is wrong
        hop.seen = counter
        raise MalformedHeader(str(exc)) from None
    tensors = [opened_tensor(hop, counter, 2 + i, raw_env, dtype, shape, f)
               for i, ((dtype, shape), f) in enumerate(zip(checked, frames[2:]))]
    hop.seen = counter  # only a message that opened completely moves the counter
    return header, tensors
