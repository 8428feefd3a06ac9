"""What a transport plugin provides: sockets, and nothing else.

The core never imports a transport; it asks ``diffuse.wire.transport.transport_for(url)``
for one and talks to it through this contract. A third party adds a scheme by
returning an object with these methods from the ``diffuse_transport`` hook
(subclassing is optional; the built-in ZeroMQ transport, ``transport/zmq_ring.py``,
is the reference).

A transport moves opaque frames (data) and small maps (control). Sealing,
envelopes and replay counters are core's (``diffuse.wire.frames``,
``diffuse.wire.sealing``): every transport gets them the same, and none can weaken them.

This module is all of Diffuse a transport plugin needs: the protocols below
(every member the core calls, on the transport and on the endpoint, inbox and
outbox it hands out), the ``hookimpl`` marker, the errors to raise, the limits
to enforce and the encoding of control maps. ``plugins/diffuse-ipc`` and
``plugins/diffuse-tcp`` import nothing else of Diffuse.

Two shapes of traffic:

- **data**: one message is a list of frames (``list[bytes]``, at most
  ``MAX_PARTS``), kept whole and in order per sender. A node receives data on
  its endpoint from whoever holds an outbox toward its data address; the ring's
  last node sends to the client's inbox.
- **control**: one request, one reply, both CBOR maps. The client asks with
  ``Transport.request``; the node's endpoint receives the request decoded
  (``decode_request``) and answers the asker only (``encode_reply``).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol, runtime_checkable

import cbor2

from diffuse.wire import safecbor
from diffuse.errors import DiffuseError, NodeError, PluginError, WireError
from diffuse.plan.hookspecs import hookimpl
from diffuse.plan.plugins import call_hook, plugin_manager, plugin_names

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES", "IDEMPOTENT", "MAX_CONTROL_BYTES", "MAX_PARTS", "MAX_REPLY_BYTES",
    "DiffuseError", "Endpoint", "Inbox", "NodeError", "Outbox", "PluginError", "Transport", "WireError",
    "decode_reply", "decode_request", "encode_reply", "encode_request", "hookimpl", "zeromq_transport",
]

# one received data frame (one tensor) at most, unless a node says otherwise: a long video's hidden states in
# float32 fit with room to spare; a peer claiming more is cut off before anything is buffered
DEFAULT_MAX_MESSAGE_BYTES = 4 << 30
MAX_PARTS = 1 << 16  # frames in one data message (diffuse.wire.frames.MAX_FRAMES); a control message is one frame
MAX_CONTROL_BYTES = 1 << 20  # one control request; a peer sending more is cut off
MAX_REPLY_BYTES = safecbor.REPLY.max_bytes  # one reply a client accepts
IDEMPOTENT = ("hello", "ping", "status")  # requests a client may send again while an answer does not come


# --------------------------------------------------------------------------- control maps on the wire


def encode_request(message: dict) -> bytes:
    """A control request as the bytes of one frame."""
    return cbor2.dumps(message)


def decode_request(raw: bytes) -> dict:
    """A received control request, checked within ``diffuse.wire.safecbor.CONTROL`` before it is built; WireError
    otherwise (the endpoint's caller then answers the asker with the refusal)."""
    return safecbor.loads(raw, safecbor.CONTROL, "control request")


def encode_reply(reply: dict) -> bytes:
    """A node's reply as the bytes of one frame; never raises (a reply that cannot be encoded becomes an
    error reply).

    >>> decode_reply(encode_reply({"ok": True, "op": "ping"}), "tcp://127.0.0.1:1")
    {'ok': True, 'op': 'ping'}
    >>> decode_reply(encode_reply({"ok": True, "x": object()}), "tcp://127.0.0.1:1")["error"]  # doctest: +ELLIPSIS
    'the node could not encode its reply: CBOREncode...Error'
    """
    try:
        return cbor2.dumps(reply)
    except Exception as exc:
        return cbor2.dumps({"ok": False, "error": f"the node could not encode its reply: {type(exc).__name__}"})


def decode_reply(raw: bytes, address: str) -> dict:
    """A reply received from the node at ``address``, checked within ``diffuse.wire.safecbor.REPLY``; NodeError
    naming the node otherwise.

    >>> decode_reply(b"junk", "tcp://127.0.0.1:1")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    diffuse.errors.NodeError: node tcp://127.0.0.1:1: answered with something that is not a map (reply is a str, ...)
    """
    try:
        return safecbor.loads(raw, safecbor.REPLY, "reply")
    except WireError as exc:
        raise NodeError(address, f"answered with something that is not a map ({exc})") from None


# --------------------------------------------------------------------------- the protocols


@runtime_checkable
class Inbox(Protocol):
    """The client's receiving end of the ring: where the last node sends each pass's answer."""

    address: str  # as the ring's last node should dial it

    def recv(self, timeout_s: float) -> list[bytes] | None:
        """The frames of one whole message, or None when none came within ``timeout_s``."""

    def close(self) -> None: ...


@runtime_checkable
class Outbox(Protocol):
    """A sending end toward one data address (a node's, or the client's inbox). It must never block: what
    the peer cannot take yet waits in ``waiting``, a few messages at most, and goes out on the next ``send``
    or ``flush``. The core flushes an outbox whose ``waiting`` is not empty while it waits for other work,
    and gives up a session whose outbox raises NodeError."""

    address: str  # the address it sends to, as given to ``Transport.outbox``
    waiting: Collection  # messages handed to ``send`` that the peer has not taken yet: empty when none

    def send(self, frames: list[bytes]) -> None:
        """Queue one message and hand on what the peer takes now. NodeError naming the peer when it has taken
        nothing for a while or too many messages already wait for it (stuck or gone)."""

    def flush(self) -> bool:
        """Hand on what waits, as far as the peer takes it; True while some still waits. NodeError as in
        ``send``."""

    def close(self) -> None:
        """Release the socket; what still waits for a peer that was given up is dropped."""


@runtime_checkable
class Endpoint(Protocol):
    """A node's listening side: data inbox plus control server. Used from one thread (the node's control
    thread), so it needs no locks of its own."""

    address: str  # the data address, as peers should dial it
    control_address: str  # the address the node is dialled at (what ``Transport.request`` is given)

    def wait(self, timeout_s: float) -> list[str]:
        """Which of "control" / "data" have a message ready (empty on timeout)."""

    def recv_control(self) -> dict:
        """One whole control request (a dict), decoded with ``decode_request``. On a WireError the caller
        still calls ``reply_control``: a request whose sender can be answered (one part too many, not CBOR,
        over the limits) gets the refusal; junk that names no one to answer is dropped there."""

    def reply_control(self, reply: dict) -> None:
        """Answer the request last received (encoded with ``encode_reply``), without blocking (a no-op if
        nothing is owed an answer). Only the peer that asked may get the answer: another peer's junk must
        never take it."""

    def recv_data(self) -> list[bytes]:
        """The raw frames of one data message (still sealed), once ``wait`` said "data"."""

    def close(self) -> None:
        """Stop listening and release every connection (and any file a path-scheme address left)."""


@runtime_checkable
class Transport(Protocol):
    """What the ``diffuse_transport`` hook returns for one scheme. Optional: ``max_sockets`` (int), how many
    sockets one process may open; a node keeps its sessions under it (one outbox each). Optional:
    ``curve = True``, for a transport whose data connections are ZeroMQ CURVE handshakes, each admitted
    before any of its messages is taken: its ``serve`` and ``inbox`` then take ``server_key``, the (public,
    secret) curve25519 pair the receiving end serves under (a node's long-term key; the inbox's, made for the
    session), and ``admit``, a callable ``(client_public: bytes) -> bool`` asked about each connection once its
    handshake proved that key; its ``outbox`` takes ``curve``, the (server public, client public, client
    secret) keys a sending end holds, or nothing for an opener that named no key for the next hop
    (``diffuse.wire.admission``). Optional, the older form: ``admits = True``, where ``admit`` is
    ``(user: bytes, password: bytes) -> bool`` and ``outbox`` takes ``credentials``, a session id and the
    token ``diffuse.wire.tokens.data_token`` makes (which such a transport may carry in clear). The core passes
    these only to a transport that says so, ``curve`` first. Optional: ``exchange(address, messages, timeout_s)``, several control requests in
    turn on one connection, each reply with the seconds from its send, which ``diffuse.wire.links`` measures a link's
    round trip with (without it, each request's connection is counted in the round trip)."""

    scheme: str

    def local_listen(self, name: str) -> str:
        """The address a node started on this machine should listen at (``name`` tells nodes apart)."""

    def inbox_address(self, first_node: str) -> str:
        """Where the client's inbox should bind so that the ring's last node can reach it."""

    def serve(self, listen: str, max_message_bytes: int | None = None) -> Endpoint:
        """A node's endpoint. ``max_message_bytes``: the most one received data frame may hold (None:
        ``DEFAULT_MAX_MESSAGE_BYTES``); a peer sending more is cut off before the frame is buffered."""

    def inbox(self, bind: str, max_message_bytes: int | None = None) -> Inbox:
        """The client's receiving end of the ring, bound at ``bind``; frames capped as in ``serve``."""

    def outbox(self, address: str) -> Outbox:
        """A sending end toward a data address; DiffuseError naming the address if it cannot be reached."""

    def request(self, address: str, message: dict, timeout_s: float) -> dict:
        """One control request/reply to the node whose control ``address`` is given (the address it is
        dialled at, not its data address), all tries within ``timeout_s``; the reply decoded with
        ``decode_reply``; NodeError on timeout. Requests in ``IDEMPOTENT`` should be tried again on a lost
        answer."""


# --------------------------------------------------------------------------- the built-in, for other schemes

BUILTIN_ENTRY_POINT = "zmq"  # the entry point the built-in ZeroMQ transport registers under


def zeromq_transport(scheme: str) -> Transport:
    """The built-in ZeroMQ transport serving ``scheme``: for a plugin that claims a scheme ZeroMQ speaks
    besides tcp (``ipc``, as plugins/diffuse-ipc does). Reached through its entry point, as the plugin
    manager reaches every plugin; the core imports no transport."""
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group="diffuse") if ep.name == BUILTIN_ENTRY_POINT]
    factory = getattr(found[0].load(), "zeromq_transport", None) if found else None
    if factory is None:
        raise PluginError(f"the built-in ZeroMQ transport (entry point {BUILTIN_ENTRY_POINT!r} in the 'diffuse' "
                          "group) is not installed: reinstall diffuse with `pip install -e .`")
    return factory(scheme)


def transport_methods() -> list[str]:
    """What every transport must have: the methods of ``diffuse.wire.transport.Transport``."""
    return sorted(n for n, v in vars(Transport).items() if not n.startswith("_") and callable(v))


def _answering_plugin(hook, scheme: str) -> str:
    """Which plugin's implementation gives the first answer (pluggy calls the last registered first)."""
    for impl in reversed(hook.get_hookimpls()):
        if impl.hookwrapper or getattr(impl, "wrapper", False):
            continue
        try:
            if impl.function(*[{"scheme": scheme}[a] for a in impl.argnames]) is not None:
                return impl.plugin_name
        except Exception:
            return impl.plugin_name
    return "unknown"


def transport_for(url: str):
    """The transport that serves ``url``'s scheme, or a clear error."""
    if "://" not in url:
        raise PluginError(
            f"address {url!r} has no scheme: write it as tcp://HOST:PORT (a node address may end in #KEY, "
            "the node's public key, to pin it)"
        )
    scheme = url.split("://", 1)[0]
    transport = call_hook("diffuse_transport", scheme=scheme)
    if transport is None:
        raise PluginError(
            f"no transport serves {scheme!r} addresses; installed plugins: {', '.join(plugin_names())}"
        )
    # a transport missing a method would fail mid-run, far from its cause: refuse it here, naming its plugin
    missing = [m for m in transport_methods() if not callable(getattr(transport, m, None))]
    if not isinstance(getattr(transport, "scheme", None), str):
        missing.append("scheme (a str attribute)")
    if missing:
        owner = _answering_plugin(plugin_manager().hook.diffuse_transport, scheme)
        raise PluginError(
            f"plugin {owner!r} breaks the transport contract: the {type(transport).__name__} it returns for "
            f"{scheme}:// lacks {', '.join(missing)} (see diffuse.wire.transport.Transport)"
        )
    return transport
