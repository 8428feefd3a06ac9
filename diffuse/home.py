"""Where Diffuse keeps what outlives a run: identity keys, known nodes, caches."""

from __future__ import annotations

import os


def config_home() -> str:
    """$DIFFUSE_HOME, else ~/.config/diffuse."""
    return os.environ.get("DIFFUSE_HOME") or os.path.join(os.path.expanduser("~"), ".config", "diffuse")
