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

    def local_listen(self, name: str) -> str:
        """The address a node started on this machine should listen at (``name`` tells nodes apart)."""

    def inbox_address(self, first_node: str) -> str:
        """Where the client's inbox should bind so that the ring's last node can reach it."""

    def serve(self, listen: str) -> Endpoint: ...

    def inbox(self, bind: str) -> Any:
        """The client's receiving end of the ring: ``.address``, ``.recv(timeout_s)``, ``.close()``."""

    def outbox(self, address: str) -> Any:
        """A sending end toward a node's data address: ``.send(frames)``, ``.close()``."""

    def request(self, address: str, message: dict, timeout_s: float) -> dict:
        """One control request/reply to the node whose control ``address`` is given (the address it is
        dialled at, not its data address); NodeError on timeout or on a reply that is not a map."""
