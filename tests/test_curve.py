"""The built-in transport's data ports are CURVE servers: a connection proves its key at the handshake.

In one process, real ZeroMQ sockets on loopback: a receiving end given a server key speaks only CURVE, asks
its ``admit`` about each client key that completed the handshake, and takes messages from the admitted
key alone; peers without keys, with PLAIN credentials, or holding another server key are never asked.
"""

from __future__ import annotations

import os

import zmq

from test_sessions_bounded import admitted


def _sender(address: str, setup) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    setup(s)
    s.connect(address)
    return s


def test_a_data_port_speaks_only_curve_and_takes_only_the_keys_it_admits():
    from diffuse.wire.sealing import load_identity
    from diffuse.wire.tokens import curve_client
    from transport.zmq_ring import ZmqTransport

    server, hop_key, stranger_key = load_identity(None), os.urandom(32), os.urandom(32)
    asked: list[bytes] = []
    inbox = ZmqTransport("tcp").inbox("tcp://127.0.0.1:0", admit=lambda key: asked.append(bytes(key)) or
                                      bytes(key) == curve_client(hop_key)[0], server_key=(server.public, server.secret))
    senders = []
    try:
        assert inbox.sock.getsockopt(zmq.CURVE_SERVER) == 1 and inbox.sock.getsockopt(zmq.MECHANISM) == zmq.CURVE
        senders = [
            _sender(inbox.address, lambda s: None),  # no mechanism at all
            _sender(inbox.address, lambda s: (s.setsockopt(zmq.PLAIN_USERNAME, b"u"),
                                              s.setsockopt(zmq.PLAIN_PASSWORD, b"p"))),
            _sender(inbox.address, lambda s: admitted(s, hop_key, os.urandom(32))),  # the right pair, a wrong server
            _sender(inbox.address, lambda s: admitted(s, stranger_key, server.public)),  # a key nobody admitted
        ]
        for i, s in enumerate(senders):
            s.send(b"stranger %d" % i, zmq.NOBLOCK)
        own = _sender(inbox.address, lambda s: admitted(s, hop_key, server.public))
        senders.append(own)
        own.send(b"the hop's own end")
        assert bytes(inbox.recv(5.0)[0]) == b"the hop's own end"
        assert inbox.recv(0.5) is None  # nothing of the strangers ever arrives
        assert set(asked) == {curve_client(hop_key)[0], curve_client(stranger_key)[0]}  # the others never got that far
    finally:
        for s in senders:
            s.close()
        inbox.close()


def test_a_receiving_end_that_admits_needs_a_server_key():
    import pytest

    from transport.zmq_ring import ZmqTransport

    with pytest.raises(ValueError, match="CURVE server_key"):
        ZmqTransport("tcp").inbox("tcp://127.0.0.1:0", admit=lambda key: True)
