"""From a model folder to a slicing plan: refusals first, then shape analysis.

The core reads few fields of the analyzers' draft, and declares them here with
their types: a missing one is an error naming it, not a KeyError later.
"""

from __future__ import annotations

import contextlib

import dataclasses

from diffuse.plan.analysis import ModelSubject, StackCall, run_analyzers
from diffuse.errors import DiffuseError, RefusedModel
from diffuse.plan.fetching import hub_commit, partial_folder
from diffuse.plan.contracts import PATCHABLE, UNCUT_STEPS, CallPlan, ModelIdentity, ReturnMap, SlicingPlan, even_route

CONFIG_FIELDS = {"stacks": list}  # what the core reads from the config phase (others are optional)
CALL_FIELDS = {"call_plan": CallPlan, "return_map": ReturnMap}  # ... and from a stack's first call


def config_draft(subject: ModelSubject, wanted: set | None = None) -> dict:
    """The config-phase analyzers' draft, with each stack's sizing config key (if found) set on it
    (``wanted``: only the analyzers these fields need)."""
    draft = run_analyzers("config", subject, required=CONFIG_FIELDS, wanted=wanted)
    keys = draft.get("stack_config_keys") or {}
    draft["stacks"] = [dataclasses.replace(s, config_key=keys.get(s.path, s.config_key)) for s in draft["stacks"]]
    return draft


def analyze(path: str, encoders: bool = False, decoders: bool = False) -> tuple[ModelSubject, dict]:
    """Config-phase analysis: refuses unsplittable models before anything is loaded (``encoders``: a pipeline's
    encoders hold stacks too, ``diffuse.plan.encoders``; ``decoders``: its VAE, ``diffuse.plan.decoders``)."""
    subject = ModelSubject.from_path(path, encoders, decoders)
    if not subject.denoiser and not subject.autoregressive:
        raise RefusedModel(path, "no denoiser component (transformer/unet) in model_index.json")
    return subject, config_draft(subject)


def learn_call(stack, args: tuple, kwargs: dict, block, layered: bool = False) -> tuple[CallPlan, ReturnMap]:
    """The call-phase analyzers on a stack's first call (``block``: its first block, whose weights are never read;
    ``layered``: its layers' calls are collected and sent together, so a layer may return side outputs)."""
    found = run_analyzers("call", StackCall(stack, args, kwargs, block, layered), required=CALL_FIELDS)
    return found["call_plan"], found["return_map"]


def make_plan(subject: ModelSubject, draft: dict, addresses: list[str] = (), keys: list[str] | None = None,
              compute_dtype: str = "float32", quantize: str = "") -> SlicingPlan:
    from diffuse.plan.prequant import no_quantize_over_quantized

    no_quantize_over_quantized(subject, quantize)  # (a GGUF denoiser, a checkpoint saved quantized: held as they are)
    stacks = tuple(draft["stacks"])
    two = draft.get("two_stream", {})
    return SlicingPlan(
        model=ModelIdentity(
            path=subject.path, denoiser=subject.denoiser, denoiser_class=subject.denoiser_class_name,
            content_hash=subject.content_hash(), commit=hub_commit(subject.path),
        ),
        stacks=stacks,
        output_kind=draft.get("output_kind", "image"),
        patch_policy={s.path: UNCUT_STEPS if two.get(s.path) else PATCHABLE for s in stacks},
        compute_dtype=compute_dtype,
        route=even_route(stacks, list(addresses), keys),
        quantize=quantize,
    )


def load_pipeline(path: str, subject: ModelSubject | None = None, stacks: list | None = None, dtype=None):
    """The pipeline itself, loaded by diffusers from safetensors, never with remote code.

    With ``stacks``, the denoiser is built here without its blocks (each stack's
    first block stays weightless, in the dtypes it would be loaded in, to learn its
    return map at the first call: ``analyzers/calls.py``), so the client never
    holds, reads or fetches the weights it hands to nodes. ``dtype`` (a torch dtype; None: diffusers'
    default) is passed as ``torch_dtype``, and the denoiser without blocks is read in it by the same rule.
    """
    import diffusers

    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    typed = {"torch_dtype": dtype} if dtype is not None else {}
    if not stacks and not _gguf(path, subject):
        if partial_folder(path):
            raise DiffuseError(f"{path} holds only part of its model (what a client or a node of it fetched): "
                               "load it by its Hub id for a whole run, which fetches the rest")
        pipe = diffusers.DiffusionPipeline.from_pretrained(path, use_safetensors=True, **typed)
    else:
        subject = subject or ModelSubject.from_path(path)
        shell = load_denoiser_shell(path, subject, stacks or [], dtype)  # no stacks: a GGUF denoiser, whole
        shells = {n: shell.part(n) for n in subject.denoisers} if subject.several else {subject.denoiser: shell}
        with _denoiser_taken_as(shells):
            pipe = diffusers.DiffusionPipeline.from_pretrained(path, use_safetensors=True, **shells, **typed)
        for name, part in shells.items():
            if getattr(pipe, name) is not part:
                raise DiffuseError(f"diffusers loaded its own {name} instead of the one without blocks")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _gguf(path: str, subject: ModelSubject | None) -> bool:
    """Whether a denoiser of the pipeline at ``path`` is a GGUF file (loaded here, whole, as diffusers' GGUF
    quantizer holds it: ``diffuse.plan.ggufread``)."""
    from diffuse.plan.ggufread import gguf_parts

    return bool(gguf_parts(subject or ModelSubject.from_path(path)))


@contextlib.contextmanager
def _denoiser_taken_as(shells: dict):
    """While a pipeline loads, each component named in ``shells`` is its shell. A pipeline whose ``__init__``
    declares a denoiser optional (Wan: ``transformer=None``, ``transformer_2=None``) loads that component from
    disk even when one is passed, and would hold every block for a moment; the component loader is told to hand
    the shell back instead."""
    from diffusers.pipelines import pipeline_utils

    load = pipeline_utils.load_sub_model

    def load_sub_model(*args, **kwargs):
        name = kwargs.get("name")
        return shells[name] if name in shells else load(*args, **kwargs)

    pipeline_utils.load_sub_model = load_sub_model
    try:
        yield
    finally:
        pipeline_utils.load_sub_model = load


def load_model(path: str, subject: ModelSubject, dtype=None):
    """A transformers model, loaded by its own ``from_pretrained`` from safetensors, never with remote code
    (the layers it hands to nodes are freed when it is split); in ``dtype`` where one is given."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    typed = {"dtype": dtype} if dtype is not None else {}
    model = subject.denoiser_class().from_pretrained(path, use_safetensors=True, trust_remote_code=False, **typed)
    model.eval()
    return model


def load_denoiser_shell(path: str, subject: ModelSubject, stacks: list, dtype=None):
    """The denoiser with every stack block left on meta (weightless; the first in the dtypes a load would give
    it, ``typed_unread``; a VAE a node holds, ``diffuse.plan.decoders``, is a stack too); with several denoiser
    components, a ``Denoisers`` holding each.

    Tensors come from the safetensors files exactly as ``from_pretrained`` reads
    them (same placement, cast to the parameter's dtype as it does), which keeps
    the client's own computation bit-identical to a plain load.
    """
    from diffuse.plan.analysis import build_meta
    from diffuse.plan.ggufread import gguf_parts, load_gguf_parts, part_of
    from diffuse.plan.modelfiles import fp32_kept, load_into, located, renamed_for, typed_unread

    model = build_meta(subject.denoiser_class(), subject.denoiser_config)
    heads = tuple(st.path + "." for st in stacks)
    keep = fp32_kept(model, dtype)
    ggufs = gguf_parts(subject)  # GGUF denoisers: held as diffusers' GGUF quantizer holds them
    load_gguf_parts(model, ggufs, dtype, skip=lambda name: name.startswith(heads))
    if len(ggufs) < len(subject.component_dirs()):
        wmap = located(renamed_for(subject.weight_map(), model), model, [st.path for st in stacks])
        load_into(model, "", wmap, dtype, skip=lambda name: name.startswith(heads) or part_of(ggufs, name), keep=keep)
    for st in stacks:  # a VAE a node holds (diffuse.plan.decoders) too, by its own rule: the pipeline casts to its dtype
        first = model.get_submodule(st.path)[0]
        typed_unread(first, f"{st.path}.0.", dtype, fp32_kept(first, dtype) if st.path in subject.decoders else keep)
    model.eval()
    return model


def denoiser_dtype(denoiser) -> str:
    """The dtype a denoiser computes in: its first parameter's, passing over modules its class keeps in float32
    (``_keep_in_fp32_modules``: Wan's modulation table comes first, in float32 under bfloat16; with several
    components held as one, what each of them keeps), as diffusers' own ``dtype`` property reads it."""
    kept = getattr(denoiser, "_keep_in_fp32_modules", None) or ()
    if not hasattr(type(denoiser), "_keep_in_fp32_modules"):  # several components held as one: what each keeps
        kept = {k for child in denoiser.children() for k in getattr(child, "_keep_in_fp32_modules", None) or ()}
    p = next((p for name, p in denoiser.named_parameters()  # (a GGUF weight's quantized bytes are not its dtype)
              if p.is_floating_point() and not any(k in name.split(".") for k in kept)), None)
    return str(p.dtype).removeprefix("torch.") if p is not None else "float32"
