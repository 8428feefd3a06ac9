"""Image, video or audio: read from the pipeline class and the component configs (FACTS, Table 5).

The signals that hold for every family measured: the pipeline's ``__call__``
takes ``audio_end_in_s`` (audio) or ``num_frames`` (video); its ``__init__``
sets ``self.video_processor`` (video); a component config declares a
``sampling_rate`` (audio, e.g. an Oobleck VAE or a vocoder). Patch sizes and VAE
temporal factors are not used: they mislead (FACTS, Table 5 pitfalls).

A diffusers pipeline is read from its source file, found through diffusers'
lazy import tables, not imported: importing one imports its text encoders',
image processors' and VAE's code, seconds of a first ``diffuse check``. Where
the source does not settle it (an inherited ``__call__``, a default that is not
a literal, a class from another library), the class is imported and inspected.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import textwrap

from diffuse.analysis import Analyzer
from diffuse.errors import RefusedModel

_FRAME_RATE_PARAMS = ("frame_rate", "fps")


class OutputKind(Analyzer):
    name = "output_kind"
    phase = "config"
    needs = ("component_libraries",)  # the pipeline class may live in a library remote_code imported
    provides = ("output_kind", "frame_rate", "sample_rate", "output_evidence")
    description = "Image, video or audio, with frame and sample rate, from the pipeline class and component configs."

    def analyze(self, subject, draft):
        name, params, sets_video_processor = _from_source(subject.model_index.get("_class_name")) or _from_class(
            pipeline_class(subject, draft["component_libraries"]))
        sample_rate = _sampling_rate(subject)
        frame_rate = next((params[n] for n in _FRAME_RATE_PARAMS
                           if n in params and isinstance(params[n], (int, float)) and not isinstance(params[n], bool)),
                          None)
        if "audio_end_in_s" in params:
            kind, why = "audio", f"{name}.__call__ takes audio_end_in_s"
        elif "num_frames" in params:
            kind, why = "video", f"{name}.__call__ takes num_frames"
        elif sets_video_processor:
            kind, why = "video", f"{name}.__init__ sets self.video_processor"
        elif sample_rate is not None:
            kind, why = "audio", f"a component config declares sampling_rate {sample_rate}"
        else:
            kind, why = "image", f"{name} takes no num_frames or audio_end_in_s and no component declares a sampling_rate"
        return {
            "output_kind": kind,
            "frame_rate": int(frame_rate) if frame_rate is not None and kind == "video" else None,
            "sample_rate": sample_rate if kind in ("audio", "video") else None,
            "output_evidence": why,
        }


def pipeline_class(subject, libraries: dict[str, str]) -> type:
    """The class model_index.json's _class_name names: diffusers first, then the installed libraries it uses."""
    import diffusers

    name = subject.model_index.get("_class_name")
    found = getattr(diffusers, name, None) if isinstance(name, str) else None
    for lib in dict.fromkeys(libraries.values()):
        if found is None and lib not in ("diffusers", "transformers"):
            found = getattr(importlib.import_module(lib), name, None)
    if not isinstance(found, type):
        raise RefusedModel(subject.path, f"model_index.json names the pipeline class {name!r}, which is neither in "
                                         f"diffusers {diffusers.__version__} nor in the libraries its components use "
                                         f"({', '.join(sorted(set(libraries.values()))) or 'none'}): a newer diffusers "
                                         "or the package that defines it is needed")
    return found


def _sampling_rate(subject) -> int | None:
    """The first component config.json with an integer sampling_rate (the VAE comes first where there is one)."""
    components = [c for c, e in subject.model_index.items() if isinstance(e, (list, tuple)) and not c.startswith("_")]
    for component in sorted(components, key=lambda c: c != "vae"):
        file = os.path.join(subject.path, component, "config.json")
        if os.path.isfile(file):
            with open(file) as f:
                cfg = json.load(f)
            rate = cfg.get("sampling_rate") if isinstance(cfg, dict) else None
            if isinstance(rate, int) and not isinstance(rate, bool):
                return rate
    return None


def _from_class(pipeline: type) -> tuple[str, dict, bool]:
    """(name, {__call__ parameter: default}, whether __init__ sets self.video_processor) of an imported class."""
    params = {n: p.default for n, p in inspect.signature(pipeline.__call__).parameters.items()}
    try:
        init = ast.parse(textwrap.dedent(inspect.getsource(pipeline.__init__)))
    except (OSError, TypeError, SyntaxError):
        init = None
    return pipeline.__name__, params, init is not None and _sets_video_processor(init)


def _from_source(name) -> tuple[str, dict, bool] | None:
    """The same facts read from the source of diffusers' class ``name`` without importing it; None where the
    class's own source does not settle them."""
    file = _diffusers_source_file(name) if isinstance(name, str) else None
    try:
        with open(file) as f:
            tree = ast.parse(f.read())
    except (TypeError, OSError, SyntaxError):
        return None
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)} if cls else {}
    if "__call__" not in methods or "__init__" not in methods:
        return None  # inherited: the base class decides
    a = methods["__call__"].args
    positional = [*a.posonlyargs, *a.args]
    defaults = {**dict(zip(positional[len(positional) - len(a.defaults):], a.defaults)),
                **{p: d for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None}}
    params = {p.arg: inspect.Parameter.empty for p in (a.vararg, a.kwarg) if p}
    for p in [*positional, *a.kwonlyargs]:
        try:
            params[p.arg] = ast.literal_eval(defaults[p]) if p in defaults else inspect.Parameter.empty
        except ValueError:  # a default computed at import time
            if p.arg in _FRAME_RATE_PARAMS:
                return None
            params[p.arg] = None
    return name, params, _sets_video_processor(methods["__init__"])


def _diffusers_source_file(name: str) -> str | None:
    """The file defining diffusers' ``name``, followed through the lazy modules' class tables (importing only
    their cheap package ``__init__``s)."""
    import importlib.util

    import diffusers

    module, dotted = diffusers, "diffusers"
    while (sub := getattr(module, "_class_to_module", {}).get(name)) is not None:
        dotted = f"{dotted}.{sub}"
        spec = importlib.util.find_spec(dotted)
        if spec is None or not spec.submodule_search_locations:
            return spec and spec.origin
        module = importlib.import_module(dotted)
    return None


def _sets_video_processor(init: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "video_processor" and isinstance(n.ctx, ast.Store)
               for n in ast.walk(init))
