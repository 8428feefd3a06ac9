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


def without_decoders(stacks, subject) -> list:
    """``stacks`` but the VAEs'."""
    names = set(getattr(subject, "decoders", ()))
    return [s for s in stacks if s.path not in names]
