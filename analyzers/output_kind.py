"""Image, video or audio: read from the pipeline class and the component configs (FACTS, Table 5).

The signals that hold for every family measured: the pipeline's ``__call__``
takes ``audio_end_in_s`` (audio) or ``num_frames`` (video); its ``__init__``
sets ``self.video_processor`` (video); a component config declares a
``sampling_rate`` (audio, e.g. an Oobleck VAE or a vocoder). Patch sizes and VAE
temporal factors are not used: they mislead (FACTS, Table 5 pitfalls).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import textwrap

from diffuse.plan.analysis import Analyzer
from diffuse.errors import RefusedModel

_FRAME_RATE_PARAMS = ("frame_rate", "fps")


class OutputKind(Analyzer):
    name = "output_kind"
    phase = "config"
    needs = ("component_libraries",)  # the pipeline class may live in a library remote_code imported
    provides = ("output_kind", "frame_rate", "sample_rate", "output_evidence")
    description = "Image, video or audio, with frame and sample rate, from the pipeline class and component configs."

    def analyze(self, subject, draft):
        if subject.autoregressive:
            return {"output_kind": "text", "frame_rate": None, "sample_rate": None,
                    "output_evidence": f"{subject.denoiser_class_name} generates tokens"}
        pipeline = pipeline_class(subject, draft["component_libraries"])
        params = inspect.signature(pipeline.__call__).parameters
        sample_rate = _sampling_rate(subject)
        frame_rate = next((params[n].default for n in _FRAME_RATE_PARAMS
                           if n in params and isinstance(params[n].default, (int, float))
                           and not isinstance(params[n].default, bool)), None)
        name = pipeline.__name__
        if "audio_end_in_s" in params:
            kind, why = "audio", f"{name}.__call__ takes audio_end_in_s"
        elif "num_frames" in params:
            kind, why = "video", f"{name}.__call__ takes num_frames"
        elif _sets_video_processor(pipeline):
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


def _sets_video_processor(pipeline: type) -> bool:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(pipeline.__init__)))
    except (OSError, TypeError, SyntaxError):
        return False
    return any(isinstance(n, ast.Attribute) and n.attr == "video_processor" and isinstance(n.ctx, ast.Store)
               for n in ast.walk(tree))
