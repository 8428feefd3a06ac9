"""A pipeline's encoders on the ring: their block stacks split into slices like the denoiser's.

A diffusion pipeline's text encoders (a T5 or UMT5 encoder, CLIP's text model, a
Llama, Gemma or Qwen language model read for its hidden states) are often larger
than the client that runs the pipeline. With ``--encoders ring`` each such
component joins the denoiser among the components whose stacks nodes hold, as
Wan 2.2's second expert does (``diffuse.plan.analysis.Denoisers``): its stacks
are named from it (``text_encoder.encoder.block``), found by shape like any
other (``analyzers.stack_finder``), and called through stand-ins when the
pipeline encodes its prompt (``diffuse.client.encoders``). The tokenizer, the
token embedding and the final norm stay with the client.

An encoder is found by what the folder says, never by its name: a component
that transformers loads (``model_index.json`` names the library) and that has a
``config.json`` (a model, not a tokenizer or a processor).

``ENCODERS``: where the encoders go. ``client`` (the default) keeps them whole on
the client, as plain diffusers holds them; ``ring`` puts their stacks on the
nodes (every node of the ring holds a slice of each, beside its slice of the
denoiser: an encoder runs once per request).
"""

from __future__ import annotations

import dataclasses
import os

ENCODERS = ("client", "ring")


def check_encoders(where: str | None) -> bool:
    """Whether ``--encoders`` (None: the default, client) puts the encoders on the ring; anything else refused."""
    from diffuse.errors import DiffuseError

    if where in (None, "client"):
        return False
    if where == "ring":
        return True
    raise DiffuseError(f"--encoders {where}: choose {' or '.join(ENCODERS)}")


def encoder_components(path: str, model_index: dict, taken) -> list[str]:
    """The components of the pipeline at ``path`` that transformers loads and that are models (a config.json in
    their folder), in model_index.json's order, leaving out ``taken``."""
    found = []
    for name, entry in model_index.items():
        if name in taken or name.startswith("_") or not isinstance(entry, list) or len(entry) != 2:
            continue
        if entry[0] == "transformers" and entry[1] and os.path.isfile(os.path.join(path, name, "config.json")):
            found.append(name)
    return found


def with_encoders(subject):
    """``subject`` (a diffusion pipeline's) with its encoder components among the components holding stacks,
    after its denoisers; the same subject where the pipeline has none."""
    from diffuse.plan.analysis import component_configs

    names = encoder_components(subject.path, subject.model_index, subject.denoisers)
    if not names:
        return subject
    every = (*subject.denoisers, *names)
    configs = component_configs(subject.path, subject.model_index, every)
    return dataclasses.replace(subject, denoiser_config=configs, denoisers=every, encoders=tuple(names), _meta=None)


def encoder_stacks(stacks, subject) -> list[str]:
    """The paths of ``stacks`` that belong to one of the subject's encoders."""
    heads = tuple(f"{name}." for name in getattr(subject, "encoders", ()))
    return [s.path for s in stacks if heads and s.path.startswith(heads)]


def plan_subject(plan):
    """The subject a plan was made from: its folder's, with the encoders' stacks where the plan's model is the
    pipeline with them (its content hash, which covers every component holding stacks, tells)."""
    from diffuse.plan.analysis import ModelSubject

    subject = ModelSubject.from_path(plan.model.path)
    if subject.content_hash() != plan.model.content_hash:
        with_them = with_encoders(subject)
        if with_them is not subject and with_them.content_hash() == plan.model.content_hash:
            return with_them
    return subject
