"""A pipeline's encoders on the ring: their block stacks split into slices like the denoiser's.

A diffusion pipeline's text encoders (a T5 or UMT5 encoder, CLIP's text model, a
Llama, Gemma or Qwen language model read for its hidden states) are often larger
than the client that runs the pipeline. With ``--encoders ring`` each such
component joins the denoiser among the components whose stacks nodes hold, as
Wan 2.2's second expert does (``diffuse.plan.analysis.Denoisers``): its stacks
are named from it (``text_encoder.encoder.block``), found by shape like any
other (``analyzers.stack_finder``), and called through stand-ins when the
pipeline encodes its prompt (``diffuse.client.encoders``). The tokenizer, the
token embedding and the final norm stay with the client.

An encoder is found (``diffuse.plan.analysis.encoder_components``) by what the folder says, never by its name: a component
that transformers loads (``model_index.json`` names the library) and that has a
``config.json`` (a model, not a tokenizer or a processor).

``ENCODERS``: where the encoders go. ``client`` (the default) keeps them whole on
the client, as plain diffusers holds them; ``ring`` puts their stacks on the
nodes (every node of the ring holds a slice of each, beside its slice of the
denoiser: an encoder runs once per request).
"""

from __future__ import annotations


ENCODERS = ("client", "ring")


def check_encoders(where: str | None) -> bool:
    """Whether ``--encoders`` (None: the default, client) puts the encoders on the ring; anything else refused."""
    from diffuse.errors import DiffuseError

    if where in (None, "client"):
        return False
    if where == "ring":
        return True
    raise DiffuseError(f"--encoders {where}: choose {' or '.join(ENCODERS)}")


def encoder_stacks(stacks, subject) -> list[str]:
    """The paths of ``stacks`` that belong to one of the subject's encoders."""
    heads = tuple(f"{name}." for name in getattr(subject, "encoders", ()))
    return [s.path for s in stacks if heads and s.path.startswith(heads)]


def plan_subject(plan):
    """The subject a plan was made from: its folder's, with the encoders' stacks, or the VAE's (``diffuse.plan.
    decoders``), or both, where the plan's model is the pipeline with them (its content hash, which covers every
    component holding stacks, tells)."""
    from diffuse.plan.analysis import ModelSubject

    subject = ModelSubject.from_path(plan.model.path)
    if subject.content_hash() != plan.model.content_hash and not subject.autoregressive and subject.denoiser:
        for encoders, decoders in ((True, False), (False, True), (True, True)):
            other = ModelSubject.from_path(plan.model.path, encoders, decoders)
            if other.denoisers != subject.denoisers and other.content_hash() == plan.model.content_hash:
                return other
    return subject
