"""A pipeline's VAE on a node, by opt-in (``--decoder``): its decode (and encode) run there, whole.

A VAE is not a list of blocks a pass threads hidden states through, so it is
held as a stack of one block (``diffuse.plan.components.Coder``): its modules
are the VAE's own, its weights keep their names (``vae.0.decoder...``), and a
plain pass into it carries the VAE's own call (``decode`` or ``encode``, the
pipeline's arguments, and the client's VAE settings: tiling, slicing and their
sizes). The node runs the VAE's own method and answers the decoded picture
(or, encoding, the latent distribution's parameters). Nothing in it is a
family's: a VAE is found as a diffusers model whose class decodes
(``diffuse.plan.analysis.decoder_components``).

``--decoder`` says where: ``client`` (the default, as plain diffusers holds it),
``ring`` (the route's last node: the answer goes from it to the client, past no
other node) or a node the user names (its address in ``--nodes``, or its place
there: ``1``, ``2`` ...). Only that node holds the VAE, beside its share of the
other stacks; it sees the result, as ``docs/security.md`` says. The client never
loads (nor, for a Hub model, fetches) the VAE's weights.
"""

from __future__ import annotations

from diffuse.errors import DiffuseError

CLIENT, RING = "client", "ring"
TILINGS = ("auto", "on", "off")


def check_decoder(where) -> str | None:
    """``--decoder`` (None: the default, client): None for the client, ``"ring"``, or the node's name as given
    (an address, or a place ``N`` in the node list; checked against the nodes by ``node_named``)."""
    if where is None or where == CLIENT:
        return None
    if not isinstance(where, (str, int)) or isinstance(where, bool) or not str(where).strip():
        raise DiffuseError(f"--decoder {where!r}: choose client, ring, or a node (its address, or its place: 1, "
                           "2, ...)")
    return str(where).strip()


def check_tiling(tiling) -> str:
    """``--decoder-tiling`` (None: auto)."""
    if tiling is None:
        return "auto"
    if tiling not in TILINGS:
        raise DiffuseError(f"--decoder-tiling {tiling}: choose {' or '.join(TILINGS)}")
    return tiling


def node_named(where: str, addresses: list[str] | None, count: int) -> int | None:
    """The place (0-based) in the node list of the node ``where`` names (None for ``ring``: the route's last,
    known once routed). ``addresses``: the nodes given (each maybe ``ADDR#KEY``), None for ``count`` local nodes
    (named by place only). Refused in one line where no node has that name."""
    if where == RING:
        return None
    plain = [a.split("#", 1)[0] for a in addresses] if addresses is not None else []
    if where.isdigit():
        k = int(where)
        if 1 <= k <= (len(plain) if addresses is not None else count):
            return k - 1
        listed = f"{len(plain)} given" if addresses is not None else f"{count} local nodes"
        raise DiffuseError(f"--decoder {where}: there is no node {where} ({listed}; places count from 1)")
    if addresses is None:
        raise DiffuseError(f"--decoder {where}: local nodes are named by their place (1 to {count}), not an address")
    if where.split("#", 1)[0] in plain:
        return plain.index(where.split("#", 1)[0])
    raise DiffuseError(f"--decoder {where}: no such node among --nodes ({', '.join(plain)})")


def decoder_stacks(stacks, subject) -> list[str]:
    """The paths of ``stacks`` that are the subject's VAEs (each a stack of one block)."""
    names = set(getattr(subject, "decoders", ()))
    return [s.path for s in stacks if s.path in names]


def pin(plan, paths, address: str, stages=()):
    """``plan`` with the stacks ``paths`` (the VAEs') wholly on the stage at ``address`` and an empty slice of them on
    every other, before or after it, as the route's order has it; their slices the route gave, gone. A node the
    route left out (one of ``stages``) comes after the others, holding the VAE only. (The plan, and the place of
    the node holding the VAE in its route.)"""
    import dataclasses

    from diffuse.plan.contracts import Slice, Stage

    route = [dataclasses.replace(stage, slices=tuple(sl for sl in stage.slices if sl.stack not in paths))
             for stage in plan.route]
    at = next((i for i, s in enumerate(route) if s.address == address), None)
    if at is None:
        given = next((s for s in stages if s.address == address), None)
        if given is None:
            raise DiffuseError(f"--decoder: {address} is no node of this ring")
        route.append(Stage(given.address, given.key, tuple(Slice(s.path, s.length, s.length) for s in plan.stacks
                                                           if s.path not in paths)))
        at = len(route) - 1
    pinned = [s for s in plan.stacks if s.path in paths]
    route = [dataclasses.replace(stage, slices=stage.slices + tuple(
        Slice(s.path, 0 if i <= at else s.length, s.length if i >= at else 0) for s in pinned))
        for i, stage in enumerate(route)]
    return plan.with_route(route), at


def pinned_as_asked(plan, subject, where: str | None):
    """``plan`` (routed) with the subject's VAEs where ``--decoder`` says (``diffuse plan``): ``ring``, the route's
    last; a node's place in the route or its address; as it is without ``--decoder`` or a VAE."""
    paths = decoder_stacks(plan.stacks, subject)
    if check_decoder(where) is None or not paths or not plan.route:
        return plan
    k = node_named(check_decoder(where), [s.address for s in plan.route], len(plan.route))
    return pin(plan, paths, plan.route[-1 if k is None else k].address)[0]


def without_decoders(stacks, subject) -> list:
    """``stacks`` but the VAEs'."""
    names = set(getattr(subject, "decoders", ()))
    return [s for s in stacks if s.path not in names]
