"""Running shape analyzers and merging what they find into a draft plan.

Analyzers are plugins (see ``diffuse.plan.hookspecs.diffuse_analyzers``). Each one
declares what it needs and what it provides; they run in dependency order and
each may add only the fields it declared.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from diffuse.errors import DiffuseError, PluginError
from diffuse.plan.components import (  # noqa: F401  (where they were first defined: found here too)
    DECODER_ENTRY, DENOISER_ENTRY, build_meta, build_model, coders, component_class as _component_class, denoisers_class)
from diffuse.plan.plugins import call_hook

PHASES = ("config", "call")


class Analyzer:
    """Base class for a shape analyzer. Subclasses set the class attributes and ``analyze``."""

    name: ClassVar[str] = ""
    phase: ClassVar[str] = "config"  # config | call
    needs: ClassVar[tuple[str, ...]] = ()
    provides: ClassVar[tuple[str, ...]] = ()
    description: ClassVar[str] = ""

    def analyze(self, subject: Any, draft: dict) -> dict:  # pragma: no cover - contract
        raise NotImplementedError


@dataclass
class ModelSubject:
    """What the config-phase analyzers look at, read from config.json files only (and weightless
    builds), never weights: a local diffusers pipeline folder (its denoiser holds the block stacks), or
    a transformers model folder (a config.json naming its ``architectures``; the model itself holds
    them, and ``denoiser`` is "": the folder's root)."""

    path: str
    model_index: dict
    denoiser: str  # the component that holds the stacks: "transformer", "unet", ...; "" for a transformers model
    denoiser_config: dict  # its config.json; with several denoisers, {component: its config.json}
    library: str = "diffusers"  # diffusers | transformers
    _meta: Any = field(default=None, repr=False)
    # every component holding block stacks, ``denoiser`` first (Wan 2.2: its two experts, transformer and
    # transformer_2); with more than one, the stacks are addressed from ``Denoisers``: "transformer_2.blocks"
    denoisers: tuple = ()
    # the text (and image) encoders among ``denoisers``, last: components put on the ring too (--encoders ring,
    # ``diffuse.plan.encoders``), whose stacks run once per request
    encoders: tuple = ()
    # the VAEs among ``denoisers``, last: each held as a stack of one block (--decoder, ``diffuse.plan.decoders``)
    decoders: tuple = ()

    @classmethod
    def from_path(cls, path: str, encoders: bool = False, decoders: bool = False) -> "ModelSubject":
        """The subject of the folder at ``path``; ``encoders``: a pipeline's encoder components (``diffuse.plan.
        encoders``) hold stacks too, beside its denoiser's; ``decoders``: its VAEs too (``diffuse.plan.decoders``)."""
        subject = cls._from_path(path)
        if encoders and not subject.autoregressive and subject.denoiser:
            subject = with_encoders(subject)
        if decoders and not subject.autoregressive and subject.denoiser:
            subject = with_decoders(subject)
        return subject

    @classmethod
    def _from_path(cls, path: str) -> "ModelSubject":
        index_file = os.path.join(path, "model_index.json")
        if not os.path.isfile(index_file):
            config_file = os.path.join(path, "config.json")
            config = {}
            if os.path.isfile(config_file):
                with open(config_file) as f:
                    config = json.load(f)
            if isinstance(config, dict) and config.get("architectures"):
                return cls(path=path, model_index={}, denoiser="", denoiser_config=config, library="transformers")
            raise DiffuseError(f"{path} is neither a diffusers pipeline folder (no model_index.json) nor a "
                               "transformers model folder (no config.json naming its architectures)")
        with open(index_file) as f:
            model_index = json.load(f)
        denoiser = next((n for n in ("transformer", "unet", "prior", "denoiser") if n in model_index), None)
        if denoiser is None:
            # fall back: the first component whose config names a model class with blocks
            denoiser = next(
                (k for k, v in model_index.items() if isinstance(v, list) and os.path.isfile(os.path.join(path, k, "config.json"))
                 and "Model" in str(v[1]) and "Autoencoder" not in str(v[1]) and "Text" not in str(v[1])),
                None,
            )
        cfg = {}
        if denoiser is None:
            return cls(path=path, model_index=model_index, denoiser="", denoiser_config=cfg)
        with open(os.path.join(path, denoiser, "config.json")) as f:
            cfg = json.load(f)
        names = [denoiser, *_fellow_denoisers(path, model_index, denoiser)]
        if len(names) == 1:
            return cls(path=path, model_index=model_index, denoiser=denoiser, denoiser_config=cfg, denoisers=(denoiser,))
        return cls(path=path, model_index=model_index, denoiser=denoiser, denoiser_config=component_configs(
            path, model_index, names), denoisers=tuple(names))

    @property
    def several(self) -> bool:
        """More than one component holds block stacks (their stacks' paths start with the component's name)."""
        return len(self.denoisers) > 1

    @property
    def denoiser_label(self) -> str:
        """"transformer: WanTransformer3DModel", or every denoiser component, for messages and summaries."""
        if self.several:
            return ", ".join(f"{n}: {self.model_index[n][1]}" for n in self.denoisers)
        return f"{self.denoiser}: {self.denoiser_class_name}" if self.denoiser else self.denoiser_class_name

    def component_dirs(self) -> dict[str, str]:
        """{name prefix of the stacks' paths ("" for one denoiser): the folder of its config.json and weights}."""
        if self.several:  # a decoder's weights sit in the one block it is held as (``Coder``)
            return {f"{n}.0." if n in self.decoders else f"{n}.": os.path.join(self.path, n) for n in self.denoisers}
        return {"": self.component_dir}

    def weight_map(self):
        """Tensor name (as the stacks' paths address it) -> safetensors file, over every denoiser component
        (a ``diffuse.plan.modelfiles.WeightMap``: with several, each name's ``source`` is its name in its own file)."""
        from diffuse.plan.modelfiles import WeightMap, weight_map
        from diffuse.plan.prequant import with_quantized

        out = WeightMap()
        for prefix, folder in self.component_dirs().items():
            files = with_quantized(weight_map(folder), folder)  # (saved quantized: each weight named after its parts)
            for k, v in files.items():
                out[prefix + k] = v
                if prefix or getattr(files, "sources", {}).get(k, k) != k:
                    out.sources[prefix + k] = getattr(files, "sources", {}).get(k, k)
        return out

    def content_hash(self) -> str:
        """``diffuse.plan.modelfiles.content_hash`` of the denoiser component, or of every one of them together."""
        from diffuse.plan.modelfiles import content_hash

        hashes = [content_hash(folder) for folder in self.component_dirs().values()]
        if len(hashes) == 1:
            return hashes[0]
        import hashlib

        return hashlib.blake2b("".join(hashes).encode(), digest_size=16).hexdigest()

    @property
    def autoregressive(self) -> bool:
        """A model that generates token by token (one pass per token, a cache per request)."""
        return self.library == "transformers"

    @property
    def component_dir(self) -> str:
        """The folder holding the stacks' config.json and weights."""
        return os.path.join(self.path, self.denoiser)

    @property
    def denoiser_class_name(self) -> str:
        if self.library == "transformers":
            return str(self.denoiser_config["architectures"][0])
        if self.several:
            return " + ".join(str(self.model_index[n][1]) for n in self.denoisers)
        entry = self.model_index.get(self.denoiser)
        return entry[1] if isinstance(entry, list) else str(self.denoiser_config.get("_class_name", ""))

    def denoiser_class(self):
        name = self.denoiser_class_name
        if self.library == "transformers":
            import transformers

            found = getattr(transformers, name, None)
            if found is None:
                raise DiffuseError(f"config.json names the class {name!r}, which transformers "
                                   f"{transformers.__version__} does not have")
            return found
        if self.several:
            return denoisers_class()
        entry = self.model_index.get(self.denoiser)
        return _component_class(entry[0] if isinstance(entry, list) else "diffusers", name)

    def config_object(self):
        """The model's configuration as its library's object (a transformers model's caches need it); None for a
        pipeline, whose encoders' caches (``diffuse.client.encoders``) are made afresh for each pass without one
        (from empty, every kind of layer returns the keys and values it was given)."""
        if self.library == "transformers":
            return self.denoiser_class().config_class.from_dict(dict(self.denoiser_config))
        return None

    def meta_denoiser(self):
        """The denoiser built weightless (parameters on meta, buffers real), cached."""
        if self._meta is None:
            self._meta = build_meta(self.denoiser_class(), self.denoiser_config)
        return self._meta


def component_configs(path: str, model_index: dict, names, decoders=()) -> dict:
    """{component: its config.json, with its model_index.json entry under ``DENOISER_ENTRY``} (and, for those
    in ``decoders``, ``DECODER_ENTRY``)."""
    configs = {}
    for name in names:
        with open(os.path.join(path, name, "config.json")) as f:
            configs[name] = {**json.load(f), DENOISER_ENTRY: list(model_index[name])}
        if name in decoders:
            configs[name][DECODER_ENTRY] = True
    return configs


def decoder_components(path: str, model_index: dict, taken) -> list[str]:
    """The VAEs of the pipeline at ``path``: its models (a config.json in their folder) that diffusers loads and
    whose class decodes (a ``decode`` method), in model_index.json's order, leaving out ``taken``."""
    found = []
    for name, entry in model_index.items():
        if name in taken or name.startswith("_") or not isinstance(entry, list) or len(entry) != 2 or not entry[1]:
            continue
        if entry[0] != "diffusers" or not os.path.isfile(os.path.join(path, name, "config.json")):
            continue
        if callable(getattr(_component_class(entry[0], entry[1]), "decode", None)):
            found.append(name)
    return found


def with_decoders(subject):
    """``subject`` with its VAEs among the components holding stacks (each a stack of one block), after the
    others; the same subject where the pipeline has none."""
    names = decoder_components(subject.path, subject.model_index, subject.denoisers)
    if not names:
        return subject
    every = (*subject.denoisers, *names)
    configs = component_configs(subject.path, subject.model_index, every, names)
    return replace(subject, denoiser_config=configs, denoisers=every, decoders=tuple(names), _meta=None)


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
    names = encoder_components(subject.path, subject.model_index, subject.denoisers)
    if not names:
        return subject
    every = (*subject.denoisers, *names)
    configs = component_configs(subject.path, subject.model_index, every)
    return replace(subject, denoiser_config=configs, denoisers=every, encoders=tuple(names), _meta=None)


def _fellow_denoisers(path: str, model_index: dict, denoiser: str) -> list[str]:
    """The pipeline's other components that hold block stacks as ``denoiser`` does: those of its very class, or
    named after it with a number (``transformer_2``), each with a config.json (Wan 2.2's low-noise expert)."""
    mine = model_index.get(denoiser)
    found = []
    for name, entry in model_index.items():
        if name == denoiser or name.startswith("_") or not isinstance(entry, list) or len(entry) != 2:
            continue
        if not entry[1] or not os.path.isfile(os.path.join(path, name, "config.json")):
            continue  # a component the pipeline leaves out (null) or a folder without a model
        numbered = name.startswith(denoiser + "_") and name[len(denoiser) + 1:].isdigit()
        if numbered or (isinstance(mine, list) and list(entry) == list(mine)):
            found.append(name)
    return found


def installed_analyzers(phase: str | None = None) -> list[Analyzer]:
    found: list[Analyzer] = []
    for group in call_hook("diffuse_analyzers"):
        for a in group or ():
            if not isinstance(a, Analyzer):
                raise PluginError(f"diffuse_analyzers returned {a!r}, which is not a diffuse.plan.analysis.Analyzer")
            if a.phase not in PHASES:
                raise PluginError(f"analyzer {a.name!r} declares unknown phase {a.phase!r}")
            found.append(a)
    if phase is not None:
        found = [a for a in found if a.phase == phase]
    return _in_dependency_order(found)


def _in_dependency_order(analyzers: list[Analyzer]) -> list[Analyzer]:
    ordered, done, pending = [], set(), sorted(analyzers, key=lambda a: a.name)
    while pending:
        ready = [a for a in pending if all(n in done or not _provided_by_any(n, pending) for n in a.needs)]
        if not ready:
            raise PluginError(f"analyzers depend on each other in a cycle: {[a.name for a in pending]}")
        for a in ready:
            ordered.append(a)
            done.update(a.provides)
            pending.remove(a)
    return ordered


def _provided_by_any(fieldname: str, analyzers: list[Analyzer]) -> bool:
    return any(fieldname in a.provides for a in analyzers)


def _needed_for(analyzers: list[Analyzer], wanted: set) -> list[Analyzer]:
    """The analyzers that provide ``wanted`` fields, and those whose fields they need, in order."""
    keep, todo = set(), set(wanted)
    while todo:
        name = todo.pop()
        for a in analyzers:
            if name in a.provides and a.name not in keep:
                keep.add(a.name)
                todo.update(a.needs)
    return [a for a in analyzers if a.name in keep]


def run_analyzers(phase: str, subject: Any, draft: dict | None = None, required: dict | None = None,
                  wanted: set | None = None) -> dict:
    """Run every analyzer of ``phase`` on ``subject``; return the merged draft.

    ``required``: the fields the core reads from this phase, each with the type it must have; one
    that no installed analyzer provides, or one of another type, is a PluginError naming it.
    ``wanted``: run only what these fields need (a node needs the stacks, not what the pipeline outputs)."""
    draft = dict(draft or {})
    analyzers = installed_analyzers(phase)
    if wanted is not None:
        analyzers = _needed_for(analyzers, set(wanted) | set(required or {}))
    for a in analyzers:
        missing = [n for n in a.needs if n not in draft]
        if missing:
            raise PluginError(f"analyzer {a.name!r} needs {missing}, which no analyzer provided")
        try:
            found = a.analyze(subject, draft)
        except PluginError:
            raise
        except Exception as exc:
            if isinstance(exc, DiffuseError):  # a refusal or a clear error: it already says what happened
                raise
            raise PluginError(f"analyzer {a.name!r} raised {type(exc).__name__}: {exc}") from exc
        extra = set(found or {}) - set(a.provides)
        if extra:
            raise PluginError(f"analyzer {a.name!r} returned fields it does not declare: {sorted(extra)}")
        draft.update(found or {})
    for name, kind in (required or {}).items():
        if name not in draft:
            raise PluginError(f"no installed analyzer provides {name!r}, which Diffuse needs "
                              f"(installed: {', '.join(a.name for a in installed_analyzers(phase)) or 'none'})")
        if not isinstance(draft[name], kind):
            raise PluginError(f"the analyzer that provides {name!r} gave a {type(draft[name]).__name__}, "
                              f"not a {getattr(kind, '__name__', kind)}")
    return draft


@dataclass
class StackCall:
    """What the call-phase analyzers look at: the first call into one stack.

    ``block`` is the stack's first block, which the client keeps just long
    enough to call once (weightless or with zero weights, ``analyzers/calls.py``:
    its weights are never read); it is freed afterwards.
    """

    stack: Any  # StackPlan
    args: tuple
    kwargs: dict
    block: Any = None
    layered: bool = False  # the layers' calls are collected and sent together (a cache's, an encoder's)
