"""``diffuse plan``: the slicing plan as JSON, or where its slices go on given nodes (``diffuse.plan.placement``)."""

from __future__ import annotations

import math
import os

from diffuse.client.heard import Heard
from diffuse.client.routing import PLACEMENTS, capacities, link_hops
from diffuse.errors import DiffuseError
from diffuse.plan.contracts import SlicingPlan, Stage
from diffuse.plan.decoders import check_decoder, pinned_as_asked, without_decoders
from diffuse.plan.fetching import hub_folder
from diffuse.plan.hubmodel import downloads
from diffuse.plan.needs import (DEFAULT_CONTEXT, GIB, _dtype_size, block_costs, context_tokens, load_dtype, pass_bytes,
                                per_pass)
from diffuse.plan.parts import parts_lines, pipeline_parts
from diffuse.plan.placement import MARGIN_FRACTION, MARGIN_MIN_BYTES, Capacity, DoesNotFit, Placement
from diffuse.plan.solver import even_placement, place


def _floats(text: str, what: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",")]
    except ValueError:
        out = []
    if not out or any(not math.isfinite(x) or x <= 0 for x in out):
        raise DiffuseError(f"{what} {text!r}: give positive numbers, comma-separated")
    return out


def plan_command(argv: list[str]) -> int:
    """``diffuse plan MODEL --nodes N``: the slicing plan as JSON (even slices over N placeholder nodes).
    ``--nodes ADDR,...``: the placement on those nodes, from what their hellos say. ``--memory GiB,...``
    (and ``--speed``): the placement on nodes described by hand."""
    from rich.console import Console

    from diffuse.cli.parsing import lan_nodes
    from diffuse.flags import Parser, client_memory_flag, parts_flags, quantize_flag, seconds
    from diffuse.plan.encoders import check_encoders
    from diffuse.plan.quantize import check_mode
    from diffuse.plan.resolve import resolve_model
    from diffuse.plan.planner import analyze, make_plan
    from diffuse.wire.discovery import zeroconf_library

    ap = Parser(prog="diffuse plan", description="the slicing plan, and where its slices go")
    ap.add_argument("model")
    ap.add_argument("--nodes", default=None, help="N (the plan as JSON, even slices over N nodes) or ADDR[#KEY],... "
                    "(the placement on those nodes, from what they say at hello); auto: the nodes announced on the "
                    "local network that serve the model")
    ap.add_argument("--discover-seconds", type=seconds, default=None, metavar="S",
                    help="with --nodes auto: how long to listen for announced nodes (default 3)")
    ap.add_argument("--memory", default=None, metavar="GIB,...", help="nodes described by hand: the memory each may "
                    "take, in GiB")
    ap.add_argument("--speed", default=None, metavar="S,...", help="with --memory: each node's seconds per GiB of "
                    "weights per token, or any numbers in proportion (default: all alike)")
    ap.add_argument("--placement", choices=PLACEMENTS, default="planned")
    ap.add_argument("--dtype", default=None, help="compute dtype (default: what a plain load gives)")
    ap.add_argument("--context", type=int, default=None, help=f"tokens of cache per language-model session "
                    f"(default {DEFAULT_CONTEXT}, at most the model's)")
    ap.add_argument("--patches", type=int, default=1, help="passes in flight at once to plan for (a run's "
                    "--patches; default 1: passes one after another)")
    ap.add_argument("--json", action="store_true", help="print the plan, routed as placed, as JSON")
    quantize_flag(ap, "the nodes' blocks, as the plan counts them")
    parts_flags(ap)  # --encoders, --decoder
    client_memory_flag(ap)
    a = ap.parse_args(argv)
    err = Console(stderr=True)
    try:
        if a.nodes == "auto":
            zeroconf_library()  # or how to install it, before anything loads
        elif a.discover_seconds is not None:
            raise DiffuseError("--discover-seconds applies with --nodes auto")
        a.quantize = check_mode(a.quantize)  # an unknown mode, or torchao missing: refused before anything is read
        path = resolve_model(a.model, "headers")
        encoders = None if a.encoders is None else check_encoders(a.encoders)
        if a.client_memory is not None:  # the encoders where the client's part fits (diffuse.plan.budget)
            from diffuse.plan.budget import fit_encoders, parse_size

            encoders, _ = fit_encoders(path, parse_size(a.client_memory), encoders, a.dtype, check_decoder(a.decoder) is not None)
        subject, draft = analyze(path, bool(encoders), check_decoder(a.decoder) is not None)
        dtype = a.dtype or load_dtype(subject)
        _dtype_size(dtype)
        lan_nodes(a, subject, err)  # --nodes auto: the nodes announced on this network
        if a.memory is None and (a.nodes is None or a.nodes.strip().isdigit()):
            n = int(a.nodes) if a.nodes else 2
            if n < 1:
                raise DiffuseError("--nodes must be at least 1")
            print(pinned_as_asked(make_plan(subject, draft, [f"node{i + 1}" for i in range(n)], compute_dtype=dtype,
                                            quantize=a.quantize), subject, a.decoder).to_json())
            return 0
        heard = Heard()  # what the nodes' hellos say, and the links measured
        plan, p, hops = _placed(a, subject, draft, dtype, heard)
    except DiffuseError as exc:
        from diffuse.cli.parsing import report_error

        return report_error(err, exc)
    if a.json:
        print(pinned_as_asked(plan.with_route(Stage(s.address, s.key, p.rows[i]) for i, s in enumerate(plan.route)
                                              if i in p.used), subject, a.decoder).to_json())
        return 0
    for line in describe(p, subject, plan, dtype, a.context, a.decoder):
        print(line)
    for line in per_mode(subject, plan, dtype, a.context, p):
        print(line)
    if hops is not None:
        print("\nlinks, as measured (a hop costs half the round trip, plus the bytes it carries at the throughput):")
        for line in heard.route_lines([s.address for s in plan.route]):
            print(f"  {line}")
    return 0


def _placed(a, subject, draft, dtype: str, heard: Heard) -> tuple[SlicingPlan, Placement, list | None]:
    """The plan over the nodes ``a`` names (``--memory``: described by hand; else asked), its placement, and the
    hops measured (None for nodes described by hand); ``heard`` keeps what the nodes' hellos said."""
    from diffuse.client.known_nodes import parse_nodes
    from diffuse.plan.planner import make_plan

    if a.patches < 1:
        raise DiffuseError("--patches must be at least 1")
    hops = None
    if a.memory is not None:
        memory = _floats(a.memory, "--memory")
        speed = _floats(a.speed, "--speed") if a.speed else [1.0] * len(memory)
        if len(speed) != len(memory):
            raise DiffuseError(f"--speed names {len(speed)} nodes, --memory {len(memory)}")
        names = [f"node{i + 1}" for i in range(len(memory))]
        caps = [Capacity(nm, int(m * GIB), s if a.speed else None) for nm, m, s in zip(names, memory, speed)]
        plan = make_plan(subject, draft, names, compute_dtype=dtype, quantize=a.quantize)
    else:
        nodes = parse_nodes(a.nodes)
        plan = make_plan(subject, draft, [x for x, _ in nodes], [k for _, k in nodes], dtype, a.quantize)
        caps = ask_nodes(plan, heard)
        hops = link_hops(heard, [s.address for s in plan.route], pass_bytes(plan, subject, dtype), [c.hop_s for c in caps])
    # the VAE (--decoder) is no part of the placement: it goes to the node named, beside its share
    blocks = block_costs(subject, without_decoders(plan.stacks, subject), dtype, a.context, quantize=a.quantize)
    try:
        if a.placement == "even":
            return plan, even_placement(blocks, caps, links=hops, depth=a.patches), hops
        return plan, place(blocks, caps, links=hops, depth=a.patches), hops
    except DoesNotFit as exc:
        raise DoesNotFit(f"{exc}{fitting_modes(subject, plan, dtype, a.context, caps)}") from None


def ask_nodes(plan: SlicingPlan, heard: Heard) -> list[Capacity]:
    """Each node's hello, read for placement (its key checked or pinned as a run would)."""
    from diffuse.client.handshake import Handshake

    hs = Handshake(plan, heard=heard)
    for k, stage in enumerate(plan.route):
        hs.hello(k)
        if heard.report_of(stage.address) is None:
            raise DiffuseError(f"{stage.address} says nothing of its memory or speed (a node older than "
                               "placement): plan with --memory instead")
    from diffuse.plan.encoders import plan_subject

    return capacities(heard, plan.route, plan.compute_dtype, plan.model.content_hash, per_pass(plan_subject(plan)))


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def describe(p: Placement, subject, plan: SlicingPlan, dtype: str, context: int | None = None,
             decoder: str | None = None) -> list[str]:
    """The placement in words: what the model needs, the table, and the expected times (``decoder``: where
    ``--decoder`` puts the VAE)."""
    weights = sum(b.weight_bytes for b in p.blocks)
    state = sum(b.state_bytes for b in p.blocks)
    stacks = ", ".join(f"{s.path} ({s.length})" for s in plan.stacks)
    hub = hub_folder(subject.path)
    name = f"{hub['repo']}@{hub['commit'][:12]}" if hub else os.path.basename(os.path.normpath(subject.path))
    held = f" held {plan.quantize} (--quantize)" if plan.quantize else ""
    head = (f"{name}: {len(p.blocks)} blocks [{stacks}], "
            f"{weights / GIB:.2f} GiB of weights in {dtype}{held}")
    if state:
        head += f", {state / GIB:.2f} GiB of cache per session at {context_tokens(subject, context)} tokens"
    lines = [head]
    if p.blocks[-1].end_bytes:
        lines.append(f"the last node also holds the output head ({p.blocks[-1].end_bytes / GIB:.2f} GiB)")
    lines += parts_lines(pipeline_parts(subject, plan.stacks, p.blocks, _dtype_size(dtype)), dtype)
    if subject.decoders:
        at = "the ring's last node" if decoder == "ring" else f"node {decoder}"
        lines.append(f"  the VAE ({', '.join(subject.decoders)}) decodes on {at} (--decoder), beside its share; that "
                     "node sees the result")
    lines.append("")
    lines += [f"on {len(p.nodes)} node(s), {len(p.used)} used; margin {MARGIN_FRACTION:.0%} of each node's "
              f"memory (at least {MARGIN_MIN_BYTES >> 20} MiB):", ""]
    lines += p.lines()
    fetched = downloads(subject, plan.stacks, [p.rows[i] for i in p.used])
    if fetched is not None:
        nodes, client = fetched
        each = ", ".join(f"{p.nodes[i].name} {_mb(n)}" for i, n in zip(p.used, nodes))
        lines += ["", f"fetched from the Hub (as stored): {each} (their blocks); the client {_mb(client)}"]
    if any(p.measured):
        hops = " + ".join(f"{h * 1000:.2f}" for h in p.hops)
        lines += ["", f"per token: slowest node {p.slowest_s:.3g} s; one pass through every used node in turn "
                  f"{p.pass_s:.3g} s" + (f" (with {len(p.hops)} hops of {hops} ms)" if p.hop_s else "")
                  + (f"; {p.depth} passes in flight: {p.step_s():.3g} s a pass" if p.depth > 1 else "")]
    return lines


def per_mode(subject, plan: SlicingPlan, dtype: str, context: int | None, p: Placement) -> list[str]:
    """The blocks' size held in ``dtype`` and in each ``--quantize`` mode, and how many of these nodes each needs."""
    lines = ["", f"held by mode (--quantize; int4 as a CPU node stores it), and the fewest of these {len(p.nodes)} "
                 "node(s) that hold it:"]
    for mode, size, need in by_mode(subject, plan, dtype, context, p.nodes):
        fits = f"{need} node(s)" if need is not None else "does not fit them"
        mark = "  <- this plan" if mode == plan.quantize else ""
        lines.append(f"  {mode or 'none (' + dtype + ')':<18} {_size(size):>12}   {fits}{mark}")
    return lines


def _size(n: int) -> str:
    return f"{n / GIB:.3f} GiB" if n >= GIB // 10 else f"{n / (1 << 20):.2f} MiB"


def fitting_modes(subject, plan: SlicingPlan, dtype: str, context: int | None, caps: list[Capacity]) -> str:
    """For a model that does not fit ``caps`` as asked: the ``--quantize`` modes it would fit in, and on how many."""
    fits = [f"--quantize {mode} on {need}" for mode, _, need in by_mode(subject, plan, dtype, context, caps)
            if mode and mode != plan.quantize and need is not None]
    return f" (it fits these nodes with {', '.join(fits)})" if fits else ""


def by_mode(subject, plan: SlicingPlan, dtype: str, context: int | None, caps: list[Capacity]):
    """(mode, bytes its blocks take, the fewest of ``caps`` that hold them or None) for no quantization and each
    ``--quantize`` mode."""
    from diffuse.plan.prequant import quantize_modes
    from diffuse.plan.placement import nodes_needed, rooms

    room = rooms(caps)
    for mode in quantize_modes(subject):  # (a GGUF denoiser: only as its file holds it)
        blocks = block_costs(subject, plan.stacks, dtype, context, quantize=mode)
        yield mode, sum(b.weight_bytes + b.held_bytes for b in blocks), nodes_needed(blocks, room)
