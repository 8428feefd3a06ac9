"""What a transport plugin provides: sockets, and nothing else.

The core never imports a transport; it asks ``diffuse.plugins.transport_for(url)``
for one and talks to it through this contract. A third party adds a scheme by
returning an object with these methods from the ``diffuse_transport`` hook
(subclassing is optional; the built-in ZeroMQ transport is the reference).

A transport moves opaque frames (data) and small maps (control). Sealing,
envelopes and replay counters are core's (``diffuse.frames``,
``diffuse.sealing``): every transport gets them the same, and none can weaken them.
"""

from __future__ import annotations

from typing import Any, Protocol

# one received data frame (one tensor) at most, unless a node says otherwise: a long video's hidden states in
# float32 fit with room to spare; a peer claiming more is cut off before anything is buffered
DEFAULT_MAX_MESSAGE_BYTES = 4 << 30


class Endpoint(Protocol):
    """A node's listening side: data inbox plus control server."""

    address: str  # the data address, as peers should dial it
    control_address: str

    def wait(self, timeout_s: float) -> list[str]:
        """Which of "control" / "data" have a message ready (empty on timeout)."""

    def recv_control(self) -> dict:
        """One whole control request (a dict), decoded within ``diffuse.safecbor.CONTROL``. On a WireError
        the caller still calls ``reply_control``: a request whose sender can be answered (one part too many,
        not CBOR, over the limits) gets the refusal; junk that names no one to answer is dropped there."""

    def reply_control(self, reply: dict) -> None:
        """Answer the request last received, without blocking (a no-op if nothing is owed an answer).
        Only the peer that asked may get the answer: another peer's junk must never take it."""

    def recv_data(self) -> list[bytes]:
        """The raw frames of one data message (still sealed)."""

    def close(self) -> None: ...


class Transport(Protocol):
    scheme: str
    # optional: ``max_sockets``, how many sockets one process may open (a node keeps its sessions under it)

    def local_listen(self, name: str) -> str:
        """The address a node started on this machine should listen at (``name`` tells nodes apart)."""

    def inbox_address(self, first_node: str) -> str:
        """Where the client's inbox should bind so that the ring's last node can reach it."""

    def serve(self, listen: str, max_message_bytes: int | None = None) -> Endpoint:
        """A node's endpoint. ``max_message_bytes``: the most one received data frame may hold (None: the
        transport's default); a peer sending more is cut off before the frame is buffered."""

    def inbox(self, bind: str, max_message_bytes: int | None = None) -> Any:
        """The client's receiving end of the ring: ``.address``, ``.recv(timeout_s)``, ``.close()``; frames
        capped as in ``serve``."""

    def outbox(self, address: str) -> Any:
        """A sending end toward a node's data address: ``.send(frames)``, ``.close()``."""

    def request(self, address: str, message: dict, timeout_s: float) -> dict:
        """One control request/reply to the node whose control ``address`` is given (the address it is
        dialled at, not its data address), all tries within ``timeout_s``; NodeError on timeout or on a reply
        that is not a map. Idempotent requests (hello, ping, status) should be tried again on a lost answer."""
