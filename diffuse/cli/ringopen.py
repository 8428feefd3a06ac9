"""Opening a split for a command: its nodes started or dialled, and which node holds what said."""

from __future__ import annotations

from diffuse.client.api import Split


def open_split(ring, pipe, held, console, quiet: bool):
    """The ``Split`` a ``diffuse query`` request's ``ring`` (a ``diffuse.client.request.RingAsk``) asks for, its nodes
    started or dialled (held open until ``held``, an ``ExitStack``, closes), and which node holds what said."""
    from diffuse.client.progress import phase

    split = Split(pipe, ring.nodes, ring.options)
    if ring.options.client_key:
        from diffuse.wire.sealing import load_identity

        console.print(f"client key {load_identity(ring.options.client_key).public_hex}", highlight=False,
                      soft_wrap=True)
    for note in split.local.notes if split.local is not None else ():
        console.print(note, soft_wrap=True)
    starting = f"opening sessions on {len(split.nodes)} nodes" if split.local is None else (
        f"starting {split.local.count} local nodes ({split.local.threads} "
        f"thread{'s' if split.local.threads > 1 else ''} each)")
    if quiet and split.local is not None:
        console.print(starting)  # said even with --quiet: processes are started
    with phase(console, starting, quiet):
        held.enter_context(split)
    for k, r in enumerate(split.rings):
        for stage in r.plan.route:
            group = f" (group {k + 1})" if len(split.rings) > 1 else ""
            console.print(f"  node {stage.address}{group}: {', '.join(map(str, stage.slices))}")
    patches = ring.options.patches
    if patches > 1 and split.ring.uncut:
        console.print(f"{', '.join(sorted(split.ring.uncut))}: two streams per block (image and text side "
                      f"by side), so steps run uncut there; --patches {patches} not applied", soft_wrap=True)
    return split
