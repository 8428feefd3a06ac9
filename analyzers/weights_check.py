"""Refuse, before any node starts, a checkpoint whose block tensors a node could not load.

A node reads its blocks straight from the safetensors files, by the names and
rules the model's library applies when it loads them (``diffuse.plan.modelfiles``:
transformers' own renamings and converters, or a stack found under other names
by its blocks' shapes). This analyzer makes the same weight map from the files'
headers (names and shapes; no tensor data is read) and checks every tensor of
every block of every stack (a folder of config files only, checked before its
weights are downloaded, is not refused for it): it must be there, and have the shape the block
declares; one made by a converter (a mixture-of-experts layer's experts, fused)
is made on weightless tensors, by the converter's own operations, and its shape
compared. Anything else is a refusal in one line, naming the first tensor that
fails.
"""

from __future__ import annotations

import os

from diffuse.plan.analysis import Analyzer
from diffuse.errors import DiffuseError, RefusedModel

from analyzers.stack_finder import denoiser_on_meta


class WeightsCheck(Analyzer):
    name = "weights_check"
    phase = "config"
    needs = ("stacks", "stack_widths")  # only stacks chain_check accepted
    provides = ("stack_weights",)
    description = ("Checks, from the safetensors headers, that a node can load every tensor of every stack's blocks "
                   "as the model's library would (renamed, converted), with the shapes the blocks declare.")

    def analyze(self, subject, draft):
        stacks = draft["stacks"]
        if not stacks:
            return {"stack_weights": {}}
        model = denoiser_on_meta(subject)
        if not all(map(has_weights, subject.component_dirs().values())):  # config files only (checked before download)
            return {"stack_weights": {s.path: "not checked (the folder holds no weights)" for s in stacks}}
        try:
            gguf_matches(subject, model)
            saved = subject.denoiser_config.get("quantization_config")  # (a checkpoint saved quantized)
            return {"stack_weights": stack_weights(subject.weight_map(), model, [s.path for s in stacks], saved)}
        except RefusedModel:
            raise
        except DiffuseError as exc:
            raise RefusedModel(subject.path, str(exc)) from exc


def gguf_matches(subject, model) -> None:
    """Each GGUF denoiser file checked against its component's config: every tensor there, in its shape."""
    from diffuse.plan.ggufread import GGUFFile, check_names, gguf_parts

    for prefix, path in gguf_parts(subject).items():
        component = model.get_submodule(prefix[:-1]) if prefix else model
        check_names(GGUFFile(path), component, type(component).__name__)


def has_weights(component_dir: str) -> bool:
    from diffuse.plan.modelfiles import WEIGHTS_NAMES

    from diffuse.plan.ggufread import gguf_in

    return any(os.path.isfile(os.path.join(component_dir, n)) for pair in WEIGHTS_NAMES for n in pair) or \
        gguf_in(component_dir) is not None


def stack_weights(files: dict[str, str], model, paths: list[str], saved: dict | None = None) -> dict[str, str]:
    """{stack path: what its blocks load (tensors, and how many a converter makes)}; a ``DiffuseError`` naming
    the first tensor a node could not load as the library does. ``files``: tensor name -> safetensors file;
    ``saved``: the config's ``quantization_config`` (a linear weight saved by bitsandbytes is packed)."""
    from safetensors import safe_open

    from diffuse.plan.bnbread import stored_fits
    from diffuse.plan.ggufread import for_component
    from diffuse.plan.modelfiles import located, renamed_for

    wmap = located(renamed_for(files, model), model, paths)
    headers: dict[str, object] = {}

    def shape_of(key: str, file: str) -> tuple:
        if file not in headers:
            headers[file] = for_component(file) if file.endswith(".gguf") else safe_open(file, "pt")
        if file.endswith(".gguf"):
            return headers[file].shape(key) if key in headers[file] else None
        return tuple(headers[file].get_slice(key).get_shape())

    out, made = {}, {}
    try:
        for path in paths:
            count = converted = 0
            for i, block in enumerate(model.get_submodule(path)):
                for name, t in block.state_dict().items():
                    full = f"{path}.{i}.{name}"
                    want = tuple(t.shape)
                    if full not in wmap:
                        raise DiffuseError(f"the checkpoint has no "
                                           f"tensor for {full} under any name the model's library loads it by, so a "
                                           "node could not load that block")
                    conv = wmap.converted.get(full)
                    if conv is not None:
                        lacking = [p for p in conv.converter.source_patterns if p not in {q for _, q, _ in conv.sources}]
                        if lacking:
                            raise DiffuseError(f"the checkpoint has no tensor matching {', '.join(lacking)} of the "
                                               f"tensors the model's library makes {full} from (it has "
                                               f"{conv.sources[0][0]}), so a node could not load that block")
                        if full not in made:
                            try:
                                made.update(conv.shapes(shape_of))
                            except Exception as exc:
                                raise DiffuseError(f"the checkpoint's {conv.sources[0][0]} cannot be converted into "
                                                   f"{full} by the model's library's own rule ({type(exc).__name__}: "
                                                   f"{str(exc)[:160]}), so a node could not load that block") from exc
                        have, converted = made.get(full), converted + 1
                        source = f"{conv.sources[0][0]} and {len(conv.sources) - 1} more, converted"
                    else:
                        have, source = shape_of(wmap.source(full), wmap[full]), wmap.source(full)
                    if have != want and have != stored_fits(block, name, full, wmap, saved):
                        raise DiffuseError(f"the checkpoint's {source} has shape {list(have or ())} where {full} "
                                           f"needs {list(want)}, so a node could not load that block")
                    count += 1
            out[path] = f"{count} tensors" + (f", {converted} made by the library's converters" if converted else "")
    finally:
        headers.clear()
    return out
