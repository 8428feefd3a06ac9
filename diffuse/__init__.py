"""Diffuse: one model split across several machines.

The client runs a pipeline's own code with each block stack replaced by a
stand-in; nodes hold contiguous slices of the stacks and pass hidden states
around a sealed ring. ``diffuse.from_pretrained`` and ``diffuse.split`` are the
Python API (see ``diffuse.client.api``).
"""

__version__ = "0.1.0"

from diffuse.errors import DiffuseError, NodeError, RefusedModel, WireError  # noqa: E402

__all__ = ["DiffuseError", "NodeError", "RefusedModel", "WireError", "__version__", "from_pretrained", "split"]


def __getattr__(name: str):
    # the API pulls in torch and diffusers: only when it is used, so `diffuse check` stays quick
    if name in ("split", "from_pretrained"):
        from diffuse.client import api

        return getattr(api, name)
    raise AttributeError(f"module 'diffuse' has no attribute {name!r}")
