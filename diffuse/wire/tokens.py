"""What proves a session's own messages: what its two ends make from a hop key, and its lease.

A ping renews session ``sid`` only with ``ping_proof``. A data connection is admitted by the CURVE client
key ``curve_client`` makes from the hop's key (a transport with ``curve``), or by ``data_token`` (one with
``admits`` only). All three come from the key of the hop, which only that hop's two ends hold. The client
computes them, the node checks them: they live here, below both.
"""

from __future__ import annotations

import hashlib
import hmac
import os

SESSION_LEASE_S = 30.0  # a session with neither data nor pings for this long is closed


def ping_proof(hop_key: bytes, sid: bytes) -> bytes:
    """What a ping carries to renew session ``sid``: a MAC of its id under the hop key into the node."""
    return hmac.new(hop_key, b"diffuse ping " + sid, hashlib.sha256).digest()[:16]


def data_token(hop_key: bytes, sid: bytes) -> bytes:
    """What a sending end presents, with the session id, to connect to the data port of a hop's receiver (a
    transport that ``admits``): a MAC of the id under that hop's key, which only the hop's two ends hold."""
    return hmac.new(hop_key, b"diffuse data " + sid, hashlib.sha256).digest()[:16]


def curve_client(hop_key: bytes) -> tuple[bytes, bytes]:
    """The (public, secret) curve25519 pair a hop's sending end presents in ZeroMQ's CURVE handshake: made
    from the hop's key, so its receiver knows the public half from the sealed open alone, and nobody without
    the key can make the pair."""
    import pysodium

    seed = pysodium.crypto_generichash(hop_key, k=b"diffuse curve client", outlen=32)
    return pysodium.crypto_box_seed_keypair(seed)


def token_admits(hop_key: bytes | None, sid: bytes, user, password) -> bool:
    """Whether ``(user, password)`` is session ``sid``'s connection over the hop keyed ``hop_key``."""
    return hop_key is not None and bytes(user) == sid and hmac.compare_digest(bytes(password),
                                                                               data_token(hop_key, sid))


def lease_s() -> float:
    """The lease: ``DIFFUSE_SESSION_LEASE_S`` if set (both ends read it), else ``SESSION_LEASE_S``."""
    try:
        return max(0.5, float(os.environ.get("DIFFUSE_SESSION_LEASE_S", SESSION_LEASE_S)))
    except ValueError:
        return SESSION_LEASE_S
