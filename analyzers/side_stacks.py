"""Refuse side stacks: a stack whose blocks each feed one chosen block of another stack.

A stack no integer setting sizes (``config_nudger`` found none) may be sized by
a list setting instead: one entry per block, each entry the position of a block
in another stack. Wan VACE is the example: ``vace_layers = [0, 2]`` gives
``vace_blocks`` two blocks, whose outputs (hints) the denoiser adds to the
hidden state after ``blocks[0]`` and ``blocks[2]``. The main stack then has work
between its blocks, and the side stack keeps every block's output, so neither is
a chain one pass through the nodes can stand for. The list is confirmed by
rebuilding the denoiser weightless with one more position in it: the side stack
must grow by exactly one block. Decided from config.json and a weightless build,
so ``diffuse check``, ``diffuse plan``, ``diffuse query`` and ``diffuse.split``
all refuse it in the same line before any node starts. (A denoiser that works
between blocks without saying so in its config is still caught by the dry call
of ``diffuse query``, ``diffuse.dryrun``.)
"""

from __future__ import annotations

from diffuse.analysis import Analyzer
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
        if len(stacks) < 2 or not isinstance(config, dict) or subject.several:
            return {"side_stacks": {}}
        lengths = {s.path: s.length for s in stacks}
        for side in (s for s in stacks if s.path not in keys):
            for key, main in _position_lists(config, side, stacks):
                if _grows_by_one(subject, config, key, side.path, lengths, main.length):
                    raise RefusedModel(subject.path, (
                        f"{side.path} ({side.length} blocks, one per entry of the config's {key}) feeds hints "
                        f"into {main.path} after {', '.join(f'{main.path}[{i}]' for i in config[key])}: the denoiser "
                        f"adds them to that stack's hidden state between its blocks, so {main.path} is not a "
                        "plain chain one pass through the nodes can stand for; nothing was started"))
        return {"side_stacks": {}}


def _position_lists(config: dict, side, stacks):
    """(setting, main stack) for each list setting that could size ``side``: distinct integers, one per block of
    ``side``, each a position in the other stack ``main``."""
    for key, value in config.items():
        if key.startswith("_") or not isinstance(value, list) or len(value) != side.length or not value:
            continue
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value) or len(set(value)) != len(value):
            continue
        for main in stacks:
            if main.path != side.path and all(0 <= v < main.length for v in value):
                yield key, main


def _grows_by_one(subject, config: dict, key: str, side: str, lengths: dict, main_length: int) -> bool:
    """Whether one more position in ``config[key]`` makes ``side`` exactly one block longer (and no other stack
    change), on a weightless rebuild."""
    free = [i for i in range(main_length) if i not in config[key]]
    if not free:
        return False
    cls = subject.denoiser_class()
    try:
        build = _builder(cls, config)
        grown = _lengths(build(cls, {**config, key: sorted([*config[key], free[0]])}), lengths)
    except Exception:  # the list does not build that way: not a list of positions
        return False
    return all(grown[p] == lengths[p] + (p == side) for p in lengths)
