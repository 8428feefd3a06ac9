"""The models shipped inside the package, so a fresh install generates something real with no network.

``default_model_dir()`` is tiny-wan-shapes: a Wan 2.1-architecture text-to-video
model trained in this repository (``python -m diffuse.train``). Every folder
under ``diffuse/trained/`` is a shipped model, and ``--model NAME`` finds it by
its folder name (see ``diffuse.modelfiles.resolve_model``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["SHIPPED_MODEL_NAME", "default_model_dir", "shipped_models"]

SHIPPED_MODEL_NAME = "tiny-wan-shapes"
TRAINED = Path(__file__).resolve().parent / "trained"


def shipped_models() -> dict[str, str]:
    """Name -> folder of every pipeline shipped under diffuse/trained/."""
    found = sorted(TRAINED.glob("*/model_index.json")) if TRAINED.is_dir() else []
    return {p.parent.name: str(p.parent) for p in found}


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
