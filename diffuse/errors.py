"""Errors a user can see. Each says what happened, to what, and what to do."""


class DiffuseError(Exception):
    """Base class: an expected failure, printed without a traceback."""


class RefusedModel(DiffuseError):
    """The model cannot be split; raised before any node is contacted."""

    def __init__(self, model: str, reason: str):
        self.model = model
        self.reason = reason
        super().__init__(f"cannot split {model}: {reason}")


class NodeError(DiffuseError):
    """A node answered with an error, or did not answer in time."""

    def __init__(self, address: str, message: str):
        self.address, self.message = address, message
        super().__init__(f"node {address}: {message}")


class Repaired(DiffuseError):
    """The route was repaired while patched passes were in flight: they cannot be replayed on nodes that
    never saw the steps before (their stale buffers are empty), so the step runs again whole."""


class WireError(DiffuseError):
    """A message failed to open: tampered, replayed, truncated or from another version."""


class MalformedHeader(WireError):
    """A message that authenticated, but whose header cannot be read: its sender is answered, not ignored."""


class PluginError(DiffuseError):
    """A plugin broke a hook contract; names the plugin."""


class ReadsBlocks(DiffuseError):
    """The model reads a block's weights outside its stack's loop, or calls into a block there: what the nodes
    hold cannot be read or run on the client (``diffuse.client.blockreads``)."""
