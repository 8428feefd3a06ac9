"""The built-in transport: a ZeroMQ PUSH/PULL ring, CBOR frames, libsodium sealing."""
