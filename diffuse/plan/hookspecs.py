"""The plugin author's manual: every hook Diffuse calls, and its contract.

A plugin is a module or object with functions marked ``@hookimpl`` whose names
and parameters match the specs below. Publish it under the ``diffuse``
entry-point group::

    [project.entry-points.diffuse]
    myplugin = "my_package.my_module"

Built-in analyzers, the ZeroMQ transport and the output writers register the
same way; nothing in the core imports them.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("diffuse")
hookimpl = pluggy.HookimplMarker("diffuse")


@hookspec
def diffuse_analyzers():
    """Return a list of :class:`diffuse.plan.analysis.Analyzer` objects.

    Each analyzer declares ``name``, ``phase`` (``"config"``: config.json files
    only; ``"model"``: the loaded pipeline; ``"call"``: the first call into a
    stack), the plan fields it ``needs`` and ``provides``, and an ``analyze``
    method returning a dict with exactly the fields it provides. Analyzers run
    in dependency order; an analyzer that returns a field it did not declare,
    or raises, is reported with its name.
    """


@hookspec(firstresult=True)
def diffuse_transport(scheme):
    """Return a :class:`diffuse.wire.transport.Transport` for a URL scheme.

    ``scheme`` is the part of a node address before ``://`` (``tcp``, ``ipc``,
    ...). Return None for a scheme you do not serve; the first non-None answer
    wins. ``diffuse.wire.transport`` holds everything a transport needs of
    Diffuse (the protocols, limits, control-map encoding, errors, ``hookimpl``);
    ``plugins/diffuse-tcp`` is a complete example built on it alone.
    """


@hookspec(firstresult=True)
def diffuse_write_output(result, path, info):
    """Write a generated result to ``path``; return the path written, or None.

    ``result`` is the float32 numpy array the pipeline returned with
    ``output_type="np"``; ``info`` is a :class:`diffuse.client.writers.OutputInfo`
    (kind ``"image"``/``"video"``/``"audio"``, frame rate, sample rate). Return
    None to let another writer handle this suffix or kind.
    """
