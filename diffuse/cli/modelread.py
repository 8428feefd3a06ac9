"""The model a ``diffuse query`` request names, read before anything loads.

``read_model`` finds its folder (the shipped model by default), refuses it early where a stored verdict
says so (``diffuse.cli.check.refuse_early``, before torch is imported), reads its config into the model's
analysis (``diffuse.client.api.ModelInfo``), settles where the client's ends compute, and checks the request
against what the model is (``diffuse.client.request.QueryRequest.check_for``), putting the nodes heard on the
network in for ``--nodes auto``; a diffusion run's output path is checked too
(``diffuse.client.writers.check_output_path``). Every refusal happens here, before any node is contacted.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import NamedTuple

from diffuse.client.request import QueryRequest


class ModelRead(NamedTuple):
    """What ``read_model`` found: the model's analysis (``diffuse.client.api.ModelInfo``), the name it was asked by,
    and where the client's ends compute (``diffuse.plan.devices.Compute``)."""

    info: object
    name: str
    compute: object


def read_model(q: QueryRequest, console, command: str = "diffuse query", language: bool = False
               ) -> tuple[QueryRequest, ModelRead]:
    """The model request ``q`` names, read and checked (see the module's docstring); the request as checked
    against it (``--nodes auto`` replaced by the nodes heard), and what was read. ``command`` opens the first
    status line; ``language``: the command talks to language models only (``diffuse chat``)."""
    from diffuse.cli.check import refuse_early
    from diffuse.plan.resolve import resolve_model
    from diffuse.client.progress import phase, status

    ask = q.model
    if ask.model is None:
        from diffuse.plan.shipped import SHIPPED_MODEL_NAME, default_model_dir

        path, name = default_model_dir(), SHIPPED_MODEL_NAME
    else:
        quiet = (lambda line: None) if q.output.quiet else None
        path, name = resolve_model(ask.model, "headers", quiet), ask.model
    where = "" if os.path.basename(path.rstrip("/")) == name else f" from {path}"
    refuse_early(path, name, q.call)  # a Hub model refused here has sent its configs and headers only
    whole = ask.model is not None and (ask.whole or q.ring.nodes is None)  # a Hub model's every block fetched here
    from diffuse.client.modelinfo import client_role
    from diffuse.plan.decoders import check_decoder
    from diffuse.plan.encoders import check_encoders

    encoders = None if q.ring.options.encoders is None else check_encoders(q.ring.options.encoders)
    if ask.client_memory is not None:  # the encoders go where the client's part fits (diffuse.plan.budget)
        with phase(console, f"{command}: {name}{where}; weighing its parts against --client-memory (importing "
                   "torch and its library)", q.output.quiet):
            encoders, q = within_budget(q, path, encoders, console)
    if ask.model is not None and not whole:  # the client's part: without the encoders' layers where nodes hold them
        path = resolve_model(ask.model, client_role(encoders, check_decoder(q.ring.options.decoder)), quiet)
    with phase(console, f"{command}: {name}{where}; reading its config (importing torch and its library)",
               q.output.quiet):
        import torch

        from diffuse.client.api import ModelInfo
        from diffuse.plan.devices import Compute

        if ask.threads:
            torch.set_num_threads(ask.threads)
        info = ModelInfo.of(path, encoders=bool(encoders), decoders=check_decoder(q.ring.options.decoder) is not None)
        model = ModelRead(info, name, Compute.of(ask.device, ask.dtype, info.path, info.subject.denoiser or None))
    if language and not info.subject.autoregressive:
        from diffuse.errors import DiffuseError

        raise DiffuseError(f"{info.path} is a diffusion pipeline; {command} talks to language models")
    q.check_for(info.subject.autoregressive)
    if not info.subject.autoregressive:
        from diffuse.client.writers import check_output_path

        check_output_path(q.output.out, info.draft)  # a file name no writer takes, refused before loading
    if q.ring.nodes == "auto":
        from diffuse.client.lan import heard_nodes

        heard = heard_nodes(info.subject, q.ring.discover_seconds, lambda line: status(console, line))
        q = replace(q, ring=replace(q.ring, nodes=heard))
    if whole:  # run whole, or by local nodes (no --nodes): all of it, its room checked before the first byte,
        resolve_model(ask.model, "whole", quiet)  # once the model and the request passed every check
    return q, model


def within_budget(q: QueryRequest, path: str, encoders: bool | None, console) -> tuple[bool, QueryRequest]:
    """``--client-memory``: where the encoders go so that the client's part fits it (``diffuse.plan.budget``), said in
    a status line; the request with that place set."""
    from diffuse.client.progress import status
    from diffuse.plan.analysis import ModelSubject
    from diffuse.plan.budget import _gib, fit_encoders, parse_size
    from diffuse.plan.decoders import check_decoder
    from diffuse.plan.devices import Compute, dtype_name

    ask = q.model
    compute = Compute.of(ask.device, ask.dtype, path, ModelSubject.from_path(path).denoiser or None)
    dtype = dtype_name(compute.dtype, "") if compute.dtype is not None else None
    ring, held = fit_encoders(path, parse_size(ask.client_memory), encoders, dtype or None,
                              check_decoder(q.ring.options.decoder) is not None)
    status(console, f"--client-memory {ask.client_memory}: the client holds {_gib(held)} of weights, with the "
                    f"encoders {'on the ring' if ring else 'here'}", q.output.quiet)
    return ring, replace(q, ring=replace(q.ring, options=replace(q.ring.options, encoders="ring" if ring else "client")))


def quantize_client(model, info, mode: str | None) -> None:
    """``--quantize-client``: the client's own linear layers held in ``mode`` (``diffuse.plan.quantize.quantize_ends``)."""
    if mode not in (None, "none"):
        from diffuse.plan.quantize import quantize_ends

        quantize_ends(model, info.draft["stacks"], mode, info.subject.denoisers, info.subject.several)
