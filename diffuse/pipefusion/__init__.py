"""PipeFusion (``--patches P > 1``): one-stream stacks run as pipelined token patches.

- ``client``: the client's half. Finds the token axis, tells guidance branches apart, cuts each step
  after a branch's first into patches, sends them all into the ring before awaiting any, puts the
  answers back together; and what the run summary says about the paths the nodes took.
- ``node``: the node's half. Per session, per branch, per block, last step's activations
  (``StaleStack``), each block's choice of attention path (plain or quick), and the node's pass kind
  for a ``Patch`` (``diffuse.wire.kinds``).
- ``node_attention``: the quick path's mechanism (buffered keys and values under scoped attention
  processors), which the node's half runs.
- ``policy``: what both halves read: ``why_uncut``, the one place that decides whether a stack may be
  cut at all, and the tolerance the quick path is held to.
"""
