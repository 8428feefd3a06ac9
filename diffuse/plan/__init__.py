"""What both sides read: the contracts (``contracts``: the slicing plan; ``messages``: what a session's
messages carry), shape analysis (``analysis``, run through the plugins of ``hookspecs``/``plugins``), the
``planner``, placement by job (``reports``, ``needs``, ``solver``, ``placement``), model files and verdicts
(``modelfiles``, ``verdicts``, ``shipped``), devices and dtypes, and how a call is taken apart
(``calltree``, with the cache marker of ``kvcache``). Imports only the leaves.
"""
