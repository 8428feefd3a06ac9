"""The pipeline's VAE on a node (``--decoder``, ``diffuse.plan.decoders``), from the client's side.

``DecoderPlace`` is what ``diffuse.split`` was asked (checked before any node
starts: the node named must be one of the run's). ``DecoderPin`` routes the
VAE's stack of one block: the other stacks are placed as they would be
without it, then the VAE's block goes to the node named (the route's last for
``ring``), every other node given an empty slice of it; a node whose memory
cannot hold it beside its share is refused in one line before anything loads.
``DecoderCalls`` puts stand-ins in place of the VAE's ``decode`` and
``encode`` while the ring is attached: each call goes through the ring as a
plain pass into that stack, with the VAE's settings (tiling, slicing, their
sizes) as the client's VAE has them, and comes back in the shape the VAE's own
method returns (a distribution drawn from here, with the pipeline's generator).
"""

from __future__ import annotations

import dataclasses
import functools
import time
import typing
from dataclasses import dataclass, field

from diffuse.errors import DiffuseError
from diffuse.plan.components import CODER_OPS, runtime_settings
from diffuse.plan.contracts import ReturnMap
from diffuse.plan.decoders import RING, check_decoder, check_tiling, decoder_stacks, node_named, pin

TILE_FACTOR = 3  # an untiled decode is planned to take this many of its largest activation at once


@dataclass
class DecoderPlace:
    """Where ``diffuse.split`` was asked to put the VAE: ``where`` as given (``ring`` or a node's name), ``index``
    its place in the node list (None: the route's last), ``tiling`` (auto, on, off)."""

    where: str
    index: int | None
    tiling: str = "auto"

    @classmethod
    def of(cls, where, tiling, info, nodes: list | None, local, groups: int, loaded=None) -> "DecoderPlace | None":
        """The place asked for (``where``: ``--decoder``; None where the pipeline was loaded with its VAE on the
        ring: the ring's last node), checked against the run's nodes (``nodes``: (address, key) pairs, None for
        local nodes, as many as ``local`` plans) before any starts; None for the client, which a pipeline loaded
        without its VAE's weights (``loaded``: its ``ModelInfo`` then) cannot be."""
        where = check_decoder(where) if where is not None else (RING if info.decoders else None)
        tiling = check_tiling(tiling)
        if where is None:
            if getattr(loaded, "decoders", False):
                raise DiffuseError("this pipeline was loaded without its VAE's weights (decoder=...): split it with "
                                   "its VAE on a node (decoder=\"ring\" or a node), or load it again to decode here")
            return None
        if not info.subject.decoders:
            raise DiffuseError("--decoder: this pipeline has no VAE (a diffusers model that decodes) to put on a node")
        if groups > 1:
            raise DiffuseError("--decoder puts the VAE on one node; with --branch-groups each group is a ring of "
                               "its own: use one group, or --decoder client")
        addresses = [a for a, _ in nodes] if nodes is not None else None
        return cls(where, node_named(where, addresses, local.count if local is not None else 0), tiling)

    def pin(self, nodes: list, stacks) -> "DecoderPin":
        """The pin of the VAE's stacks (``stacks``, their paths) on the node named among ``nodes`` (as started)."""
        return DecoderPin(tuple(stacks), nodes[self.index][0] if self.index is not None else None)


@dataclass
class DecoderPin:
    """The VAE's stacks (``stacks``) on one node: ``address``, or the route's last (None)."""

    stacks: tuple[str, ...]
    address: str | None = None
    room: dict = field(default_factory=dict)  # node address -> bytes left beside its weights, where it said

    def routed(self, plan, route_rest, candidates, usable: list[bool], heard):
        """``plan`` routed: the other stacks by ``route_rest(plan without the VAE's)``, the VAE's block on the pinned
        node; refused where that node is not usable or cannot hold it beside its share."""
        rest = dataclasses.replace(plan, stacks=tuple(s for s in plan.stacks if s.path not in self.stacks))
        route = route_rest(rest).route
        address = self.address or route[-1].address
        live = [c.address for c, ok in zip(candidates, usable) if ok]
        if address not in live:
            raise DiffuseError(f"the node named to hold the VAE ({address}) is not usable (it failed, or did not "
                               "answer): name another with --decoder, or --decoder client")
        # a node the placement left out comes after the others, holding the VAE only
        routed, at = pin(plan.with_route(route), self.stacks, address, candidates)
        self._check_room(plan, routed.route[at], heard)
        return routed

    def _check_room(self, plan, stage, heard) -> None:
        """Refuse a node whose memory cannot hold the VAE beside its share of the other stacks (one line)."""
        from diffuse.plan.encoders import plan_subject
        from diffuse.plan.needs import GIB, block_costs

        report = heard.report_of(stage.address) if heard is not None else None
        if report is None or report.available is None:
            return
        try:
            subject = plan_subject(plan)
            held = [s for s in plan.stacks if stage.slice_of(s.path) is not None and not stage.slice_of(s.path).empty]
            costs = block_costs(subject, held, plan.compute_dtype, cache=heard.costs)
        except (DiffuseError, OSError, ValueError):  # headers this client cannot read: the node reads its own
            return
        mine = {(sl.stack, i) for sl in stage.slices for i in range(sl.start, sl.stop)}
        vae = sum(b.weight_bytes for b in costs if b.stack in self.stacks)
        share = sum(b.weight_bytes + b.held_bytes for b in costs
                    if b.stack not in self.stacks and (b.stack, b.index) in mine)
        if vae + share > report.available:
            raise DiffuseError(f"--decoder: node {stage.address} has {report.available / GIB:.3f} GiB available; the "
                               f"VAE's weights take {vae / GIB:.3f} GiB beside its {share / GIB:.3f} GiB of the other "
                               "stacks: name a node with more memory, or --decoder client")
        self.room[stage.address] = report.available - vae - share


class DecoderCalls:
    """Stand-ins for the VAEs' ``decode`` and ``encode`` of a pipeline split by ``splitter``; ``vaes``: stack path
    -> the pipeline's VAE (weightless here), ``tiling``: ``--decoder-tiling``, ``pin``: where they are held."""

    def __init__(self, splitter, vaes: dict, tiling: str = "auto", pin: DecoderPin | None = None, say=None):
        self.splitter, self.vaes, self.tiling, self.pin = splitter, vaes, tiling, pin
        self.say = say or (lambda line: None)
        self.passes = {op: 0 for op in CODER_OPS}  # passes through the ring, by what they asked
        self.tiled = 0  # decodes tiled because the node's memory asked for it (auto)

    def install(self, changes) -> None:
        """The stand-ins in place of each VAE's methods (``changes``: the splitter's, undone when it detaches); the
        VAE's block, kept for a first call that never comes (its return map is known), freed."""
        for path, vae in self.vaes.items():
            stack = self.splitter.plan.stack(path)
            if self.splitter.first_block(path) is not None:
                self.splitter.learned(stack, _call_plan(), ReturnMap(True, [0], ["sample"]))
            for op in CODER_OPS:
                if callable(getattr(vae, op, None)):
                    changes.set(vae, op, functools.partial(self.call, path, vae, op))
            # its weights are weightless here: where its inputs go, said as diffusers reads it of a VAE whose
            # weights an offloading hook brings in (``get_module_execution_device``): where the client computes
            changes.set(vae, "_hf_hook", Executed(self.device()))

    def device(self):
        """Where the client's part of the model computes (its first real parameter's device; the CPU)."""
        import torch

        from diffuse.plan.devices import device_of

        found = device_of(p for p in self.splitter.denoiser.parameters() if p.device.type != "meta")
        return found if found is not None else torch.device("cpu")

    def call(self, path: str, vae, op: str, *args, **kwargs):
        """``vae.decode(...)`` (or ``encode``) answered by the node holding it, in the shape the method returns."""
        from diffuse.plan.calltree import flatten, slot_names

        splitter = self.splitter
        if splitter.ring is None:
            raise DiffuseError("this pipeline's VAE is held by a node: call it inside `with diffuse.split(...)`")
        return_dict = kwargs.pop("return_dict", True)
        settings = self.settings(vae, op, args, kwargs)
        call = (op, settings, *args)
        tree, tensors = flatten(call, kwargs)
        if not tensors:
            raise DiffuseError(f"{type(vae).__name__}.{op} was called without a tensor to {op}")
        rmap = ReturnMap(True, [0], [slot_names(tree)[0]])
        if splitter.patcher is not None:  # a patched pass sent ahead is answered first
            splitter.patcher.settle()
        t0 = time.perf_counter()
        try:
            out = splitter.ring.call(path, call, kwargs, rmap)
        finally:
            splitter.stand_in_s += time.perf_counter() - t0
        self.passes[op] += 1
        return answered(vae, op, out, return_dict)

    def settings(self, vae, op: str, args: tuple, kwargs: dict) -> dict:
        """The VAE's settings the node decodes with: the client's VAE's own, tiling as ``--decoder-tiling`` says
        (auto: as the VAE is set, and tiled where an untiled decode would not fit the node's room)."""
        settings = runtime_settings(vae)
        if self.tiling != "auto" or op != "decode":
            if self.tiling == "on" and "use_tiling" not in settings:
                raise DiffuseError(f"--decoder-tiling on: {type(vae).__name__} does not decode in tiles")
            if self.tiling != "auto" and "use_tiling" in settings:
                settings["use_tiling"] = self.tiling == "on"
            return settings
        room = self._room()
        if settings.get("use_tiling", True) or room is None:
            return settings
        peak = decode_peak(vae, settings, args, kwargs)
        if peak is not None and TILE_FACTOR * peak > room:
            settings["use_tiling"] = True
            self.tiled += 1
            self.say(f"the VAE decodes in tiles on its node: an untiled decode would take about "
                     f"{TILE_FACTOR * peak / 2**20:.0f} MiB, it has {room / 2**20:.0f} MiB beside its weights")
        return settings

    def _room(self) -> int | None:
        """Bytes the node holding the VAE has beside its weights, where it said (None: not known)."""
        plan = self.splitter.ring.plan if self.splitter.ring is not None else None
        if self.pin is None or plan is None:
            return None
        holder = next((s.address for s in plan.route for sl in s.slices if sl.stack in self.vaes and not sl.empty),
                      None)
        return self.pin.room.get(holder)


@dataclass(frozen=True)
class Executed:
    """Where a weightless VAE's inputs belong, in the attribute diffusers reads it from (an offloading hook's)."""

    execution_device: object


def _call_plan():
    from diffuse.plan.contracts import CallPlan

    return CallPlan({"args": [], "kwargs": {}}, [], [])


def answered(vae, op: str, out, return_dict: bool):
    """What the VAE's own ``op`` returns, made of the tensor the node sent: a decode's sample; an encode's latent
    distribution (its class, from the method's annotations, made of the parameters sent: the pipeline draws from
    it here, with its own generator) or latents; as a tuple, or in the method's output class (``return_dict``)."""
    import torch

    try:
        arms = typing.get_args(typing.get_type_hints(getattr(type(vae), op)).get("return"))
    except Exception:  # annotations this Python cannot resolve: the plain tuple
        arms = ()
    tupled = next((a for a in arms if typing.get_origin(a) is tuple), None)
    inner = typing.get_args(tupled)[0] if tupled is not None and typing.get_args(tupled) else torch.Tensor
    if op == "encode" and isinstance(inner, type) and not issubclass(inner, torch.Tensor):
        out = inner(out)
    if not return_dict:
        return (out,)
    cls = next((a for a in arms if dataclasses.is_dataclass(a)), None)
    if cls is None:
        raise DiffuseError(f"{type(vae).__name__}.{op} names no output class to answer return_dict=True with")
    return cls(**{dataclasses.fields(cls)[0].name: out})


def decode_peak(vae, settings: dict, args: tuple, kwargs: dict) -> int | None:
    """The largest activation of the VAE's own decode of these arguments, in bytes, run here weightless (on the
    meta device: shapes only, nothing computed); None where it cannot run so."""
    import torch
    from torch.utils._pytree import tree_map

    peak = [0]

    def seen(_module, _inputs, output):
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(t, torch.Tensor):
                peak[0] = max(peak[0], t.numel() * t.element_size())

    if any(p.device.type != "meta" for p in vae.parameters()):
        return None
    had = {k: getattr(vae, k) for k in settings}
    hooks = [m.register_forward_hook(seen) for m in vae.modules()]
    try:
        for k, v in settings.items():
            setattr(vae, k, v)
        meta = tree_map(lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v, (tuple(args), dict(kwargs)))
        with torch.no_grad():
            type(vae).decode(vae, *meta[0], **{**meta[1], "return_dict": False})
    except Exception:
        return None
    finally:
        for h in hooks:
            h.remove()
        for k, v in had.items():
            setattr(vae, k, v)
    return peak[0] or None


def decoders_of(pipe, info) -> dict:
    """{stack path: the pipeline's VAE} for each VAE ``info`` (a ``ModelInfo``) holds on the ring."""
    return {path: getattr(pipe, path) for path in decoder_stacks(info.draft["stacks"], info.subject)}
