"""A Diffuse transport plugin for ``ipc://`` addresses (Unix domain sockets).

A transport provides sockets only (see ``diffuse.transport_api.Transport``):
sealing, envelopes and replay counters are the core's, the same for every
scheme. ZeroMQ speaks ipc as well as tcp, so this plugin claims the scheme and
hands back the built-in ZeroMQ transport's public class for it; a transport
over something other than ZeroMQ would return its own object with the same
methods.
"""

from diffuse.hookspecs import hookimpl

__all__ = ["diffuse_transport"]


@hookimpl
def diffuse_transport(scheme):
    if scheme != "ipc":
        return None
    from transport.zmq_ring import ZmqTransport

    return ZmqTransport("ipc")
