"""What the config-phase analysis found about the pipeline (or model) a split runs: ``ModelInfo``, kept on a
pipeline loaded by ``diffuse.from_pretrained`` (``model_info`` finds it again, or analyses the folder)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from diffuse.errors import DiffuseError

MODEL_DEFAULTS_FILE = "diffuse_defaults.json"  # call defaults a model folder may declare for its size


@dataclass
class ModelInfo:
    """What the config-phase analysis found about a pipeline folder (kept on pipelines loaded here)."""

    path: str
    subject: object  # diffuse.plan.analysis.ModelSubject
    draft: dict
    encoders: bool = False  # the pipeline's encoders hold stacks too (--encoders ring, diffuse.plan.encoders)
    decoders: bool = False  # ... its VAE too, held by one node (--decoder, diffuse.plan.decoders)

    @classmethod
    def of(cls, model: str | None, role: str = "client", encoders: bool = False,
           decoders: bool = False) -> "ModelInfo":
        """``model`` found (``resolve_model``; a Hub id fetched as far as ``role`` needs) and analysed
        (``encoders``: with its encoders' stacks, to be held by nodes; ``decoders``: with its VAE's)."""
        from diffuse.plan.resolve import resolve_model
        from diffuse.plan.planner import analyze

        if model is None:
            from diffuse.plan.shipped import default_model_dir

            path = default_model_dir()
        else:
            path = resolve_model(model, client_role(encoders, decoders) if role == "client" else role)
        subject, draft = analyze(path, encoders, decoders)  # refusals happen here, before anything is loaded
        return cls(path, subject, draft, encoders, bool(subject.decoders))

    @property
    def output_kind(self) -> str:
        return self.draft.get("output_kind", "image")

    def call_defaults(self) -> dict:
        """Call arguments the folder declares for the size it is made for (the embedded model does)."""
        f = os.path.join(self.path, MODEL_DEFAULTS_FILE)
        if not os.path.isfile(f):
            return {}
        with open(f) as fh:
            return json.load(fh)


def client_role(encoders, decoders) -> str:
    """What a client fetches of a Hub model (``diffuse.plan.hubmodel``'s roles): without the layers of its encoders
    (``encoders``, on the ring) or any of its VAE (``decoders``, on a node) where nodes hold them."""
    return "client" + ("-ring" if encoders else "") + ("-decoder" if decoders else "")


def model_info(pipe_or_model, model: str | None = None, encoders: bool | None = None,
               decoders: bool | None = None, role: str = "client") -> ModelInfo:
    """The analysis of the folder a pipeline (or a denoiser) came from (``encoders``: with its encoders' stacks
    or without, ``decoders``: with its VAE's or without; None: as it was loaded; ``role``: what a Hub id ``model``
    is fetched for, ``ModelInfo.of``)."""
    info = getattr(pipe_or_model, "_diffuse", None)
    if info is not None and (model is None or info.path == model):
        encoders = info.encoders if encoders is None else encoders
        decoders = info.decoders if decoders is None else decoders
        if encoders == info.encoders and decoders == info.decoders:
            return info
        return ModelInfo.of(info.path, encoders=encoders, decoders=decoders)
    if model is None:
        model = getattr(pipe_or_model, "name_or_path", None) or getattr(
            getattr(pipe_or_model, "config", None), "_name_or_path", None)
        if model and not os.path.isfile(os.path.join(model, "model_index.json")) and not _names_architectures(model):
            parent = os.path.dirname(os.path.normpath(model))  # a denoiser saved inside its pipeline folder
            model = parent if os.path.isfile(os.path.join(parent, "model_index.json")) else None
    if not model:
        raise DiffuseError("cannot tell which pipeline folder this came from: pass model=PATH")
    return ModelInfo.of(model, role, encoders=bool(encoders), decoders=bool(decoders))


def _names_architectures(folder: str) -> bool:
    """A transformers model folder: a config.json naming its architectures."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            return bool(json.load(f).get("architectures"))
    except (OSError, ValueError, AttributeError):
        return False


