"""Which files of a Hub repo Diffuse fetches at all: what its loaders read (``loaded_files``); of those, the
weights (``*.safetensors``) and the rest; and of the rest, what the analysis reads (``analysis_reads``: all that
``diffuse check``, ``diffuse plan`` and a node fetch besides the weights' headers).

Only what loaders read is fetched: safetensors weights (never ``.bin``, ``.onnx``, ``.gguf`` and the like, nor a
``.fp16.``-style variant beside the plain file), the components a diffusers ``model_index.json`` names, and no
media of the model card. Where a folder has a weight index (``*.safetensors.index.json``), the weights there are
the files it names and no other: a ``consolidated.safetensors`` beside a sharded checkpoint (Mistral's repos ship
one, the whole model again) is read by no loader given that folder, so no role fetches a byte of it.
"""

from __future__ import annotations

import json
import os
import re

from diffuse.plan.hub import Listing

_SKIPPED = (".bin", ".pt", ".pth", ".ckpt", ".onnx", ".onnx_data", ".gguf", ".msgpack", ".h5", ".tflite", ".ot",
            ".png", ".jpg", ".jpeg", ".gif", ".webp", ".mp4", ".mp3", ".wav", ".pb", ".mlmodel")
INDEX_SUFFIX = ".safetensors.index.json"  # a sharded checkpoint's weight index (a variant's ends .index.fp16.json)
CONFIG_LIMIT = 1 << 20  # the largest JSON file the analysis reads unless it is a config or index by its name
TOKENIZER_DATA = ("tokenizer.json", "vocab.json")  # JSON, but a tokenizer's vocabulary and rules: no config


def analysis_reads(path: str, size: int) -> bool:
    """Whether the analysis (``diffuse check``, ``diffuse plan``, a node's) reads file ``path`` (a repo path, not
    a weight) of ``size`` bytes: a JSON file (``model_index.json``, each ``config.json``, scheduler, generation and
    processor configs, the tokenizer's config, weight indexes, Diffuse's kept verdict and defaults: the configs
    the stacks are found from, and the JSON files ``analyzers.remote_code`` searches for an ``auto_map``, up to
    ``CONFIG_LIMIT``), and shipped ``.py`` files (refused as remote code). Never a tokenizer's data
    (``tokenizer.json``, ``vocab.json``, ``merges.txt``, ``spiece.model``: what only a client runs), nor the card."""
    name = path.rsplit("/", 1)[-1]
    if name.endswith(".py"):
        return True
    if not name.endswith(".json") or name in TOKENIZER_DATA:
        return False
    return size <= CONFIG_LIMIT or name == "model_index.json" or name.endswith(("config.json", INDEX_SUFFIX))


def loaded_files(found: Listing, folder: str) -> list[str]:
    """The files of a repo that Diffuse's loaders read (see the module's docstring); ``folder``: where the repo is
    fetched to, holding its ``model_index.json`` (for a pipeline) and its weight indexes where they were fetched
    (a folder's index not fetched yet leaves every safetensors file there in: ``weight_indexes`` says which to
    fetch first)."""
    paths = set(found.files)
    diffusers = "model_index.json" in paths
    components = None
    if diffusers:
        try:
            with open(os.path.join(folder, "model_index.json")) as f:
                components = {k for k, v in json.load(f).items() if not k.startswith("_") and isinstance(v, list)}
        except (OSError, ValueError, AttributeError):
            components = {p.split("/", 1)[0] for p in paths if "/" in p}
    indexed = _indexed(paths, folder)
    out = []
    for p in sorted(paths):
        name = p.rsplit("/", 1)[-1]
        if name.lower().endswith(_SKIPPED) or name.startswith(".") or p.startswith((".", "onnx/", "flax/")):
            continue
        if diffusers and "/" not in p and p.endswith(".safetensors"):
            continue  # a single-file checkpoint beside the pipeline's folders: from_pretrained reads the folders
        if diffusers and "/" in p and p.split("/", 1)[0] not in components:
            continue
        if p.endswith(".safetensors") and (_is_variant(p, paths) or p not in indexed.get(_folder_of(p), {p})):
            continue
        out.append(p)
    return out


def weight_indexes(paths) -> list[str]:
    """The weight indexes among ``paths`` (repo paths): ``*.safetensors.index.json``, a variant's left out."""
    return [p for p in paths if p.endswith(INDEX_SUFFIX) and "." not in p.rsplit("/", 1)[-1][: -len(INDEX_SUFFIX)]]


def _folder_of(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


def _indexed(paths: set, folder: str) -> dict[str, set[str]]:
    """Repo folder -> the safetensors files (repo paths) its weight indexes name, for each folder with an index
    fetched to ``folder`` and readable; a folder missing here keeps every safetensors file it has."""
    out: dict[str, set[str]] = {}
    for index in weight_indexes(paths):
        try:
            with open(os.path.join(folder, index)) as f:
                named = set(json.load(f)["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        here = _folder_of(index)
        out.setdefault(here, set()).update(
            os.path.normpath(os.path.join(here, str(n))).replace(os.sep, "/") for n in named)
    return out


def _is_variant(path: str, paths: set) -> bool:
    """``x.fp16.safetensors`` (or a shard of one) where the plain weights are there too."""
    folder, name = os.path.split(path)
    parts = name.split(".")
    if len(parts) < 3:
        return False
    stem = re.sub(r"-\d{5}-of-\d{5}$", "", parts[0])
    return any(os.path.split(q)[0] == folder and q.rsplit("/", 1)[-1].startswith(stem) and
               q.rsplit("/", 1)[-1].count(".") == 1 and q.endswith(".safetensors") for q in paths)
