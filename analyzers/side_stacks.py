"""Refuse side stacks: a stack whose blocks each feed one chosen block of another stack.

A stack no integer setting sizes (``config_nudger`` found none) may be sized by
a list setting instead: one entry per block, each entry the position of a block
in another stack. Wan VACE is the example: ``vace_layers = [0, 2]`` gives
``vace_blocks`` two blocks, whose outputs (hints) the denoiser adds to the
hidden state after ``blocks[0]`` and ``blocks[2]``. The main stack then has work
between its blocks, and the side stack keeps every block's output, so neither is
a chain one pass through the nodes can stand for. The list is confirmed by
rebuilding the denoiser weightless with one more position in it: the side stack
must grow by exactly one block. With several denoiser components (a Wan 2.2 VACE
pipeline's two experts), each component's config is read for its own stacks.

Decided from config.json and a weightless build, so ``diffuse check``, ``diffuse
plan``, ``diffuse query`` and ``diffuse.split`` all refuse it in the same line
before any node starts. (A denoiser that works between blocks without saying so
in its config is still caught by the dry call of ``diffuse query``,
``diffuse.client.weightless``.)
"""

from __future__ import annotations

from diffuse.plan.analysis import Analyzer
from diffuse.errors import RefusedModel

from analyzers.config_nudger import _builder, _lengths


class SideStacks(Analyzer):
    name = "side_stacks"
    phase = "config"
    needs = ("stacks", "stack_config_keys")
    provides = ("side_stacks",)
    description = "Refuses a stack sized by a config list of positions in another stack (side stacks, Wan VACE)."

    def analyze(self, subject, draft):
        stacks, keys = draft["stacks"], draft["stack_config_keys"]
        config = subject.denoiser_config
        if len(stacks) < 2 or not isinstance(config, dict):
            return {"side_stacks": {}}
        lengths = {s.path: s.length for s in stacks}
        for prefix, section in _sections(subject, config):
            mine = [s for s in stacks if s.path.startswith(prefix)]
            for side in (s for s in mine if s.path not in keys):
                for key, main in _position_lists(section, side, mine):
                    grown = _with(config, prefix, key, sorted([*section[key], _free(section[key], main.length)]))
                    if _grows_by_one(subject, grown, side.path, lengths):
                        raise RefusedModel(subject.path, _reason(side, main, f"{prefix}{key}", section[key]))
        return {"side_stacks": {}}


def _reason(side, main, key: str, positions: list) -> str:
    return (f"{side.path} ({side.length} blocks, one per entry of the config's {key}) feeds hints into {main.path} "
            f"after {', '.join(f'{main.path}[{i}]' for i in positions)}: the denoiser adds them to that stack's "
            f"hidden state between its blocks, so {main.path} is not a plain chain one pass through the nodes can "
            "stand for; nothing was started")


def _sections(subject, config: dict) -> list:
    """(path prefix, config) of each denoiser component: one with no prefix, or one per component when the
    pipeline has several (their stacks' paths start with the component's name)."""
    if subject.several:
        return [(f"{name}.", config[name]) for name in subject.denoisers if isinstance(config.get(name), dict)]
    return [("", config)]


def _with(config: dict, prefix: str, key: str, value) -> dict:
    """``config`` with the setting ``key`` of the component at ``prefix`` set to ``value``."""
    if not prefix:
        return {**config, key: value}
    name = prefix[:-1]
    return {**config, name: {**config[name], key: value}}


def _free(positions: list, length: int) -> int:
    """A position in a stack of ``length`` blocks not among ``positions`` (-1 if none is free)."""
    return next((i for i in range(length) if i not in positions), -1)


def _position_lists(config: dict, side, stacks):
    """(setting, main stack) for each list setting that could size ``side``: distinct integers, one per block of
    ``side``, each a position in another stack ``main`` that leaves a position free."""
    for key, value in config.items():
        if key.startswith("_") or not isinstance(value, list) or len(value) != side.length or not value:
            continue
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value) or len(set(value)) != len(value):
            continue
        for main in stacks:
            if main.path != side.path and all(0 <= v < main.length for v in value) and main.length > len(value):
                yield key, main


def _grows_by_one(subject, grown: dict, side: str, lengths: dict) -> bool:
    """Whether the denoiser rebuilt weightless from ``grown`` (one more position in the list) has ``side`` exactly
    one block longer, and every other stack as it was."""
    cls = subject.denoiser_class()
    try:
        build = _builder(cls, grown)
        rebuilt = _lengths(build(cls, grown), lengths)
    except Exception:  # the list does not build that way: not a list of positions
        return False
    return all(rebuilt[p] == lengths[p] + (p == side) for p in lengths)
