"""What a transport plugin provides: the ring's sockets, sealed messages, identities.

The core never imports a transport; it asks ``diffuse.plugins.transport_for(url)``
for one and talks to it through this contract. A third party adds a scheme by
returning an object with these methods from the ``diffuse_transport`` hook
(subclassing is optional; the built-in ZeroMQ transport is the reference).

Messages on the data path are a CBOR header (a dict) plus a list of tensors.
Every frame is sealed under a per-session, per-hop key; a per-hop counter makes
a receiver reject replays and reordering. Control requests are small dicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class Hop:
    """The keys for one direction of one hop of one session's ring."""

    session: bytes  # 16-byte session id
    key: bytes  # 32-byte XChaCha20-Poly1305 key
    sent: int = 0  # last counter sealed by us
    seen: int = 0  # last counter accepted by us


class Endpoint(Protocol):
    """A node's listening side: data inbox plus control server."""

    address: str  # the data address, as peers should dial it
    control_address: str

    def wait(self, timeout_s: float) -> list[str]:
        """Which of "control" / "data" have a message ready (empty on timeout)."""

    def recv_control(self) -> dict: ...

    def reply_control(self, reply: dict) -> None: ...

    def recv_data(self) -> list[bytes]:
        """The raw frames of one data message (still sealed)."""

    def close(self) -> None: ...


class Transport(Protocol):
    scheme: str

    # --- identities and sealing -------------------------------------------------
    def load_identity(self, path: str | None) -> Any:
        """A long-term X25519 identity (``.public`` bytes); None path = ephemeral."""

    def seal_control(self, payload: dict, peer_public: bytes, own: Any) -> dict:
        """Seal a control payload for ``peer_public``; returns a plain dict to send."""

    def open_control(self, sealed: dict, own: Any) -> tuple[dict, bytes]:
        """Open a sealed control dict; returns (payload, sender public key)."""

    def seal(self, hop: Hop, header: dict, tensors: list) -> list[bytes]: ...

    def envelope(self, frames: list[bytes]) -> dict:
        """The plaintext envelope (session id, counter, frame count), unauthenticated."""

    def open(self, hop: Hop, frames: list[bytes]) -> tuple[dict, list]:
        """Authenticate and decode; raises WireError naming the reason."""

    # --- sockets -----------------------------------------------------------------
    def serve(self, listen: str) -> Endpoint: ...

    def inbox(self, bind: str) -> Any:
        """The client's receiving end of the ring: ``.address``, ``.recv(timeout_s)``, ``.close()``."""

    def outbox(self, address: str) -> Any:
        """A sending end toward a node's data address: ``.send(frames)``, ``.close()``."""

    def request(self, address: str, message: dict, timeout_s: float) -> dict:
        """One control request/reply to the node at data ``address``; NodeError on timeout."""
