"""Refuse checkpoints that ship their own Python code; import the installed libraries they name.

A ``.py`` file inside the checkpoint folder that model_index.json or a
component config (``auto_map``, ``custom_pipeline``) points at would need
``trust_remote_code``, which runs a stranger's code on the nodes: Diffuse never
grants it. A transformers folder is refused for an ``auto_map`` in config.json
or in any JSON file beside it (a tokenizer's or processor's own code). A component library that is
an installed Python package the user chose is not remote code: it is imported
here, because diffusers only loads components from libraries already in
``sys.modules`` (see FACTS, last section).
"""

from __future__ import annotations

import importlib
import json
import os

from diffuse.plan.analysis import Analyzer
from diffuse.errors import RefusedModel

_CONFIG_LIMIT = 1 << 20  # bytes; a weights index can be large and never holds code references


class RemoteCode(Analyzer):
    name = "remote_code"
    phase = "config"
    needs = ()
    provides = ("component_libraries",)
    description = "Refuses code shipped inside the checkpoint; imports the installed component libraries."

    def analyze(self, subject, draft):
        root, index = subject.path, subject.model_index
        if subject.library == "transformers":  # config.json, and the tokenizer's and processor's files beside it
            for rel, cfg in _configs(root, []):
                if cfg.get("auto_map"):
                    _refuse(root, f"{rel} has an auto_map pointing at code shipped with the checkpoint "
                                  f"({', '.join(_auto_map_files(cfg['auto_map']))})")
                if cfg.get("trust_remote_code") is True:
                    _refuse(root, f"{rel} sets trust_remote_code")
            return {"component_libraries": {}}
        pipeline = index.get("_class_name")
        if isinstance(pipeline, (list, tuple)):
            _refuse(root, f"model_index.json takes its pipeline class {pipeline[-1]} from {pipeline[0]}.py, code shipped "
                          "with the checkpoint")
        libraries = {}
        for component, entry in index.items():
            if component.startswith("_") or not isinstance(entry, (list, tuple)) or len(entry) != 2:
                continue
            lib, cls = entry
            if not isinstance(lib, str):
                continue
            shipped = _shipped_file(root, component, lib)
            if shipped:
                _refuse(root, f"component {component!r} is class {cls} from {shipped}, a .py file inside the checkpoint")
            if not _is_builtin(lib):
                _import(root, component, lib, cls)
            libraries[component] = lib
        for rel, cfg in _configs(root, [c for c, e in index.items() if isinstance(e, (list, tuple))]):
            if cfg.get("auto_map"):
                _refuse(root, f"{rel} has an auto_map pointing at code shipped with the checkpoint "
                              f"({', '.join(_auto_map_files(cfg['auto_map']))})")
            if cfg.get("custom_pipeline"):
                _refuse(root, f"{rel} names a custom_pipeline ({cfg['custom_pipeline']}), code shipped with the checkpoint")
        return {"component_libraries": libraries}


def _refuse(root: str, what: str):
    raise RefusedModel(root, f"{what}: that needs trust_remote_code, which runs a stranger's code on the nodes; "
                             "Diffuse never grants it")


def _shipped_file(root: str, component: str, lib: str) -> str | None:
    for rel in (f"{component}/{lib}.py", f"{lib}.py", f"{lib}/__init__.py"):
        if os.path.isfile(os.path.join(root, rel)):
            return rel
    return None


def _is_builtin(lib: str) -> bool:
    """Libraries diffusers loads from itself: diffusers, transformers, ... and diffusers' own pipeline modules.

    The two every checkpoint names are answered without asking diffusers' loader, whose import pulls in
    every model class diffusers has: a checkpoint refused here is refused before any of that."""
    if lib in ("diffusers", "transformers"):
        return True
    from diffusers import pipelines

    try:
        from diffusers.pipelines.pipeline_loading_utils import LOADABLE_CLASSES
    except ImportError:  # a diffusers that moved it: the two that always load
        LOADABLE_CLASSES = {"diffusers": None, "transformers": None}
    return lib in LOADABLE_CLASSES or hasattr(pipelines, lib)


def _import(root: str, component: str, lib: str, cls: str):
    try:
        module = importlib.import_module(lib)
    except ImportError as exc:
        raise RefusedModel(root, f"component {component!r} needs the Python package {lib!r} (class {cls}), which is "
                                 f"not importable here ({exc}): install it (pip install {lib}, or the distribution that "
                                 "provides it) and run again") from exc
    origin = os.path.realpath(getattr(module, "__file__", None) or "")
    if origin.startswith(os.path.realpath(root) + os.sep):
        _refuse(root, f"component {component!r} imports {lib!r} from {os.path.relpath(origin, root)}, a file inside "
                      "the checkpoint")
    if not hasattr(module, cls):
        raise RefusedModel(root, f"component {component!r} names class {cls} in package {lib!r}, which has no such "
                                 "class: check model_index.json or the installed version of the package")


def _configs(root: str, components: list[str]):
    """(relative path, dict) for every small JSON file at the top of the checkpoint and in its component folders."""
    for folder in ["", *components]:
        here = os.path.join(root, folder)
        if not os.path.isdir(here):
            continue
        for name in sorted(os.listdir(here)):
            full = os.path.join(here, name)
            if not name.endswith(".json") or not os.path.isfile(full) or os.path.getsize(full) > _CONFIG_LIMIT:
                continue
            try:
                with open(full) as f:
                    cfg = json.load(f)
            except (OSError, ValueError):
                continue
            if isinstance(cfg, dict):
                yield os.path.join(folder, name), cfg


def _auto_map_files(auto_map) -> list[str]:
    refs = []
    for v in auto_map.values() if isinstance(auto_map, dict) else [auto_map]:
        for ref in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(ref, str):
                module, _, cls = ref.split("--")[-1].rpartition(".")
                refs.append(f"{cls} in {module}.py")
    return sorted(set(refs))
