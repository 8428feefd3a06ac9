"""Who may connect to a data port: what the core gives a transport's receiving and sending ends.

A transport says how it admits data connections (``diffuse.wire.transport.Transport``):

- ``curve = True`` (the built-in ZeroMQ transport): every data connection is a ZeroMQ CURVE handshake.
  A node's data port is a CURVE server under the node's long-term key, the key its client pins; the
  client's inbox is one under a key made fresh for the session. A sending end is a CURVE client under
  the pair ``diffuse.wire.tokens.curve_client`` makes from its hop's key, and it knows the receiver's
  server key from the client (a node's: the sealed open's ``next_server``), so no one in between can
  stand in for the receiver. A receiver lets in only the client keys of its open sessions, asked
  before it takes any of the connection's messages; nothing of the connection travels in clear.
- ``admits = True`` (the older form): a session id and the MAC ``data_token`` stand in for the key,
  which such a transport may carry in clear.
- neither: nothing is given, and a receiver takes any connection (its frames still fail at the door).
"""

from __future__ import annotations

from collections.abc import Callable

from diffuse.errors import DiffuseError
from diffuse.wire.tokens import curve_client, data_token


def kind(transport) -> str | None:
    """How ``transport`` admits data connections: "curve", "token" or None."""
    if getattr(transport, "curve", False) is True:
        return "curve"
    return "token" if getattr(transport, "admits", False) else None


def receiving(transport, server, by_key: Callable[[bytes], bool],
              by_token: Callable[[bytes, bytes], bool]) -> dict:
    """The keyword arguments of ``serve`` or ``inbox``: ``server`` (an object with ``public`` and ``secret``)
    is the CURVE server key; ``by_key(client_public)`` or ``by_token(user, password)`` decides each connection."""
    how = kind(transport)
    if how == "curve":
        return {"admit": by_key, "server_key": (server.public, server.secret)}
    return {"admit": by_token} if how == "token" else {}


def sending(transport, sid: bytes, hop_key: bytes, server: bytes | None, address: str) -> dict:
    """The keyword arguments of ``outbox`` for session ``sid``'s end of the hop keyed ``hop_key`` toward
    ``address``, whose CURVE server key is ``server``. Without ``server`` a CURVE transport's sending end
    connects unauthenticated, which a CURVE receiver refuses at the handshake (only an opener that names
    no key for the next hop, such as an older client, asks for that)."""
    how = kind(transport)
    if how == "curve":
        if server is None:
            return {}
        if not isinstance(server, bytes) or len(server) != 32:
            raise DiffuseError(f"the CURVE key of the data port at {address[:200]!r} must be 32 bytes")
        return {"curve": (server, *curve_client(hop_key))}
    return {"credentials": (sid, data_token(hop_key, sid))} if how == "token" else {}


def admits_hop(hop_key: bytes | None, client_public) -> bool:
    """Whether ``client_public`` is the CURVE client key of the sending end of the hop keyed ``hop_key``."""
    import hmac

    return hop_key is not None and hmac.compare_digest(bytes(client_public), curve_client(hop_key)[0])
