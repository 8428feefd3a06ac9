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

    def recv_control(self) -> dict:
        """One whole control request (a dict). A WireError after the request was taken off the socket
        (not one part, not CBOR, not a map) still obliges the caller to ``reply_control``."""

    def reply_control(self, reply: dict) -> None:
        """Answer the request last received (a no-op if nothing is owed an answer)."""

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
        """Open a sealed control dict; returns (payload: a dict, sender public key). WireError if it
        does not open or is malformed (the node answers with an error and goes on)."""

    def new_key(self) -> bytes:
        """A fresh random hop key (32 bytes), one per hop per session."""

    def seal(self, hop: Hop, header: dict, tensors: list) -> list[bytes]: ...

    def envelope(self, frames: list[bytes]) -> dict:
        """The plaintext envelope (session id, counter, frame count), unauthenticated but checked for
        shape: ``"s"`` is 16 bytes and ``"c"`` an int in [1, 2**64); WireError otherwise."""

    def open(self, hop: Hop, frames: list[bytes]) -> tuple[dict, list]:
        """Authenticate, then decode; the header is a dict. Raises WireError naming the reason, never
        anything else, whatever the frames hold."""

    # --- sockets -----------------------------------------------------------------
    def serve(self, listen: str) -> Endpoint: ...

    def inbox(self, bind: str) -> Any:
        """The client's receiving end of the ring: ``.address``, ``.recv(timeout_s)``, ``.close()``."""

    def outbox(self, address: str) -> Any:
        """A sending end toward a node's data address: ``.send(frames)``, ``.close()``."""

    def request(self, address: str, message: dict, timeout_s: float) -> dict:
        """One control request/reply to the node whose control ``address`` is given (the address it is
        dialled at, not its data address); NodeError on timeout or on a reply that is not a map."""
