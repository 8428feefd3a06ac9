"""A pipeline's components built as the plan addresses them: one class each, or several held as one.

Where more than one component of a pipeline holds stacks (Wan 2.2's two experts, the text encoders with
``--encoders ring``, the VAE with ``--decoder``), they are held as one ``Denoisers`` module, each a child under
its component name, so that their stacks are addressed, split and served as one model's. A VAE (a decoder,
``diffuse.plan.decoders``) has no list of blocks a pass could thread: it is held as a stack of one block, a
``Coder``, whose modules are the VAE's own (its weights keep their names, under ``vae.0.``) and whose call runs
the VAE's own ``decode`` or ``encode``, whole, on the node that holds it.

Everything here is built on first use (importing torch only then: ``diffuse check`` answers from its cache
without it); one class of each for the process, so instances compare as one type.
"""

from __future__ import annotations

import functools

from diffuse.errors import DiffuseError

DENOISER_ENTRY = "_diffuse_component"  # in each config of several denoisers: its model_index.json entry
DECODER_ENTRY = "_diffuse_decoder"  # ... and, true there, in a decoder's: it is held as a Coder's stack
CODER_OPS = ("decode", "encode")  # what a pass may ask of a Coder


def component_class(lib: str | None, name: str):
    """The class ``model_index.json`` names for a component: diffusers' own, or its library's."""
    import importlib

    import diffusers

    if lib == "diffusers" or lib is None:
        return getattr(diffusers, name)
    return getattr(importlib.import_module(lib), name)


@functools.cache
def coder_class():
    """``Coder``: a VAE as the one block of a stack."""
    import torch.nn

    class Coder(torch.nn.Module):
        """A VAE as a block: its modules, parameters and buffers are the VAE's own (the same objects, so its
        weights keep their names and loading them here loads the VAE), and calling it runs the VAE's ``decode``
        or ``encode`` with the runtime settings the client's VAE has (tiling, slicing and their sizes: its
        plain number and flag attributes), on the call's arguments. Encoding answers the latent distribution's
        parameters (or the latents, where the VAE returns a tensor): the client draws from them itself."""

        _keep_in_fp32_modules = None

        def __init__(self, vae):
            super().__init__()
            for name in ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set"):
                self.__dict__[name] = vae.__dict__[name]
            self.__dict__["vae"] = vae  # not a child: its tensors are this module's already
            self._keep_in_fp32_modules = getattr(vae, "_keep_in_fp32_modules", None)

        def forward(self, op: str, settings: dict, *args, **kwargs):
            vae = self.vae
            if op not in CODER_OPS:
                raise DiffuseError(f"a VAE's pass asks for {str(op)[:32]!r}: only {' or '.join(CODER_OPS)}")
            own = runtime_settings(vae)
            for key, value in (settings or {}).items():
                if key not in own or type(value) is not type(own[key]) or not 0 <= value < float("inf"):
                    raise DiffuseError(f"a VAE's pass sets {str(key)[:64]!r}, which is not one of its settings (or "
                                       "not a number it takes)")
                setattr(vae, key, value)
            out = getattr(vae, op)(*args, **{**kwargs, "return_dict": False})[0]
            if not isinstance(out, torch.Tensor):  # a distribution: what it is made of
                out = getattr(out, "parameters", None)
                if not isinstance(out, torch.Tensor):
                    raise DiffuseError(f"{type(vae).__name__}.{op} answers what cannot travel back")
            return out

    return Coder


def runtime_settings(vae) -> dict:
    """A VAE's runtime settings: its own attributes that are plain flags and numbers (``use_tiling``,
    ``tile_sample_min_size``, ``use_slicing`` ...), as ``enable_tiling`` and the like leave them."""
    return {k: v for k, v in vars(vae).items()
            if not k.startswith("_") and k != "training" and type(v) in (bool, int, float)}


def coders(vae):
    """The stack a VAE is held as: a list of one ``Coder``."""
    import torch.nn

    return torch.nn.ModuleList([coder_class()(vae)])


@functools.cache
def denoisers_class():
    """``Denoisers``: several components of one pipeline held as one module."""
    import torch.nn

    class Denoisers(torch.nn.Module):
        """Several components of one pipeline that hold stacks, as one module, each a child under its component
        name, so that their stacks are addressed, split and served as one model's: ``transformer.blocks`` and
        ``transformer_2.blocks``; a decoder (``decoders``) as the stack of one ``Coder`` it is held as, ``vae``.
        It only holds them; the pipeline calls each component itself (``part`` gives each as it is)."""

        def __init__(self, parts: dict, decoders=()):
            super().__init__()
            self.__dict__["parts"] = dict(parts)
            for name, module in parts.items():
                self.add_module(name, coders(module) if name in decoders else module)

        def part(self, name: str):
            """The component itself (a decoder's VAE, not its stack)."""
            return self.parts[name]

        @classmethod
        def from_config(cls, config: dict):
            """Each component built from its own config by its own class (``build_model``)."""
            parts = {}
            for name, cfg in config.items():
                lib, class_name = cfg[DENOISER_ENTRY]
                own = {k: v for k, v in cfg.items() if k not in (DENOISER_ENTRY, DECODER_ENTRY)}
                parts[name] = build_model(component_class(lib, class_name), own)
            return cls(parts, [n for n, cfg in config.items() if cfg.get(DECODER_ENTRY)])

        def forward(self, *args, **kwargs):
            raise TypeError("Denoisers holds several denoiser components; the pipeline calls each of them")

    return Denoisers


def build_model(cls, config: dict):
    """``cls`` built from a config dict, by its library's own constructor (weights as the caller's context
    makes them: on meta, empty, or real)."""
    init_cfg = {k: v for k, v in config.items() if not k.startswith("_")}
    if hasattr(cls, "_from_config") and hasattr(cls, "config_class"):  # a transformers model
        return cls._from_config(cls.config_class.from_dict(dict(config)))
    return cls.from_config(init_cfg)


def build_meta(cls, config: dict):
    """Build ``cls`` from ``config`` with no weights; non-persistent buffers stay real (see FACTS)."""
    import warnings

    from accelerate import init_empty_weights

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with init_empty_weights():
            return build_model(cls, config)
