"""What travels between client and nodes: data messages (``frames``, sealed by ``sealing``, their CBOR read
within limits by ``safecbor``), the per-pass contract (``passes``) and the registry of the kinds a node runs
(``kinds``), what a node remembers of non-stream tensors (``slots``), the session MACs and lease both ends
compute (``tokens``), links measured with sealed pings (``links``), announcements on the LAN
(``discovery``), and the transport API a plugin implements (``transport``). Imports plan and the leaves.
"""
