"""A GGUF file in a model's original layout, seen under the model's own (diffusers') names.

Published GGUF files mostly keep the names (and fused tensors) of the model's original checkpoints: Wan's
``blocks.N.self_attn.q``, Black Forest Labs' ``double_blocks.N.img_attn.qkv``. diffusers converts them as it
loads them (``from_single_file`` runs a conversion function per model class); ``Converted`` runs that same
function, never a table of Diffuse's own, three ways, so that a process still reads only its own tensors:

- on weightless (meta) tensors of the file's shapes: what each model tensor is (shape, quantized type), no byte
  read;
- on small index tensors, one row per row of each file tensor: which file tensors each model tensor is made
  of (the conversions select, split and join rows; where one does anything else, this is given up and every
  file tensor counts as a source);
- on the tensors asked for: their sources as views of the mapped file, every other tensor weightless, so the
  conversion's own operations (a split, a concatenation) run on exactly the bytes diffusers runs them on, and
  only on those.
"""

from __future__ import annotations

import os

from diffuse.errors import DiffuseError


class Converted:
    """``gfile`` (a ``diffuse.plan.ggufread.GGUFFile``) under ``model``'s names, by diffusers' conversion."""

    def __init__(self, gfile, model):
        from diffusers.loaders.single_file_model import (SINGLE_FILE_LOADABLE_CLASSES,
                                                         _get_single_file_loadable_mapping_class)

        self.gfile = gfile
        self.kind = _get_single_file_loadable_mapping_class(type(model))
        if self.kind is None:
            raise DiffuseError(f"{os.path.basename(gfile.path)} does not name its tensors as {type(model).__name__} "
                               "does, and diffusers has no conversion from another layout for that class")
        self.convert = SINGLE_FILE_LOADABLE_CLASSES[self.kind]["checkpoint_mapping_fn"]
        self.config = dict(getattr(model, "config", None) or {})
        self.meta = self._run(set())  # model name -> weightless tensor: its shape and type
        self.sources = self._sources()  # model name -> the file tensors it is made of (None: not known)

    def _run(self, real: set) -> dict:
        """The conversion on the file's tensors: those in ``real`` as views of the file, the rest weightless."""
        g = self.gfile
        checkpoint = {n: g.view(n) if n in real else g.weightless(n) for n in g.tensors}
        try:
            return dict(self.convert(checkpoint=checkpoint, config=self.config))
        except Exception as exc:  # the library's own conversion fails on this file: one line
            raise DiffuseError(f"{os.path.basename(g.path)}: diffusers' conversion for {self.kind} from its "
                               f"original layout fails on this file ({type(exc).__name__}: {str(exc)[:120]})") from None

    def _sources(self) -> dict | None:
        import torch

        names = list(self.gfile.tensors)
        ids = {n: torch.arange(self.gfile.rows(n), dtype=torch.int64).add_(k << 32).unsqueeze(1)
               for k, n in enumerate(names)}
        try:
            out = self.convert(checkpoint=ids, config=self.config)
        except Exception:  # noqa: BLE001 - the conversion does more than select rows: every tensor counts
            return None
        found = {}
        for name, t in out.items():
            meta = self.meta.get(name)
            if (not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 2 or meta is None
                    or meta.dim() == 0 or t.shape[0] != meta.shape[0]):
                return None
            which = (t[:, 0] >> 32).unique().tolist()
            if any(not 0 <= i < len(names) for i in which):
                return None
            found[name] = {names[i] for i in which}
        return found

    def read(self, names: list[str]) -> dict:
        """The model tensors ``names``, made by the conversion from views of their sources only, each copied out
        of the file as diffusers' loader copies a tensor."""
        import torch

        if self.sources is not None:
            real = set().union(*(self.sources.get(n, ()) for n in names))
        else:
            real = set(self.gfile.tensors)
        made = self._run(real)
        out = {}
        for name in names:
            t = made[name]
            quant = getattr(t, "quant_type", None)
            data = torch.from_numpy((t.as_tensor() if quant is not None else t).detach().numpy().copy())
            out[name] = data if quant is None else type(t)(data, quant_type=quant)
        return out
