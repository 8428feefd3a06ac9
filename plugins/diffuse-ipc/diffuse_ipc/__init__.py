"""A Diffuse transport plugin for ``ipc://`` addresses.

It reuses the built-in ZeroMQ ring (sockets, CBOR frames, libsodium sealing)
and only claims a new URL scheme; a transport over something other than
ZeroMQ would return its own object with the same methods
(see ``diffuse.transport_api.Transport``).
"""

from diffuse.hookspecs import hookimpl

__all__ = ["diffuse_transport"]


@hookimpl
def diffuse_transport(scheme):
    if scheme != "ipc":
        return None
    from transport.zmq_ring import ZmqTransport

    return ZmqTransport("ipc")
