"""``python -m diffuse.bench [NAME]``: which benchmark runs. Each lives in its own module, imported only
when it runs; with no name (or a flag first), the diffusion bench (``diffuse.bench.diffusion``)."""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {  # python -m diffuse.bench NAME ...: the module and function that run it
    "quality": ("diffuse.bench.quality", "main"),  # the quality table on the trained model
    "cache": ("diffuse.bench.quality", "cache_main"),  # the first-block cache's speed and quality
    "serve": ("diffuse.bench.serve", "main"),  # the service: warm against cold, concurrent streams against one
    "lm": ("diffuse.bench.lm", "main"),  # a language model whole and split
    "device": ("diffuse.bench.device", "main"),  # a Wan2.1-1.3B-shaped model on one device, whole against 2 nodes
    "placement": ("diffuse.bench.placement", "main"),  # even slices against planned ones on unequal nodes
    "links": ("diffuse.bench.links", "main"),  # a language model over a slowed client link, against its floor
    "memory": ("diffuse.bench.memory", "main"),  # peak memory per process at a real model's geometry
    "fetch": ("diffuse.bench.fetch", "main"),
    "quant": ("diffuse.bench.quant", "main"),  # each --quantize mode's memory, speed and quality against none  # bytes and time per machine fetching a Hub model, against the whole
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in SUBCOMMANDS:
        module, function = SUBCOMMANDS[argv[0]]
        return getattr(importlib.import_module(module), function)(argv[1:])
    from diffuse.bench import diffusion

    return diffusion.main(argv)
