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
attend causally and index a cache by layer, as a tiny probe of the model's
decoder shows them doing (``analyzers.causal_probe``: a change at a later
position leaves the earlier ones' outputs as they were; one layer of the cache
grows by the positions given), never as attribute names say: the decoder. A
list of blocks that attends both ways, or that the decoder never calls (a
vision or audio tower, a text encoder), runs once per request and stays on the
client, where the media is.

A pipeline with several denoiser components (Wan 2.2's two experts,
``diffuse.plan.analysis.Denoisers``) has the stacks of each, named from the
component: ``transformer.blocks``, ``transformer_2.blocks``.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from diffuse.plan.analysis import Analyzer
from diffuse.errors import RefusedModel
from diffuse.plan.contracts import StackPlan

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
            stacks, others = find_stacks(model, getattr(subject, "encoders", ()), getattr(subject, "decoders", ()))
        else:
            stacks, others = find_decoder_stacks(model)
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


def find_decoder_stacks(model) -> tuple[list[StackPlan], dict[str, str]]:
    """(the decoder stacks, in registration order; {path: why not a stack}) of a token-by-token model: the lists
    of same-class blocks whose first block, on a tiny probe of the model's decoder, attends causally and writes
    one layer of the key/value cache (``analyzers.causal_probe``)."""
    from analyzers.causal_probe import probe_lists

    stacks, others, lists = [], {}, {}
    for path, blocks in model.named_modules():
        if not isinstance(blocks, nn.ModuleList) or not len(blocks) or not all(map(is_block, blocks)):
            continue
        if any(path.startswith(p + ".") for p in lists):
            continue  # lists inside a block of a list are part of that block
        entries = list(blocks)
        if len({type(b) for b in entries}) > 1:
            others[path] = describe_blocks(entries)
        else:
            lists[path] = entries
    with quiet():
        verdicts = probe_lists(model, list(lists))
    for path, entries in lists.items():
        if verdicts[path] is not None:
            others[path] = f"{len(entries)} {type(entries[0]).__name__} {verdicts[path]}"
        else:
            stacks.append(StackPlan(
                path=path, length=len(entries), block_class=class_path(type(entries[0])),
                params_per_block=round(sum(block_params(b) for b in entries) / len(entries)),
            ))
    return stacks, others


def find_stacks(model, encoders=(), decoders=()) -> tuple[list[StackPlan], dict[str, str]]:
    """(stacks in registration order, which is the order a DiT calls them (FACTS, Table 3); {path: why not a stack}).
    Several denoiser components (``diffuse.plan.analysis.Denoisers``): each one's, its name before their paths;
    of those named in ``encoders`` (a pipeline's text encoders, ``diffuse.plan.encoders``), ``encoder_lists``; a
    decoder (a VAE, ``diffuse.plan.decoders``) is the stack of one block it is held as, its component's name."""
    from diffuse.plan.analysis import denoisers_class

    if isinstance(model, denoisers_class()):
        stacks, others = [], {}
        for name, component in model.named_children():
            if name in decoders:
                vae = model.part(name)
                stacks.append(StackPlan(path=name, length=1, block_class=class_path(type(vae)),
                                        params_per_block=block_params(component[0])))
                continue
            found, other = encoder_lists(component) if name in encoders else find_stacks(component)
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


def encoder_lists(model) -> tuple[list[StackPlan], dict[str, str]]:
    """(stacks, {path: why not}) of an encoder (a text encoder of a pipeline): every ModuleList of same-class
    blocks, wherever it is nested (``encoder.block`` beside T5's embedding and final norm, ``text_model.encoder.
    layers`` in CLIP's), but not a list inside a block of another. The encoder runs each once per request, its
    layers' calls collected and sent together (``diffuse.client.encoders``), so layers called with arguments of
    their own (a mask per attention kind) and side outputs handed on (T5's position biases) are kept."""
    stacks, others, seen = [], {}, []
    for path, blocks in model.named_modules():
        if not isinstance(blocks, nn.ModuleList) or not len(blocks) or not all(map(is_block, blocks)):
            continue
        if any(path.startswith(p + ".") for p in seen):
            continue  # lists inside a block of a list are part of that block
        seen.append(path)
        entries = list(blocks)
        if len({type(b) for b in entries}) > 1:
            others[path] = describe_blocks(entries)
            continue
        stacks.append(StackPlan(
            path=path, length=len(entries), block_class=class_path(type(entries[0])),
            params_per_block=round(sum(block_params(b) for b in entries) / len(entries)),
        ))
    return stacks, others
