"""Every part of a pipeline, its size, and where it runs: the client, or the nodes (``diffuse plan``).

A part is a component of ``model_index.json`` (a denoiser, a text encoder, the
VAE, a tokenizer, the scheduler). Its size is read from its safetensors headers
alone, each floating tensor counted in the compute dtype (what a plain load in
that dtype holds); the bytes of the block stacks the plan gives to nodes are
taken from the blocks' own costs (``diffuse.plan.needs.block_costs``), so the
two columns add up to what the part weighs. A language model is one part, its
decoder layers on the nodes and its ends on the client.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from diffuse.errors import DiffuseError


@dataclass(frozen=True)
class Part:
    name: str  # the component ("" for a transformers model: the model itself)
    kind: str  # its class, as model_index.json names it
    client_bytes: int  # what the client holds of it
    node_bytes: int  # what the nodes hold of it, all slices together
    stacks: tuple[str, ...] = ()  # its stacks the nodes hold

    @property
    def where(self) -> str:
        if not self.node_bytes and not self.stacks:
            return "client"
        return "nodes" if not self.client_bytes else "client + nodes"


def component_bytes(folder: str, dtype_size: int) -> int:
    """The bytes a component's safetensors tensors take, floating ones at ``dtype_size`` bytes an element (0 for
    a part without weights: a tokenizer, a scheduler)."""
    from diffuse.plan.modelfiles import weight_map
    from diffuse.plan.needs import _SIZES, _header

    try:
        files = set(weight_map(folder).values())
    except DiffuseError:
        return 0
    total = 0
    for file in files:
        for name, h in _header(file).items():
            if name == "__metadata__" or not isinstance(h, dict):
                continue
            if "nbytes" in h and h.get("dtype") not in ("F32", "F16"):  # a GGUF file's quantized tensor, as stored
                total += int(h["nbytes"])
                continue
            count = 1
            for d in h.get("shape", ()):
                count *= d
            floating = str(h.get("dtype", "")).startswith(("F", "BF"))
            total += count * (dtype_size if floating else _SIZES.get(h.get("dtype"), 4))
    return total


def pipeline_parts(subject, stacks, blocks, dtype_size: int) -> list[Part]:
    """Each part of the subject's model (``blocks``: the plan's ``BlockCost`` for ``stacks``), in model_index.json's
    order: what the client holds of it and what the nodes hold."""
    on_nodes: dict[str, int] = {}
    for b in blocks:
        on_nodes[b.stack] = on_nodes.get(b.stack, 0) + b.weight_bytes + b.end_bytes
    if subject.autoregressive:
        total = component_bytes(subject.path, dtype_size)
        ring = sum(on_nodes.values())
        return [Part("", subject.denoiser_class_name, max(0, total - ring), ring, tuple(s.path for s in stacks))]
    parts = []
    for name, entry in subject.model_index.items():
        if name.startswith("_") or not isinstance(entry, list) or len(entry) != 2 or not entry[1]:
            continue
        mine = [s.path for s in stacks if _component_of(s.path, subject) == name]
        ring = sum(on_nodes.get(p, 0) for p in mine)
        total = component_bytes(os.path.join(subject.path, name), dtype_size)
        if name in getattr(subject, "decoders", ()):  # a VAE on a node (diffuse.plan.decoders): all of it there
            ring = total
        parts.append(Part(name, str(entry[1]), max(0, total - ring), ring, tuple(mine)))
    return parts


def _component_of(path: str, subject) -> str:
    """The component a stack's path belongs to: named first where several hold stacks, else the denoiser."""
    return path.split(".", 1)[0] if subject.several else subject.denoiser


def parts_lines(parts: list[Part], dtype: str) -> list[str]:
    """The parts as a table, with what the client holds in all."""
    from diffuse.plan.needs import GIB

    def size(n: int) -> str:
        return f"{n / GIB:.2f} GiB" if n >= GIB // 10 else f"{n / (1 << 20):.2f} MiB"

    lines = [f"parts of the pipeline (weights in {dtype}) and where they run:"]
    width = max([len(p.name) for p in parts] + [4])
    kinds = max([len(p.kind) for p in parts] + [4])
    for p in parts:
        what = f"client {size(p.client_bytes)}" if p.client_bytes else "" if p.node_bytes else "(no weights)"
        if p.node_bytes:
            what += ("; " if what else "") + f"nodes {size(p.node_bytes)} ({', '.join(p.stacks)})"
        lines.append(f"  {p.name or '(model)':<{width}}  {p.kind:<{kinds}}  {p.where:<14}  {what}")
    lines.append(f"  the client holds {size(sum(p.client_bytes for p in parts))} of weights; the nodes "
                 f"{size(sum(p.node_bytes for p in parts))} between them")
    return lines
