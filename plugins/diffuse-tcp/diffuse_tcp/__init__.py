"""A Diffuse transport plugin for ``tcpstream://`` addresses: the ring over plain TCP streams.

It shares no code with the built-in ZeroMQ transport: standard-library sockets,
length-prefixed messages (``diffuse_tcp.framing``), and nothing of Diffuse but
its public transport contract, ``diffuse.wire.transport``. Sealing, envelopes and
replay counters are the core's, the same for every scheme, so a ring over it is
as exact and as sealed as one over ZeroMQ.
"""

from diffuse.wire.transport import hookimpl

__all__ = ["diffuse_transport"]


@hookimpl
def diffuse_transport(scheme):
    if scheme != "tcpstream":
        return None
    from diffuse_tcp.streams import StreamTransport

    return StreamTransport()
