"""Learn which integer config setting sizes each stack, by nudging it and rebuilding without weights.

Each integer setting in the denoiser's config.json is raised by one and the
denoiser rebuilt on the meta device; the setting whose nudge makes exactly one
stack one block longer (and changes no other stack) sizes that stack. Settings
whose value equals a stack's length are tried first, and the search stops once
every stack has its setting, so a full-size model costs a few builds, not one
per setting.
"""

from __future__ import annotations

import torch

from diffuse.analysis import Analyzer, build_meta

from analyzers._shapes import quiet


class ConfigNudger(Analyzer):
    name = "config_nudger"
    phase = "config"
    needs = ("stacks", "stack_widths")  # stack_widths: only stacks chain_check accepted are worth a nudge
    provides = ("stack_config_keys",)
    description = "Finds the integer config setting that sizes each stack (nudge +1, weightless rebuild)."

    def analyze(self, subject, draft):
        stacks = draft["stacks"]
        if not stacks:
            return {"stack_config_keys": {}}
        cls, config = subject.denoiser_class(), subject.denoiser_config
        lengths = {s.path: s.length for s in stacks}
        build = _builder(cls, config)
        ints = [k for k, v in config.items()
                if not k.startswith("_") and isinstance(v, int) and not isinstance(v, bool)]
        ints.sort(key=lambda k: config[k] not in lengths.values())  # stable: likely keys first, config order kept
        keys = {}
        for key in ints:
            if len(keys) == len(lengths):
                break
            try:
                nudged = build(cls, {**config, key: config[key] + 1})
            except Exception:  # an odd head dim, a size that must divide another: not a stack setting
                continue
            grown = _lengths(nudged, lengths)
            changed = [p for p in lengths if grown[p] != lengths[p]]
            if len(changed) == 1 and grown[changed[0]] == lengths[changed[0]] + 1 and changed[0] not in keys:
                keys[changed[0]] = key
        return {"stack_config_keys": keys}


def _on_meta(cls, config):
    """Everything on the meta device: the cheapest build that still has the module structure."""
    with quiet(), torch.device("meta"):
        return cls.from_config({k: v for k, v in config.items() if not k.startswith("_")})


def _on_empty_weights(cls, config):
    with quiet():
        return build_meta(cls, config)


def _builder(cls, config):
    """Some constructors compute real tables at build time and fail on the meta device; they get empty weights."""
    try:
        _on_meta(cls, config)
        return _on_meta
    except Exception:
        return _on_empty_weights


def _lengths(model, lengths: dict[str, int]) -> dict[str, int]:
    out = {}
    for path in lengths:
        try:
            out[path] = len(model.get_submodule(path))
        except (AttributeError, TypeError):
            out[path] = -1
    return out
