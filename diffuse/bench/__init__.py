"""Benchmarks: commands that print ratios measured side by side in one run (``python -m diffuse.bench NAME``).

``command`` picks the benchmark; ``diffusion`` (the default), ``lm``, ``serve``, ``device``, ``placement``,
``links``, ``memory`` and ``quality`` (also ``cache``) are one each; ``parts``, ``bare`` and ``kit`` are
what they share.
"""
