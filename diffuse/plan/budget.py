"""The client's budget (``--client-memory``): where a pipeline's encoders go so that the client's part fits it.

What the client holds is counted as ``diffuse plan`` counts it (``diffuse.plan.parts``): the weights of every
part it keeps, in the compute dtype, read from the safetensors headers (activations, the libraries' own memory
and a transformers model's first layer, held until its stack's first call, come on top). With the encoders on
the client first: where that fits the budget they stay there; else they go to the ring (``--encoders ring``),
where that fits. A budget that neither meets is refused before anything loads, naming what the smallest client
needs. ``--encoders`` given forces the place, and the budget is then only checked. A VAE on a node
(``--decoder``, ``diffuse.plan.decoders``) is no part of the client's weights; the budget never puts it there (that
node sees the result: only the user names it).
"""

from __future__ import annotations

import re

from diffuse.errors import DiffuseError

_UNITS = {"": 1 << 30, "g": 1 << 30, "gib": 1 << 30, "gb": 10 ** 9, "m": 1 << 20, "mib": 1 << 20, "mb": 10 ** 6,
          "k": 1 << 10, "kib": 1 << 10, "kb": 10 ** 3, "b": 1}


def parse_size(text: str) -> int:
    """``2GiB``, ``1.5g``, ``800MB``, ``512MiB`` or a plain number of GiB, in bytes.

    >>> parse_size("2GiB"), parse_size("512MiB"), parse_size("1.5")
    (2147483648, 536870912, 1610612736)
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m[2].lower() if m else ""
    if not m or unit not in _UNITS or not float(m[1]) > 0:
        raise DiffuseError(f"--client-memory {text!r}: give a size such as 2GiB, 1.5GB or 512MiB (a plain number: GiB)")
    return int(float(m[1]) * _UNITS[unit])


def client_weights(subject, draft: dict, dtype: str) -> int:
    """The bytes of weights the client holds of the model (``diffuse.plan.parts``) in ``dtype``."""
    from diffuse.plan.needs import _dtype_size, block_costs
    from diffuse.plan.parts import pipeline_parts

    blocks = block_costs(subject, draft["stacks"], dtype)
    return sum(p.client_bytes for p in pipeline_parts(subject, draft["stacks"], blocks, _dtype_size(dtype)))


def fit_encoders(path: str, budget: int, forced: bool | None, dtype: str | None,
                 decoders: bool = False) -> tuple[bool, int]:
    """(whether the encoders go to the ring, what the client then holds) for the pipeline at ``path`` under
    ``budget`` bytes (``forced``: ``--encoders`` as given, None where not; ``dtype``: the client's, None: what a
    plain load gives; ``decoders``: its VAE on a node, not counted); refused where no place of the encoders fits."""
    from diffuse.plan.needs import load_dtype
    from diffuse.plan.planner import analyze

    held, has_encoders = {}, True

    def holds(ring: bool) -> int:
        nonlocal has_encoders
        if ring not in held:
            subject, draft = analyze(path, ring, decoders)
            has_encoders = has_encoders and bool(subject.encoders or not ring)
            held[ring] = client_weights(subject, draft, dtype or load_dtype(subject))
        return held[ring]

    for ring in ((forced,) if forced is not None else (False, True)):
        if holds(ring) <= budget:
            return ring, held[ring]
    holds(True)  # what the smallest client holds, for the refusal
    options = {r: n for r, n in held.items() if has_encoders or not r}
    how = {False: "--encoders client", True: "--encoders ring"} if has_encoders else {False: "all it keeps"}
    said = "; ".join(f"{how[r]}: {_gib(n)}" for r, n in sorted(options.items()))
    least = min(options, key=options.get)
    hint = f" (with {how[least]})" if has_encoders and forced is not None and least != forced else ""
    raise DiffuseError(f"--client-memory {_gib(budget)}: this model's client holds more weights than that ({said}); "
                       f"the smallest client needs {_gib(options[least])}{hint}: give a larger --client-memory")


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 27 else f"{n / (1 << 20):.2f} MiB"
