"""Learn which integer config setting sizes each stack, by nudging it and rebuilding without weights.

Each integer setting in the denoiser's config.json is raised by one and the
denoiser rebuilt on the meta device; the setting whose nudge makes exactly one
stack one block longer (and changes no other stack) sizes that stack. Settings
whose value equals a stack's length are tried first, and the search stops once
every stack has its setting, so a full-size model costs a few builds, not one
per setting. A transformers model's sub-configurations (``text_config``,
``vision_config``: nested sections of config.json) are searched too, and the
setting is named by its path (``text_config.num_hidden_layers``); lists that
hold one entry per layer (``layer_types``) are left out of a nudged build,
since their length must match the count being nudged.
"""

from __future__ import annotations

import torch

from diffuse.plan.analysis import Analyzer, build_meta, build_model

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
        ints = list(_int_settings(config))
        ints.sort(key=lambda kv: kv[1] not in lengths.values())  # stable: likely keys first, config order kept
        keys = {}
        for key, _ in ints:
            if len(keys) == len(lengths):
                break
            try:
                nudged = _build_nudged(build, cls, config, key)
            except Exception:  # an odd head dim, a size that must divide another: not a stack setting
                continue
            grown = _lengths(nudged, lengths)
            changed = [p for p in lengths if grown[p] != lengths[p]]
            if len(changed) == 1 and grown[changed[0]] == lengths[changed[0]] + 1 and changed[0] not in keys:
                keys[changed[0]] = key
        return {"stack_config_keys": keys}


def _int_settings(config: dict, prefix: str = ""):
    """(dotted path, value) of every integer setting, sub-configurations (nested sections, and each component's
    config when a pipeline has several denoisers) included."""
    for k, v in config.items():
        if k.startswith("_"):
            continue
        if isinstance(v, int) and not isinstance(v, bool):
            yield prefix + k, v
        elif isinstance(v, dict) and (k.endswith("_config") or "model_type" in v or "_class_name" in v):
            yield from _int_settings(v, f"{prefix}{k}.")


def _build_nudged(build, cls, config: dict, key: str):
    try:
        return build(cls, _nudged(config, key, False))
    except Exception:  # per-layer lists no longer fit the count: build again without them
        return build(cls, _nudged(config, key, True))


def _nudged(config: dict, key: str, drop_lists: bool) -> dict:
    """A copy of ``config`` with the setting at dotted path ``key`` raised by one; with ``drop_lists``,
    lists beside it holding one entry per unit of the old value (per-layer lists) are left out."""
    head, _, rest = key.partition(".")
    if rest:
        return {**config, head: _nudged(config[head], rest, drop_lists)}
    old = config[key]
    return {k: v for k, v in config.items()
            if not (drop_lists and isinstance(v, list) and len(v) == old and old > 1)} | {key: old + 1}


def _on_meta(cls, config):
    """Everything on the meta device: the cheapest build that still has the module structure."""
    with quiet(), torch.device("meta"):
        return build_model(cls, config)


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
