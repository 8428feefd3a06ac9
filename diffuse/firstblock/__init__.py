"""The first-block cache across the ring (``--cache-threshold T``): steps that change little are skipped.

``client`` tags each call; ``node`` keeps the residuals and decides, on the node holding block 0, whether
the rest of the stack runs. The rule itself is told in ``node``.
"""
