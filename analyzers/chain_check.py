"""Refuse denoisers that are not chains of equal blocks: U-Nets, recurrent stacks, no stack at all.

Splitting a stack into contiguous ranges is only sound when every block has
the same shape of input and output and its own weights. This is judged from
the weightless build: block classes, block widths (the most common parameter
dimension, see ``_shapes.block_width``) and object identity.
"""

from __future__ import annotations

from diffuse.plan.analysis import Analyzer
from diffuse.errors import RefusedModel

from analyzers._shapes import block_width, describe_blocks, is_block
from analyzers.stack_finder import denoiser_on_meta


class ChainCheck(Analyzer):
    name = "chain_check"
    phase = "config"
    needs = ("stacks", "other_lists")
    provides = ("stack_widths",)
    description = "Refuses U-Nets (blocks of several widths/classes), recurrent stacks and stackless denoisers."

    def analyze(self, subject, draft):
        model = denoiser_on_meta(subject)
        stacks = draft["stacks"]
        if not stacks:
            mixed = {p: bs for p, bs in ((p, list(model.get_submodule(p))) for p in draft["other_lists"])
                     if all(map(is_block, bs)) and len({type(b) for b in bs}) > 1}
            if mixed:
                several_widths = any(len({block_width(b) for b in bs}) > 1 for bs in mixed.values())
                raise RefusedModel(subject.path, "; ".join(f"{p} holds {describe_blocks(b)}" for p, b in mixed.items()) + (
                    ": a multi-resolution U-Net whose skip connections cross resolutions is not a chain of equal blocks"
                    if several_widths else ": blocks of different classes are not a chain of equal blocks"))
            seen = "; ".join(f"{p} holds {why}" for p, why in draft["other_lists"].items())
            raise RefusedModel(subject.path, f"no ModuleList of repeated blocks found in {type(model).__name__}"
                                             + (f" ({seen})" if seen else ""))
        widths = {}
        for s in stacks:
            blocks = list(model.get_submodule(s.path))
            distinct = len({id(b) for b in blocks})
            if distinct < len(blocks):
                raise RefusedModel(subject.path, f"{s.path} holds {len(blocks)} entries but only {distinct} distinct "
                                                 "block object(s): a recurrent stack calls the same weights repeatedly, "
                                                 "so it cannot be cut into ranges held by different nodes")
            ws = [block_width(b) for b in blocks]
            if len(set(ws)) > 1:
                raise RefusedModel(subject.path, f"{s.path} holds {describe_blocks(blocks)}: blocks of several widths are not "
                                                 "a chain of equal blocks")
            widths[s.path] = ws[0]
        return {"stack_widths": widths}

