"""Where Diffuse keeps what outlives a run: identity keys, known nodes, caches."""

from __future__ import annotations

import os


def config_home() -> str:
    """$DIFFUSE_HOME, else ~/.config/diffuse."""
    return os.environ.get("DIFFUSE_HOME") or os.path.join(os.path.expanduser("~"), ".config", "diffuse")


def libraries_offline() -> None:
    """The loaders (diffusers, transformers, huggingface_hub) kept offline, as Diffuse's commands run them: they
    read local folders only, and Diffuse fetches what a model needs itself (``diffuse.plan.hub``). Whether the
    user asked for no network at all is kept first, in ``DIFFUSE_HUB_OFFLINE`` (from ``HF_HUB_OFFLINE``)."""
    os.environ.setdefault("DIFFUSE_HUB_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "0"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
