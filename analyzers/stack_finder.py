"""Find the block stacks: the ModuleLists of repeated blocks the denoiser exposes, in call order.

A stack is a ModuleList the denoiser itself holds (see ``_shapes.top_lists``),
of one or more blocks of one class, that the denoiser's code does not pick
apart entry by entry (see ``_shapes.picked_not_looped``). Every
other such list is reported in ``other_lists`` with the reason it is not a
stack; it stays on the client like any other module.

A model that generates token by token (a transformers model) nests its decoder
stack inside modules with weights of their own (``model.layers`` beside the
embedding table; ``model.text_model.layers`` beside a vision tower), so every
ModuleList of blocks is looked at, and the stacks are those whose blocks
attend causally and index a cache by layer (an attention module with
``is_causal`` and a ``layer_idx``): the decoder. A list of blocks that attend
both ways (a vision or audio tower, a text encoder) runs once per request and
stays on the client, where the media is. A decoder-only model whose attention
carries no ``is_causal`` (BLOOM: causal through the mask its model builds) has
its decoder found as the one list of cache-indexing blocks, as many as
config.json's decoder depth.

A pipeline with several denoiser components (Wan 2.2's two experts,
``diffuse.analysis.Denoisers``) has the stacks of each, named from the
component: ``transformer.blocks``, ``transformer_2.blocks``.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from diffuse.analysis import Analyzer
from diffuse.errors import RefusedModel
from diffuse.plan import StackPlan

from analyzers._shapes import (
    block_params, class_path, describe_blocks, is_block, picked_not_looped, quiet, top_lists,
)


class StackFinder(Analyzer):
    name = "stack_finder"
    phase = "config"
    # after remote_code (building the denoiser imports its library) and config_reader (refusals from config.json
    # alone come before any build)
    needs = ("component_libraries", "config_verdict")
    provides = ("stacks", "other_lists")
    description = "The ModuleLists of same-class blocks the denoiser calls as a chain (weightless build), in call order."

    def analyze(self, subject, draft):
        model = denoiser_on_meta(subject)
        if not subject.autoregressive:
            stacks, others = find_stacks(model)
        else:
            stacks, others = find_decoder_stacks(model, draft.get("config_verdict") or {})
        return {"stacks": stacks, "other_lists": others}


def denoiser_on_meta(subject):
    """The subject's weightless denoiser, or a refusal that says why it could not be built."""
    if not subject.denoiser and not subject.autoregressive:
        raise RefusedModel(subject.path, "model_index.json names no denoiser component (transformer, unet, ...) with a "
                                         "config.json")
    try:
        with quiet():
            return subject.meta_denoiser()
    except Exception as exc:
        raise RefusedModel(subject.path, f"the denoiser {subject.denoiser_class_name} could not be built from "
                                         f"{subject.denoiser}/config.json: {type(exc).__name__}: {exc}") from exc


def _causal_with_cache(block) -> bool:
    return any(getattr(m, "is_causal", False) is True and getattr(m, "layer_idx", None) is not None
               for m in block.modules())


def _indexes_cache(block) -> bool:
    return any(getattr(m, "layer_idx", None) is not None for m in block.modules())


def find_decoder_stacks(model, verdict: dict | None = None) -> tuple[list[StackPlan], dict[str, str]]:
    """(the decoder stacks, in registration order; {path: why not a stack}) of a token-by-token model.

    ``verdict``: what config.json says (``diffuse.config_verdict.read_config``). A decoder-only model (it
    generates, reads no media and no encoder) whose attention says nothing of causality (BLOOM's, causal through
    the mask its model builds, with ALiBi) has one list of blocks that index a cache by layer, as many as the
    config's decoder depth, none saying it attends both ways: that list is its decoder."""
    stacks, others = _decoder_lists(model)
    verdict = verdict or {}
    if not stacks and verdict.get("generates") and not verdict.get("media") and not verdict.get("encoder"):
        fits = [p for p in others if "attend both ways" in others[p] and len(model.get_submodule(p)) ==
                verdict.get("depth") and _indexes_cache(model.get_submodule(p)[0])
                and not any(getattr(m, "is_causal", None) is False for m in model.get_submodule(p)[0].modules())]
        if len(fits) == 1:
            entries = list(model.get_submodule(fits[0]))
            del others[fits[0]]
            stacks.append(StackPlan(
                path=fits[0], length=len(entries), block_class=class_path(type(entries[0])),
                params_per_block=round(sum(block_params(b) for b in entries) / len(entries)),
            ))
    return stacks, others


def _decoder_lists(model) -> tuple[list[StackPlan], dict[str, str]]:
    stacks, others = [], {}
    for path, blocks in model.named_modules():
        if not isinstance(blocks, nn.ModuleList) or not len(blocks) or not all(map(is_block, blocks)):
            continue
        if any(path.startswith(s.path + ".") for s in stacks):
            continue  # lists inside a decoder block are part of that block
        entries = list(blocks)
        if len({type(b) for b in entries}) > 1:
            others[path] = describe_blocks(entries)
        elif not _causal_with_cache(entries[0]):
            others[path] = (f"{len(entries)} {type(entries[0]).__name__} blocks that attend both ways (an encoder or "
                            "a media tower, run once per request)")
        else:
            stacks.append(StackPlan(
                path=path, length=len(entries), block_class=class_path(type(entries[0])),
                params_per_block=round(sum(block_params(b) for b in entries) / len(entries)),
            ))
    return stacks, others


def find_stacks(model) -> tuple[list[StackPlan], dict[str, str]]:
    """(stacks in registration order, which is the order a DiT calls them (FACTS, Table 3); {path: why not a stack}).
    Several denoiser components (``diffuse.analysis.Denoisers``): each one's, its name before their paths."""
    from diffuse.analysis import denoisers_class

    if isinstance(model, denoisers_class()):
        stacks, others = [], {}
        for name, component in model.named_children():
            found, other = find_stacks(component)
            stacks += [dataclasses.replace(st, path=f"{name}.{st.path}") for st in found]
            others.update({f"{name}.{p}": why for p, why in other.items()})
        return stacks, others
    lists = top_lists(model)
    picked = picked_not_looped(type(model), [p for p, _ in lists])
    stacks, others = [], {}
    for path, blocks in lists:
        entries = list(blocks)
        if not entries:
            others[path] = "nothing"
        elif not all(map(is_block, entries)):
            kinds = ", ".join(dict.fromkeys(type(e).__name__ for e in entries))
            others[path] = f"{len(entries)} single layers ({kinds}), not blocks"
        elif len({type(b) for b in entries}) > 1:
            others[path] = describe_blocks(entries)
        elif path in picked:
            others[path] = (f"{len(entries)} {type(entries[0]).__name__} blocks that {type(model).__name__} never loops "
                            "over (it picks them one by one): not a chain")
        else:
            stacks.append(StackPlan(
                path=path,
                length=len(entries),
                block_class=class_path(type(entries[0])),
                params_per_block=round(sum(block_params(b) for b in entries) / len(entries)),
            ))
    return stacks, others
