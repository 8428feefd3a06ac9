"""Sealing with libsodium: node identities, sealed control payloads, per-hop AEAD.

This is core, not transport: a transport moves bytes; what they mean and who may
read them is decided here, the same for every transport.

Data frames use XChaCha20-Poly1305 under a per-session, per-hop key. The nonce
is derived from the hop counter and the frame index (each key seals in one
direction only, so the pair never repeats under one key); the plaintext
envelope (version, session, counter, frame count) is bound into every frame as
associated data, so a frame moved, dropped, replayed or edited fails to open.

Hop keys reach a node in its sealed ``open``. Wire version 1 carries them in a
``crypto_box`` between the client's and the node's long-term keys, so whoever
later learns the node's secret key opens every recorded session. Version 2
carries them under a key agreed for that open alone (``agree``): X25519 between
a fresh key of the client and a fresh key of the node (libsodium's ``crypto_kx``),
mixed with the two static-ephemeral products, so only the holders of the
client's and the node's long-term keys can compute it, and once both fresh
secrets are dropped nobody can, whatever long-term secrets leak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
from dataclasses import dataclass

from diffuse.errors import DiffuseError, WireError

if ctypes.util.find_library("sodium") is None:  # pysodium would fail with a bare OSError
    raise DiffuseError(
        "libsodium is not installed: Diffuse seals every frame with it. "
        "On Debian/Ubuntu: apt-get install libsodium23; on macOS: brew install libsodium"
    )

import pysodium  # noqa: E402

KEY_BYTES = pysodium.crypto_aead_xchacha20poly1305_ietf_KEYBYTES
PUBLIC_BYTES = pysodium.crypto_box_PUBLICKEYBYTES
BOX_NONCE_BYTES = pysodium.crypto_box_NONCEBYTES
NONCE_PREFIX = b"diffuse\x00"


@dataclass
class Identity:
    public: bytes
    secret: bytes

    @property
    def public_hex(self) -> str:
        return self.public.hex()


def load_identity(path: str | None) -> Identity:
    """Read a long-term X25519 key pair from ``path``, creating it (0600) if absent; None: a fresh one."""
    if path is None:
        return Identity(*pysodium.crypto_box_keypair())
    try:
        if os.path.exists(path):
            with open(path, "rb") as f:
                raw = f.read()
            if len(raw) != 64:
                raise DiffuseError(f"identity key file {path} is damaged ({len(raw)} bytes, expected 64)")
            return Identity(raw[:32], raw[32:])
        pk, sk = pysodium.crypto_box_keypair()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pk + sk)
        return Identity(pk, sk)
    except OSError as exc:
        raise DiffuseError(f"identity key file {path}: {exc.strerror or exc}") from None


def new_key() -> bytes:
    return pysodium.randombytes(KEY_BYTES)


def ephemeral(seed: bytes | None = None) -> Identity:
    """A fresh X25519 key pair for one key agreement (from ``seed`` when given: see ``node_control``)."""
    pk, sk = pysodium.crypto_kx_seed_keypair(seed) if seed is not None else pysodium.crypto_kx_keypair()
    return Identity(pk, sk)


def agree(role: str, own: Identity, own_eph: Identity, peer: bytes, peer_eph: bytes, transcript: bytes) -> bytes:
    """The 32-byte key of one wire-2 open, the same at both ends (``role``: "client" or "node").

    It hashes three X25519 products: fresh-fresh (``crypto_kx``: forward secrecy), the client's fresh key
    with the node's long-term key (only the node can compute it) and the client's long-term key with the
    node's fresh key (only the client can); ``transcript`` (both pairs of public keys, session, challenge)
    binds it to this one open."""
    try:
        if role == "client":
            ee = pysodium.crypto_kx_client_session_keys(own_eph.public, own_eph.secret, peer_eph)[1]
            es = pysodium.crypto_scalarmult_curve25519(own_eph.secret, peer)
            se = pysodium.crypto_scalarmult_curve25519(own.secret, peer_eph)
        else:
            ee = pysodium.crypto_kx_server_session_keys(own_eph.public, own_eph.secret, peer_eph)[0]
            es = pysodium.crypto_scalarmult_curve25519(own.secret, peer_eph)
            se = pysodium.crypto_scalarmult_curve25519(own_eph.secret, peer)
    except (ValueError, TypeError) as exc:  # a low-order point or a malformed key
        raise WireError("a key in the exchange is not a usable X25519 public key") from exc
    return pysodium.crypto_generichash(ee + es + se + transcript, k=b"diffuse wire 2 open", outlen=KEY_BYTES)


def open_transcript(client: bytes, client_eph: bytes, node: bytes, node_eph: bytes, session: bytes,
                    challenge: bytes) -> bytes:
    """What a wire-2 open's agreed key is bound to: both long-term and both fresh keys, session, challenge."""
    return b"".join((client, client_eph, node, node_eph, session, challenge))


def seal_with(key: bytes, payload: dict, bound: bytes) -> bytes:
    """``payload`` sealed under a one-open key (XChaCha20-Poly1305, fixed nonce: the key seals once)."""
    import cbor2

    return pysodium.crypto_aead_xchacha20poly1305_ietf_encrypt(cbor2.dumps(payload), bound, NONCE_PREFIX * 3, key)


def open_with(key: bytes, sealed, bound: bytes) -> dict:
    import cbor2

    try:
        payload = cbor2.loads(pysodium.crypto_aead_xchacha20poly1305_ietf_decrypt(
            bytes(sealed), bound, NONCE_PREFIX * 3, key))
    except Exception as exc:
        raise WireError("the open's keys failed to open under the agreed key (another key, or tampered)") from exc
    if not isinstance(payload, dict):
        raise WireError("the open's sealed keys are not a map")
    return payload


def box(payload: bytes, peer_public: bytes, own: Identity) -> tuple[bytes, bytes]:
    nonce = pysodium.randombytes(pysodium.crypto_box_NONCEBYTES)
    return nonce, pysodium.crypto_box(payload, nonce, peer_public, own.secret)


def unbox(nonce: bytes, sealed: bytes, peer_public: bytes, own: Identity) -> bytes:
    try:
        return pysodium.crypto_box_open(sealed, nonce, peer_public, own.secret)
    except ValueError as exc:
        raise WireError("a control message failed to open: wrong key or tampered") from exc


def _nonce(counter: int, index: int) -> bytes:
    if not (0 <= counter < 1 << 64 and 0 <= index < 1 << 32):
        raise WireError(f"counter or frame index out of range for a nonce (frame {index})")
    return NONCE_PREFIX + struct.pack(">QI", counter, index) + b"\x00" * 4


def seal_frame(key: bytes, counter: int, index: int, envelope: bytes, plain) -> bytes:
    return pysodium.crypto_aead_xchacha20poly1305_ietf_encrypt(
        bytes(plain), envelope + struct.pack(">I", index), _nonce(counter, index), key
    )


def open_frame(key: bytes, counter: int, index: int, envelope: bytes, sealed: bytes) -> bytes:
    try:
        return pysodium.crypto_aead_xchacha20poly1305_ietf_decrypt(
            sealed, envelope + struct.pack(">I", index), _nonce(counter, index), key
        )
    except ValueError as exc:
        raise WireError(f"frame {index} failed authentication (tampered, or sealed under another key)") from exc


TAG_BYTES = pysodium.crypto_aead_xchacha20poly1305_ietf_ABYTES


def _readable(buf):
    """What ctypes can hand libsodium as a pointer to ``buf``'s bytes, without copying them where it can."""
    if isinstance(buf, bytes):
        return buf
    mv = memoryview(buf).cast("B")
    if mv.readonly:  # ctypes takes a pointer into writable buffers only
        return mv.tobytes()
    return (ctypes.c_char * len(mv)).from_buffer(mv) if len(mv) else b""


def seal_frame_from(key: bytes, counter: int, index: int, envelope: bytes, plain) -> bytearray:
    """``seal_frame`` read straight from ``plain``'s memory (a tensor's bytes) into the frame it returns:
    the same bytes, without the copies in and out of the binding."""
    if len(key) != KEY_BYTES:
        raise WireError("a hop key is not 32 bytes")
    src = _readable(plain)
    n = len(src)
    out = bytearray(n + TAG_BYTES)
    ad = envelope + struct.pack(">I", index)
    clen = ctypes.c_ulonglong(0)
    rc = pysodium.sodium.crypto_aead_xchacha20poly1305_ietf_encrypt(
        (ctypes.c_char * len(out)).from_buffer(out), ctypes.byref(clen), src, ctypes.c_ulonglong(n), ad,
        ctypes.c_ulonglong(len(ad)), None, _nonce(counter, index), key)
    if rc != 0 or clen.value != len(out):
        raise WireError(f"frame {index} could not be sealed")
    return out


def seal_frame_at(key: bytes, counter: int, index: int, envelope: bytes, address: int, nbytes: int) -> bytearray:
    """``seal_frame_from`` reading ``nbytes`` bytes at ``address`` (a contiguous CPU tensor's memory, which the
    caller keeps alive for the call): no buffer object is made around them first."""
    if len(key) != KEY_BYTES:
        raise WireError("a hop key is not 32 bytes")
    out = bytearray(nbytes + TAG_BYTES)
    ad = envelope + struct.pack(">I", index)
    clen = ctypes.c_ulonglong(0)
    rc = pysodium.sodium.crypto_aead_xchacha20poly1305_ietf_encrypt(
        (ctypes.c_char * len(out)).from_buffer(out), ctypes.byref(clen), ctypes.c_void_p(address),
        ctypes.c_ulonglong(nbytes), ad, ctypes.c_ulonglong(len(ad)), None, _nonce(counter, index), key)
    if rc != 0 or clen.value != len(out):
        raise WireError(f"frame {index} could not be sealed")
    return out


def open_frame_into(key: bytes, counter: int, index: int, envelope: bytes, sealed, out_address: int,
                    out_bytes: int) -> None:
    """``open_frame`` written straight into ``out_bytes`` bytes at ``out_address`` (a fresh tensor's memory),
    read from the received frame where it lies; WireError, and nothing to use, if it does not open."""
    if len(key) != KEY_BYTES:
        raise WireError("a hop key is not 32 bytes")
    src = _readable(sealed)
    if len(src) != out_bytes + TAG_BYTES:
        raise WireError(f"frame {index} holds {len(src) - TAG_BYTES} bytes, its header promises {out_bytes}")
    ad = envelope + struct.pack(">I", index)
    mlen = ctypes.c_ulonglong(0)
    rc = pysodium.sodium.crypto_aead_xchacha20poly1305_ietf_decrypt(
        ctypes.c_void_p(out_address), ctypes.byref(mlen), None, src, ctypes.c_ulonglong(len(src)), ad,
        ctypes.c_ulonglong(len(ad)), _nonce(counter, index), key)
    if rc != 0:
        raise WireError(f"frame {index} failed authentication (tampered, or sealed under another key)")


def seal_control(payload: dict, peer_public: bytes, own: Identity) -> dict:
    """A control payload sealed for ``peer_public``, as a plain map to send."""
    import cbor2

    nonce, sealed = box(cbor2.dumps(payload), peer_public, own)
    return {"from": own.public, "nonce": nonce, "box": sealed}


def open_control(sealed: dict, own: Identity, limits=None) -> tuple[dict, bytes]:
    """(payload, sender's public key) of a sealed control map; WireError if it does not open or is malformed.
    ``limits``: ``diffuse.wire.safecbor`` limits for the payload (default: those of a node's reply)."""
    sender, nonce, body = sealed.get("from"), sealed.get("nonce"), sealed.get("box")
    if not (isinstance(sender, bytes) and len(sender) == PUBLIC_BYTES
            and isinstance(nonce, bytes) and len(nonce) == BOX_NONCE_BYTES and isinstance(body, bytes)):
        raise WireError("sealed control message lacks a well-formed sender key, nonce or box")
    plain = unbox(nonce, body, sender, own)
    from diffuse.wire import safecbor  # anyone can make a key: what it sealed may be a stranger's

    return safecbor.loads(plain, limits or safecbor.REPLY, "sealed control payload"), sender
