"""Diffuse: one diffusion transformer split across several machines.

The client runs a pipeline's own code with each block stack replaced by a
stand-in; nodes hold contiguous slices of the stacks and pass hidden states
around a sealed ring.
"""

__version__ = "0.1.0"

from diffuse.errors import DiffuseError, RefusedModel, NodeError, WireError  # noqa: E402

__all__ = ["DiffuseError", "RefusedModel", "NodeError", "WireError", "__version__"]
