"""Where a model named on the command line is: a folder, a model shipped in the package, or a Hub id."""

from __future__ import annotations

import os

from diffuse.errors import DiffuseError


def resolve_model(model: str, role: str = "whole", say=None) -> str:
    """A local model folder for ``model``: a path; the name of a model shipped in the package
    (``tiny-wan-shapes``, ``tiny-qwen-chat``, see ``diffuse.plan.shipped.shipped_models``); or a Hugging Face
    Hub id, ``ORG/NAME[@REVISION]``, fetched as far as ``role`` needs (``diffuse.plan.hubmodel``: "headers",
    "node", "client", "client-ring", "client-decoder", "client-ring-decoder", "whole"). Offline
    (``HF_HUB_OFFLINE``) a Hub id is what was fetched here before, or a
    snapshot in the Hugging Face cache (``hf download``). ``say``: where fetching says its progress (default: standard
    error; ``lambda line: None`` for none)."""
    if os.path.isdir(model):
        return os.path.abspath(model)
    if os.path.exists(model):
        raise DiffuseError(f"{model} is a file; --model wants a diffusers pipeline folder")
    from diffuse.plan.shipped import shipped_models

    shipped = shipped_models()
    if model in shipped:
        return shipped[model]
    from diffuse.plan.hub import hub_ref, offline

    ref = hub_ref(model)
    if ref is not None:
        from diffuse.plan.hubmodel import fetch_model

        try:
            return fetch_model(ref, role, say)
        except DiffuseError as exc:
            if not offline():
                raise
            fetched_here = exc  # offline and not fetched here: perhaps in the Hugging Face cache
    from huggingface_hub import constants, snapshot_download

    try:
        if ref is not None:
            return snapshot_download(ref.repo, revision=ref.revision, local_files_only=True)
        return snapshot_download(model, local_files_only=True)
    except Exception as exc:  # not cached, or not a hub id at all
        from diffuse.plan.fetching import repo_root

        if ref is not None and os.path.isdir(repo_root(ref.repo)):
            raise fetched_here from None  # fetched here in part: what it lacks
        import difflib

        near = difflib.get_close_matches(model, list(shipped), n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        if ref is not None:
            tried = (f"not fetched here nor in the Hugging Face cache {constants.HF_HUB_CACHE}, and the Hub may not "
                     "be reached (HF_HUB_OFFLINE is set); run once without HF_HUB_OFFLINE to fetch it, or ")
        else:
            tried = (f"and not a Hub id (ORG/NAME[@REVISION]) nor in the Hugging Face cache {constants.HF_HUB_CACHE} "
                     f"({type(exc).__name__}); ")
        raise DiffuseError(
            f"model {model!r} not found: no folder {os.path.abspath(model)}, no shipped model of that name (shipped: "
            f"{', '.join(shipped) or 'none'}), {tried}{hint}give a diffusers pipeline folder (model_index.json and "
            "a folder per component), a transformers model folder (config.json naming its architectures, "
            "*.safetensors), or a Hub id, ORG/NAME[@REVISION], fetched as it runs"
        ) from exc


def model_name(model: str, path: str) -> str:
    """The name a model given as ``model`` (what ``resolve_model`` took) and found at ``path`` goes by where it
    is listed (``diffuse serve``'s ``/v1/models``, its page, the ``model`` of a request): a Hub id as given
    (``ORG/NAME``, or ``ORG/NAME@REVISION``), not the commit its folder is named by; else the folder's name (a
    shipped model's is its name)."""
    from diffuse.plan.hub import hub_ref

    ref = hub_ref(model) if model else None
    return str(ref) if ref is not None else os.path.basename(os.path.normpath(path))
