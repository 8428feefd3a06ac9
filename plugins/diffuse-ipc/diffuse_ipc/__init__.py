"""A Diffuse transport plugin for ``ipc://`` addresses (Unix domain sockets).

A transport provides sockets only (see ``diffuse.wire.transport.Transport``):
sealing, envelopes and replay counters are the core's, the same for every
scheme. ZeroMQ speaks ipc as well as tcp, so this plugin claims the scheme and
hands back the built-in ZeroMQ transport for it, through the public
``diffuse.wire.transport.zeromq_transport``; a transport over something other
than ZeroMQ returns its own object with the same methods (plugins/diffuse-tcp).
"""

from diffuse.wire.transport import hookimpl, zeromq_transport

__all__ = ["diffuse_transport"]


@hookimpl
def diffuse_transport(scheme):
    if scheme != "ipc":
        return None
    return zeromq_transport("ipc")
