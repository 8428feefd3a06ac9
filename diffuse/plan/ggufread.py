"""Pre-quantized GGUF denoisers, read as they are: a pipeline folder whose denoiser component holds its
``config.json`` and one ``.gguf`` file in place of safetensors.

A GGUF file records, in its header, every tensor's name, type, shape and where its bytes lie. ``GGUFFile``
reads that header only (the ``gguf`` package maps the file; no tensor's bytes are touched until it is asked
for), so a node reads its own slice's byte ranges and the client its own parts, never the rest.

Each tensor is taken as diffusers' own GGUF loader takes it (``load_gguf_checkpoint``: a copy of its bytes,
a ``GGUFParameter`` keeping the quantized bytes where its type is not F32 or F16), and a module is loaded by
diffusers' own GGUF quantizer (``GGUFQuantizer``: its linear layers become ``GGUFLinear``, which dequantizes
with diffusers' functions at each call; what the model keeps in float32 is dequantized at load, as diffusers
does). A split run therefore equals ``Model.from_single_file(FILE, quantization_config=
GGUFQuantizationConfig(compute_dtype=D), torch_dtype=D, config=...)`` run whole, D the run's compute dtype
(float32 unless ``--dtype`` names another).

A file whose tensors carry the model's own (diffusers') names is read as it is, as diffusers reads it; one in
the model's original layout is converted by diffusers' own conversion (``diffuse.plan.gguflayout``), run so that
each process still reads only its own tensors' bytes.
"""

from __future__ import annotations

import os
import warnings

from diffuse.errors import DiffuseError

EXTRA = "pip install 'diffuse[gguf]'"
PLAIN = ("F32", "F16")  # types diffusers holds as plain tensors; every other type stays quantized


def gguf_in(component_dir: str) -> str | None:
    """The one ``.gguf`` file of a component folder that holds no safetensors weights, or None."""
    if not os.path.isdir(component_dir):
        return None
    names = sorted(os.listdir(component_dir))
    if any(n.endswith(".safetensors") or n.endswith(".safetensors.index.json") for n in names):
        return None
    found = [n for n in names if n.endswith(".gguf")]
    if len(found) > 1:
        raise DiffuseError(f"{component_dir} holds {len(found)} .gguf files ({', '.join(found[:3])}); a component "
                           "folder holds one")
    return os.path.join(component_dir, found[0]) if found else None


def need_gguf(what: str = "a GGUF checkpoint"):
    """The ``gguf`` package, or a one-line refusal naming the extra that installs it."""
    try:
        import gguf
    except ImportError:
        raise DiffuseError(f"{what} needs the gguf package, which is not installed: {EXTRA}") from None
    return gguf


class GGUFFile:
    """One GGUF file's header: each tensor's type, shape (as torch orders it) and bytes, by name. A file in a
    model's original layout is seen under the model's own names once ``adopt`` has found it so."""

    def __init__(self, path: str):
        gguf = need_gguf(f"{os.path.basename(path)} (a GGUF checkpoint)")
        self.path = path
        try:
            self.reader = gguf.GGUFReader(path)
        except (ValueError, OSError, KeyError) as exc:
            raise DiffuseError(f"{path}: not a GGUF file the gguf package reads ({str(exc)[:120]})") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.converted = None  # a ``diffuse.plan.gguflayout.Converted`` where the file is in another layout
        self.adopted = False  # its names settled against the model's (``adopt``)
        self.checked = False  # checked against the model's config (``check_names``)

    def adopt(self, model) -> "GGUFFile":
        """Seen under ``model``'s names: a file holding fewer than half of them is in the model's original
        layout, converted as diffusers converts it (``diffuse.plan.gguflayout``)."""
        if not self.adopted and model is not None:
            own = list(model.state_dict())
            if sum(n in self.tensors for n in own) <= len(own) // 2:
                from diffuse.plan.gguflayout import Converted

                self.converted = Converted(self, model)
            self.adopted = True
        return self

    def __contains__(self, name: str) -> bool:
        return name in (self.converted.meta if self.converted is not None else self.tensors)

    def names(self) -> list[str]:
        return list(self.converted.meta if self.converted is not None else self.tensors)

    def kind(self, name: str) -> str:
        """The tensor's GGML type: F32, F16, Q8_0, Q4_K, ..."""
        if self.converted is not None:
            t = self.converted.meta[name]
            return t.quant_type.name if hasattr(t, "quant_type") else {"float16": "F16"}.get(str(t.dtype)[6:], "F32")
        return self.tensors[name].tensor_type.name

    def shape(self, name: str) -> tuple:
        """The tensor's shape as torch orders it (GGUF lists the innermost dimension first)."""
        if self.converted is not None:
            from diffusers.quantizers.gguf.utils import GGML_QUANT_SIZES, _quant_shape_from_byte_shape

            t = self.converted.meta[name]
            if not hasattr(t, "quant_type"):
                return tuple(t.shape)
            block, size = GGML_QUANT_SIZES[t.quant_type]
            return tuple(_quant_shape_from_byte_shape(t.shape, size, block))
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def nbytes(self, name: str) -> int:
        if self.converted is not None:
            return self.converted.meta[name].numel() * self.converted.meta[name].element_size()
        return int(self.tensors[name].n_bytes)

    def header_size(self) -> int:
        """Bytes before the first tensor's data: the header, metadata and tensor table."""
        return int(self.reader.data_offset)

    def read(self, names: list[str]) -> dict:
        """The tensors ``names`` as diffusers' GGUF loader makes them: their bytes copied out of the file, kept
        quantized (a ``GGUFParameter``) unless the type is F32 or F16."""
        if self.converted is not None:
            return self.converted.read(names)
        import torch
        from diffusers.quantizers.gguf.utils import GGUFParameter

        out = {}
        for name in names:
            t = self.tensors[name]
            weights = torch.from_numpy(t.data.copy())
            out[name] = weights if t.tensor_type.name in PLAIN else GGUFParameter(weights, quant_type=t.tensor_type)
        return out

    def view(self, name: str):
        """The file's tensor ``name`` as a view of the mapped file (nothing read), typed as ``read`` types it."""
        import torch

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the mapping is read-only, and nothing writes to it
            return self._typed(name, torch.from_numpy(self.tensors[name].data))

    def weightless(self, name: str):
        """The file's tensor ``name`` on the meta device: its shape and type, no data."""
        import numpy as np
        import torch

        data = self.tensors[name].data
        dtype = torch.from_numpy(np.empty(0, dtype=data.dtype)).dtype
        return self._typed(name, torch.empty(tuple(data.shape), dtype=dtype, device="meta"))

    def rows(self, name: str) -> int:
        """The first dimension of the file's tensor ``name`` as stored (a quantized one's rows of bytes)."""
        shape = self.tensors[name].data.shape
        return int(shape[0]) if len(shape) else 1

    def _typed(self, name: str, data):
        from diffusers.quantizers.gguf.utils import GGUFParameter

        kind = self.tensors[name].tensor_type
        return data if kind.name in PLAIN else GGUFParameter(data, quant_type=kind)


def for_component(path: str, files: dict | None = None) -> GGUFFile:
    """``path``'s file seen under its component's names (the component's config.json beside it says which
    model it is; ``adopt``)."""
    gfile = opened(path, files)
    if not gfile.adopted:
        gfile.adopt(_component_model(os.path.dirname(path)))
    return gfile


def _component_model(folder: str):
    """The weightless model a component folder's config.json names, if diffusers names it; else None."""
    import json

    import diffusers

    from diffuse.plan.components import build_meta

    try:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        cls = getattr(diffusers, str(config.get("_class_name")), None)
    except (OSError, ValueError):
        return None
    return build_meta(cls, config) if isinstance(cls, type) else None


def opened(path: str, files: dict | None = None) -> GGUFFile:
    """``path``'s header, read once per ``files`` (a dict the caller keeps while it loads)."""
    if files is None:
        return GGUFFile(path)
    if ("gguf", path) not in files:
        files[("gguf", path)] = GGUFFile(path)
    return files[("gguf", path)]


def header_entries(path: str) -> dict[str, dict]:
    """Tensor name -> {dtype, shape, nbytes}, read from the header alone (as ``needs._header`` gives a
    safetensors file's, plus the bytes each tensor holds in the file)."""
    f = for_component(path)
    return {n: {"dtype": f.kind(n), "shape": list(f.shape(n)), "nbytes": f.nbytes(n)} for n in f.names()}


def header_bytes(path: str) -> bytes:
    """The file's header bytes (names, types, shapes, offsets and metadata): what fingerprints its layout."""
    size = GGUFFile(path).header_size()
    with open(path, "rb") as fh:
        return fh.read(size)


def gguf_kept(model_class) -> list[str]:
    """The module names diffusers' GGUF quantizer keeps in float32 (dequantized at load, never converted):
    the model's ``_keep_in_fp32_modules``, whatever the compute dtype (the quantizer asks for them always)."""
    kept = getattr(model_class, "_keep_in_fp32_modules", None) or []
    return list(kept) if isinstance(kept, (list, tuple)) else [kept]


def check_names(gfile: GGUFFile, model, model_name: str) -> None:
    """Refuse, in one line, a file whose tensors are not the model's own: one it lacks or holds in another
    shape (the first found is named), or a file in another layout than diffusers'."""
    own = model.state_dict()
    gfile.adopt(model)  # (a file in the model's original layout: seen under the model's names)
    missing = [n for n in own if n not in gfile]
    if len(missing) > len(own) // 2:  # another layout (a model's original names), not a tensor or two short
        raise DiffuseError(f"{os.path.basename(gfile.path)} does not name its tensors as {model_name} does "
                           f"(diffusers' layout; it has e.g. {gfile.names()[0]!r}, the model {next(iter(own))!r}), "
                           "nor in an original layout diffusers converts")
    if missing:
        raise DiffuseError(f"{os.path.basename(gfile.path)} does not match the model's config: it has no tensor "
                           f"{missing[0]} (of {len(missing)} missing), which {model_name} declares")
    for name, t in own.items():
        if gfile.shape(name) != tuple(t.shape):
            raise DiffuseError(f"{os.path.basename(gfile.path)} does not match the model's config: its {name} has "
                               f"shape {list(gfile.shape(name))} where {model_name} declares {list(t.shape)}")
    from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES

    known = {*PLAIN, *(k.name for k in SUPPORTED_GGUF_QUANT_TYPES)}
    odd = next((n for n in own if gfile.kind(n) not in known), None)
    if odd is not None:
        raise DiffuseError(f"{os.path.basename(gfile.path)} holds {odd} as {gfile.kind(odd)}, a type diffusers' GGUF "
                           f"loader does not dequantize (it reads {', '.join(sorted(known - set(PLAIN)))})")


def load_gguf_into(module, prefix: str, gfile: GGUFFile, dtype=None, skip=None, device=None, kept=()) -> int:
    """Assign ``module``'s tensors (``prefix``: where it sits in its model) from ``gfile``, held as diffusers'
    GGUF quantizer holds them for compute dtype ``dtype`` (None: float32): quantized linear weights in
    ``GGUFLinear`` layers, plain tensors cast to ``dtype``, what the modules named in ``kept`` (``gguf_kept``)
    hold in float32. Only the tensors asked for are read. Names for which ``skip(name)`` is true stay on
    meta. Returns the number of tensors assigned."""
    import torch
    from diffusers import GGUFQuantizationConfig
    from diffusers.models.model_loading_utils import load_model_dict_into_meta
    from diffusers.quantizers.gguf.gguf_quantizer import GGUFQuantizer

    dtype = dtype or torch.float32
    state = {}
    for name, current in module.state_dict(keep_vars=True).items():
        if skip is not None and skip(name):
            continue
        full = prefix + name
        if full not in gfile:
            raise DiffuseError(f"{os.path.basename(gfile.path)} does not match the model's config: it has no tensor "
                               f"{full}, which {type(module).__name__} declares")
        if gfile.shape(full) != tuple(current.shape):
            raise DiffuseError(f"{os.path.basename(gfile.path)} does not match the model's config: its {full} has "
                               f"shape {list(gfile.shape(full))} where the model declares {list(current.shape)}")
        state[name] = full
    read = gfile.read(list(state.values()))  # only these tensors' bytes (a converted file: their sources' only)
    state = {name: read[full] for name, full in state.items()}
    quantizer = GGUFQuantizer(GGUFQuantizationConfig(compute_dtype=dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantizer.preprocess_model(model=module, device_map=None, state_dict=state, keep_in_fp32_modules=list(kept))
        load_model_dict_into_meta(module, state, dtype=dtype, device_map={"": torch.device(device or "cpu")},
                                  hf_quantizer=quantizer, keep_in_fp32_modules=list(kept), unexpected_keys=[])
    if not prefix:  # the model itself (a client's denoiser): marked as diffusers marks a model it quantized
        quantizer.postprocess_model(module)
        module.hf_quantizer = quantizer
    return len(state)


def gguf_parts(subject) -> dict[str, str]:
    """{prefix of its tensors' names ("" for the one denoiser): its GGUF file} for each denoiser component whose
    weights are a GGUF file."""
    out = {}
    for prefix, folder in subject.component_dirs().items():
        found = gguf_in(folder)
        if found is not None:
            out[prefix] = found
    return out


def part_of(parts: dict[str, str], name: str) -> tuple[str, str] | None:
    """(prefix, file) of the GGUF component holding the tensor ``name``, or None."""
    return next(((p, f) for p, f in parts.items() if name.startswith(p)), None)


def load_gguf_parts(model, parts: dict[str, str], dtype=None, skip=None, files: dict | None = None) -> int:
    """Each GGUF component of ``model`` (a denoiser, or ``Denoisers`` holding several) loaded from its file as
    diffusers' GGUF quantizer holds it, but for the tensors ``skip(name)`` names (they stay on meta); each file
    checked first against the component's config (``check_names``). Returns the number of tensors assigned."""
    done = 0
    for prefix, path in parts.items():
        module = model.get_submodule(prefix[:-1]) if prefix else model
        gfile = opened(path, files)
        check_names(gfile, module, type(module).__name__)
        own = (lambda name, prefix=prefix: skip(prefix + name)) if skip is not None else None
        done += load_gguf_into(module, "", gfile, dtype, own, kept=gguf_kept(type(module)))
    return done


def load_gguf_block(model, parts: dict[str, str], where: tuple[str, int], block, dtype, files: dict, device) -> int:
    """Block ``where`` (stack path, index) of ``model`` (a weightless skeleton), ``block``, read from its GGUF
    component's file: only its own tensors' bytes, held as diffusers' GGUF quantizer holds them."""
    prefix, path = part_of(parts, f"{where[0]}.")
    component = model.get_submodule(prefix[:-1]) if prefix else model
    gfile = opened(path, files)
    if not getattr(gfile, "checked", False):  # the whole file against the config, once a load: a node holding
        check_names(gfile, component, type(component).__name__)  # some blocks refuses a file wrong elsewhere too
        gfile.checked = True
    return load_gguf_into(block, f"{where[0][len(prefix):]}.{where[1]}.", gfile, dtype, device=device,
                          kept=gguf_kept(type(component)))
