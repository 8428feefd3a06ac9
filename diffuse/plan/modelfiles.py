"""Reading a denoiser's weights without loading the rest (finding the model: ``diffuse.plan.resolve``)."""

from __future__ import annotations

import hashlib
import json
import os

from diffuse.errors import DiffuseError

# (index, single file) names: diffusers components, then transformers models
WEIGHTS_NAMES = (("diffusion_pytorch_model.safetensors.index.json", "diffusion_pytorch_model.safetensors"),
                 ("model.safetensors.index.json", "model.safetensors"))


def weight_map(component_dir: str) -> dict[str, str]:
    """Parameter name -> safetensors file, from the index or the single weights file (or -> the component's one
    GGUF file: ``diffuse.plan.ggufread``)."""
    from diffuse.plan.ggufread import for_component, gguf_in

    gguf = gguf_in(component_dir)
    if gguf is not None:  # under the component's own names (converted from another layout where it is in one)
        return {k: gguf for k in for_component(gguf).names()}
    for index_name, single_name in WEIGHTS_NAMES:
        index = os.path.join(component_dir, index_name)
        if os.path.isfile(index):
            with open(index) as f:
                return {k: os.path.join(component_dir, v) for k, v in json.load(f)["weight_map"].items()}
        single = os.path.join(component_dir, single_name)
        if os.path.isfile(single):
            break
    else:
        raise DiffuseError(f"{component_dir} has no safetensors weights ({' or '.join(n for _, n in WEIGHTS_NAMES)}, "
                           "or an index of them) and no .gguf file; Diffuse loads safetensors (and a denoiser's GGUF)")
    from safetensors import safe_open

    with safe_open(single, "pt") as f:
        return {k: single for k in f.keys()}


class WeightMap(dict):
    """Module parameter name -> safetensors file; ``sources`` gives the name a tensor has in the file
    where the two differ (transformers renames some checkpoints' keys at load), and ``converted`` the
    parameters that transformers makes from several checkpoint tensors as it loads (``Conversion``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sources: dict[str, str] = {}
        self.converted: dict[str, Conversion] = {}

    def source(self, name: str) -> str:
        return self.sources.get(name, name)


class Conversion:
    """The parameters one of transformers' weight converters makes from checkpoint tensors at load (e.g. a
    Mixture-of-experts layer's per-expert ``experts.N.w1.weight`` and ``w3`` stacked and joined into
    ``experts.gate_up_proj``): the converter, as ``get_model_conversion_mapping`` gives it, and the tensors it
    takes, in the order ``from_pretrained`` collects them. ``realize`` runs the converter's own operations, as
    ``from_pretrained`` does, on these tensors only."""

    def __init__(self, converter, first: str, model):
        self.converter, self.first, self.model = converter, first, model
        self.sources: list[tuple[str, str, str]] = []  # (checkpoint key, the converter's pattern it matched, file)
        # every parameter it makes: the first target pattern stands in the renamed key for each of the others
        self.targets = [first.replace(converter.target_patterns[0], t, 1) for t in converter.target_patterns]

    def __repr__(self) -> str:
        return f"{type(self.converter).__name__} of {len(self.sources)} tensors into {', '.join(self.targets)}"

    def realize(self, opened, dtypes: dict[str, "object"]) -> dict:
        """The parameters made, by name: each source tensor read (``opened(file)`` gives the open safetensors
        file) and cast to the dtype of the parameter it is for, as ``from_pretrained`` materializes it, then the
        converter's operations. ``dtypes``: target name -> dtype (None: as stored)."""
        import copy

        from transformers.core_model_loading import spawn_materialize

        mapping = copy.deepcopy(self.converter)
        dtype = dtypes.get(self.first)
        for key, pattern, file in self.sources:
            mapping.add_tensor(self.first, key, pattern,
                               spawn_materialize(None, opened(file).get_slice(key), "cpu", dtype))
        model = self.model
        out = mapping.convert(self.first, model=model, config=getattr(model, "config", None))
        made = {name: (t[0] if isinstance(t, list) else t) for name, t in out.items()}
        if set(made) != set(self.targets):
            raise DiffuseError(f"transformers' conversion of {self.sources[0][0]} made {sorted(made)}, "
                               f"not {self.targets}")
        return made

    def shapes(self, shape_of) -> dict[str, tuple]:
        """What ``realize`` would make, by name -> shape, from the source tensors' shapes alone (``shape_of(key,
        file)``): the same operations run on weightless (meta) tensors, so no tensor data is read."""
        import copy

        import torch

        mapping = copy.deepcopy(self.converter)
        for key, pattern, file in self.sources:
            meta = torch.empty(shape_of(key, file), device="meta")
            mapping.add_tensor(self.first, key, pattern, lambda meta=meta: meta)
        out = mapping.convert(self.first, model=self.model, config=getattr(self.model, "config", None))
        return {name: tuple((t[0] if isinstance(t, list) else t).shape) for name, t in out.items()}


def renamed_for(wmap: dict[str, str], model) -> WeightMap:
    """``wmap`` keyed by ``model``'s own parameter names, by the rules its library applies when it loads the
    checkpoint: transformers' own renamings (e.g. a vision-language model saved as ``model.layers.*`` that
    holds ``model.language_model.layers.*``) and its converters (e.g. a mixture-of-experts checkpoint's
    per-expert tensors, fused into one parameter per layer), both as ``get_model_conversion_mapping`` gives
    them for ``model``, never a table of Diffuse's own. A converted parameter is listed in ``converted``; it is
    made, as ``from_pretrained`` makes it, by ``load_into``."""
    out = WeightMap(wmap)
    out.sources.update(getattr(wmap, "sources", {}))
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key
    except ImportError:
        return out
    if not isinstance(model, PreTrainedModel):
        return _renamed_by_part(out, model, PreTrainedModel)
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta = model.state_dict()
    out = WeightMap()
    for key in sorted(wmap, key=dot_natural_key):  # the order from_pretrained collects tensors in
        file = wmap[key]
        name, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
        if name not in meta and key in meta:  # as from_pretrained: a key the model holds as it is stays so
            name, pattern = rename_source_key(key, [], [], model.base_model_prefix, meta)
        if pattern is not None:
            if name not in meta:
                continue  # made into nothing this model holds: from_pretrained drops it as unexpected
            conv = out.converted.get(name)
            if conv is None:
                conv = Conversion(by_pattern[pattern], name, model)
                for target in conv.targets:
                    out.converted[target] = conv
                    out[target] = file
            conv.sources.append((key, pattern, file))
            continue
        out[name] = file
        source = wmap.source(key) if isinstance(wmap, WeightMap) else key  # (a source named already is kept)
        if source != name:
            out.sources[name] = source
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        if target not in out and source in out:  # a tied head is stored once, under the embedding's name
            out[target] = out[source]
            out.sources[target] = out.source(source)
    return out


def _renamed_by_part(wmap: "WeightMap", model, library_model) -> "WeightMap":
    """``wmap`` of several components held as one module (``diffuse.plan.analysis.Denoisers``: a pipeline's
    denoiser and text encoders, each name led by its component's): each transformers component's names renamed
    by its own rules (``renamed_for``), the others' kept."""
    parts = [(name, child) for name, child in model.named_children() if isinstance(child, library_model)]
    if not parts:
        return wmap
    out = WeightMap({k: v for k, v in wmap.items() if not k.startswith(tuple(f"{n}." for n, _ in parts))})
    out.sources.update({k: v for k, v in wmap.sources.items() if k in out})
    for name, child in parts:
        head = f"{name}."
        own = WeightMap({k[len(head):]: v for k, v in wmap.items() if k.startswith(head)})
        own.sources.update({k[len(head):]: wmap.source(k) for k in wmap if k.startswith(head)})
        renamed = renamed_for(own, child)
        for k, v in renamed.items():
            out[head + k] = v
            out.sources[head + k] = renamed.source(k)
        out.converted.update({head + k: c for k, c in renamed.converted.items()})
    return out


def _shapes(wmap: dict[str, str], keys) -> dict[str, tuple]:
    """Shapes of checkpoint tensors, from the safetensors headers (no tensor data is read)."""
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for k in keys:
        by_file.setdefault(wmap[k], []).append(k)
    out = {}
    for fn, names in by_file.items():
        if fn.endswith(".gguf"):
            from diffuse.plan.ggufread import for_component

            g = for_component(fn)
            out.update({k: g.shape(wmap.source(k) if isinstance(wmap, WeightMap) else k) for k in names})
            continue
        with safe_open(fn, "pt") as f:
            for k in names:
                out[k] = tuple(f.get_slice(wmap.source(k) if isinstance(wmap, WeightMap) else k).get_shape())
    return out


def located(wmap: dict[str, str], model, stacks) -> WeightMap:
    """``wmap`` with each stack of ``model`` found where the checkpoint keeps it, if not where the model's
    class names it: among runs of numbered blocks (``<prefix>.<i>.<name>``), the one with as many blocks as
    the stack, each holding tensors of the block's shapes, in order. Inside a block the names must be the
    class's own, or the shapes must tell every tensor apart. Refused when none or several runs fit."""
    out = wmap if isinstance(wmap, WeightMap) else WeightMap(wmap)
    runs: dict[str, dict[int, dict[str, str]]] = {}
    for key in out:
        parts = key.split(".")
        for j in range(1, len(parts) - 1):  # every numbered segment: "a.3.b.0.c" is block 3 of a, block 0 of a.3.b
            if parts[j].isdigit():
                runs.setdefault(".".join(parts[:j]), {}).setdefault(int(parts[j]), {})[".".join(parts[j + 1:])] = key
    for path in stacks:
        blocks = model.get_submodule(path)
        wanted = [{n: tuple(t.shape) for n, t in b.state_dict().items()} for b in blocks]
        if all(f"{path}.{i}.{n}" in out for i, w in enumerate(wanted) for n in w):
            continue
        fits = []
        for prefix, run in runs.items():
            if sorted(run) != list(range(len(blocks))) or any(len(run[i]) != len(w) for i, w in enumerate(wanted)):
                continue
            shapes = _shapes(out, [k for blk in run.values() for k in blk.values()])
            match = {}
            for i, w in enumerate(wanted):
                have = {name: shapes[key] for name, key in run[i].items()}
                if have == w:
                    pairs = {n: run[i][n] for n in w}
                else:  # other names inside the block: only shapes that occur once can be matched
                    by_shape = {}
                    for name, shape in have.items():
                        by_shape.setdefault(shape, []).append(name)
                    if sorted(have.values()) != sorted(w.values()) or any(len(v) > 1 for v in by_shape.values()):
                        break
                    pairs = {n: run[i][by_shape[shape][0]] for n, shape in w.items()}
                match.update({f"{path}.{i}.{n}": key for n, key in pairs.items()})
            else:
                fits.append((prefix, match))
        if len(fits) != 1:
            why = "no run of numbered tensors" if not fits else f"{len(fits)} runs ({', '.join(p for p, _ in fits)})"
            raise DiffuseError(f"the checkpoint does not hold {path} under its own names, and {why} "
                               f"matches its {len(blocks)} blocks' shapes")
        for name, key in fits[0][1].items():
            out[name] = out[key]
            out.sources[name] = out.source(key)
    return out


def content_hash(component_dir: str) -> str:
    """A fingerprint of the component's config and weight layout (names, shapes, dtypes).

    It tells two different architectures or checkpoint layouts apart cheaply at
    every start; it does not read the weight data, so two fine-tunes of one
    model with identical layouts share it (nodes and client must be given the
    same folder).
    """
    h = hashlib.blake2b(digest_size=16)
    with open(os.path.join(component_dir, "config.json"), "rb") as f:
        h.update(f.read())
    for name in sorted(os.listdir(component_dir)):
        if name.endswith(".safetensors"):
            with open(os.path.join(component_dir, name), "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                h.update(name.encode() + f.read(n))
        elif name.endswith(".gguf"):  # a GGUF denoiser: its header (names, types, shapes, offsets)
            from diffuse.plan.ggufread import header_bytes

            h.update(name.encode() + header_bytes(os.path.join(component_dir, name)))
    return h.hexdigest()


def fp32_kept(model, dtype) -> frozenset:
    """The module names whose floating tensors a plain ``from_pretrained(..., torch_dtype=dtype)`` of ``model`` (a
    model or its class) keeps in float32 (a name matches a parameter when it is one of the parameter's dotted
    segments): a diffusers model's
    ``_keep_in_fp32_modules`` whenever a dtype is asked (Wan keeps its blocks' norms and modulation table so);
    a transformers model's ``_keep_in_fp32_modules`` under float16 and ``_keep_in_fp32_modules_strict`` under
    float16 or bfloat16. Empty when no dtype is asked or it is float32."""
    import torch

    if dtype is None or dtype == torch.float32:
        return frozenset()
    kept = set()
    cls = model if isinstance(model, type) else type(model)
    try:
        from transformers import PreTrainedModel
    except ImportError:
        PreTrainedModel = ()
    if PreTrainedModel and issubclass(cls, PreTrainedModel):
        if dtype == torch.float16:
            kept.update(getattr(model, "_keep_in_fp32_modules", None) or ())
        kept.update(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    elif not hasattr(cls, "_keep_in_fp32_modules") and isinstance(model, torch.nn.Module):
        # several components held as one (``diffuse.plan.analysis.Denoisers``): what each keeps (the names are
        # matched as segments anywhere, so they apply across components too; no two families' names collide)
        for child in model.children():
            kept.update(fp32_kept(child, dtype))
    else:
        kept.update(getattr(model, "_keep_in_fp32_modules", None) or ())
    return frozenset(kept)


def load_into(module, prefix: str, wmap: dict[str, str], dtype=None, skip=None, files: dict | None = None,
              device=None, keep: frozenset = frozenset()) -> int:
    """Assign ``module``'s tensors from the safetensors files, as ``from_pretrained`` reads them.

    Each tensor is taken where the loader puts it (no copy, no re-layout: that
    placement is part of bit-exactness) and floating tensors are cast to
    ``dtype`` or, if None, to the dtype the module was built with — the rule
    ``from_pretrained`` follows (a bf16 file loads as float32 by default); those
    of a module named in ``keep`` (``fp32_kept``) go to float32 instead.
    ``device`` (None: the CPU): the files are opened onto it, so each tensor is
    read straight into device memory and cast there, one at a time (no host copy
    of the whole module). Names for which ``skip(name)`` is true stay as they
    are (meta). Returns the number of tensors assigned.
    """
    import torch
    from safetensors import safe_open
    files = {} if files is None else files
    where = "cpu" if device is None else str(device)

    def opened(fn: str):
        if (fn, where) not in files:
            files[(fn, where)] = safe_open(fn, "pt", device=where)
        return files[(fn, where)]

    converted = wmap.converted if isinstance(wmap, WeightMap) else {}
    state, made = {}, {}
    params = module.state_dict(keep_vars=True)
    _hold_read(params, prefix, wmap, converted, skip)
    for name, current in params.items():
        if skip is not None and skip(name):
            continue
        full = prefix + name
        if full not in wmap:
            raise DiffuseError(f"the weights lack {full}, which {type(module).__name__} declares; "
                               "is the model folder complete?")
        target = _loaded_dtype(current, full, dtype, keep)
        if full in converted:  # made from several checkpoint tensors, by transformers' own converter
            conv = converted[full]
            if full not in made:
                made.update(conv.realize(lambda fn: _opened_on_cpu(fn, files), {t: target for t in conv.targets}))
            state[name] = made.pop(full) if device is None else made.pop(full).to(device)
            continue
        t = opened(wmap[full]).get_tensor(wmap.source(full) if isinstance(wmap, WeightMap) else full)
        if t.is_floating_point() and current.is_floating_point() and t.dtype != target:
            t = t.to(target)
        state[name] = t
    module.load_state_dict(state, strict=skip is None, assign=True)
    return len(state)


def _loaded_dtype(current, full: str, dtype, keep: frozenset):
    """The dtype ``load_into`` gives the tensor ``full`` (``current``: as the module was built)."""
    import torch

    if keep and current.is_floating_point() and any(k in full.split(".") for k in keep):
        return torch.float32
    return dtype if dtype is not None and current.is_floating_point() else current.dtype


def typed_unread(module, prefix: str, dtype=None, keep: frozenset = frozenset()) -> None:
    """``module``'s tensors, none read from the files, in the dtypes ``load_into`` would give them: weightless
    (meta) where they are, else cast. A stack's first block on the client is so: called weightless, or with its
    weights zero, it returns what it would return loaded (``analyzers/calls.py``), and no byte of it is read or
    fetched."""
    import torch

    state = {}
    for name, t in module.state_dict(keep_vars=True).items():
        target = _loaded_dtype(t, prefix + name, dtype, keep)
        state[name] = torch.empty(t.shape, dtype=target, device="meta") if t.is_meta else t.detach().to(target)
    module.load_state_dict(state, strict=True, assign=True)


def _hold_read(params, prefix: str, wmap, converted: dict, skip) -> None:
    """The tensors ``load_into`` is about to read fetched first where they sit in a partial file of a Hub model
    (``diffuse.plan.fetching.hold``): a node's slice comes by range as it loads it."""
    from diffuse.plan.fetching import hold

    needs: dict[str, list[str]] = {}
    for name in params:
        full = prefix + name
        if (skip is not None and skip(name)) or full not in wmap and full not in converted:
            continue
        if full in converted:
            for key, _, file in converted[full].sources:
                needs.setdefault(file, []).append(key)
        else:
            needs.setdefault(wmap[full], []).append(wmap.source(full) if isinstance(wmap, WeightMap) else full)
    hold(needs)


def _opened_on_cpu(fn: str, files: dict):
    from safetensors import safe_open

    if (fn, "cpu") not in files:
        files[(fn, "cpu")] = safe_open(fn, "pt", device="cpu")
    return files[(fn, "cpu")]
