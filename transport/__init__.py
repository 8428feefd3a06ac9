"""The built-in transport: ZeroMQ sockets for the ring (PUSH/PULL data, REQ/REP control); framing and sealing are the core's (diffuse.wire.frames, diffuse.wire.sealing)."""
