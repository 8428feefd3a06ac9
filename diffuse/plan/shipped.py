"""The models shipped inside the package, so a fresh install generates something real with no network.

``default_model_dir()`` is tiny-wan-shapes: a Wan 2.1-architecture text-to-video
model trained in this repository (``python -m diffuse.train``), the default of
``diffuse query``. ``default_chat_model_dir()`` is tiny-qwen-chat: a
Qwen2-architecture chat model trained here too (``python -m diffuse.train
chat``), the default of ``diffuse chat``. Every folder under
``diffuse/trained/`` holding a pipeline (model_index.json) or a transformers
model (config.json) is a shipped model, and ``--model NAME`` finds it by its
folder name (see ``diffuse.plan.resolve.resolve_model``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CHAT_MODEL_NAME", "SHIPPED_MODEL_NAME", "default_chat_model_dir", "default_model_dir", "shipped_models"]

SHIPPED_MODEL_NAME = "tiny-wan-shapes"
CHAT_MODEL_NAME = "tiny-qwen-chat"
TRAINED = Path(__file__).resolve().parent.parent / "trained"


def shipped_models() -> dict[str, str]:
    """Name -> folder of every model shipped under diffuse/trained/: pipelines (model_index.json) and
    transformers models (config.json); the default pipeline first, then by name."""
    found = {}
    if TRAINED.is_dir():
        for folder in sorted(TRAINED.iterdir()):
            if (folder / "model_index.json").is_file() or (folder / "config.json").is_file():
                found[folder.name] = str(folder)
    first = {k: found.pop(k) for k in (SHIPPED_MODEL_NAME,) if k in found}
    return {**first, **found}


def default_model_dir() -> str:
    """The embedded default: tiny-wan-shapes, trained here and shipped inside the package.

    See ``diffuse/trained/tiny-wan-shapes/README.md`` (its model card) and
    ``python -m diffuse.train`` (the command that made it).
    """
    path = shipped_models().get(SHIPPED_MODEL_NAME)
    if path is None:
        from diffuse.errors import DiffuseError

        raise DiffuseError(f"the embedded model is missing from {TRAINED / SHIPPED_MODEL_NAME}: reinstall diffuse, "
                           "or give --model")
    return path


def default_chat_model_dir() -> str:
    """The embedded chat model: tiny-qwen-chat, a Qwen2-architecture language model trained here and shipped
    inside the package (model card: ``diffuse/trained/tiny-qwen-chat/README.md``; made by
    ``python -m diffuse.train chat``)."""
    path = shipped_models().get(CHAT_MODEL_NAME)
    if path is None:
        from diffuse.errors import DiffuseError

        raise DiffuseError(f"the embedded chat model is missing from {TRAINED / CHAT_MODEL_NAME}: reinstall diffuse, "
                           "or give --model")
    return path
