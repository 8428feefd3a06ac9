"""Call-phase analyzers: the call recorder and the return-mapping learner.

Both look at the first call the denoiser makes into a stack. The recorder takes
the call apart into a call plan; the learner finds, for each tensor the stack's first block
returns, the input it replaces, which tells a node how to thread its loop of
blocks: from shapes alone where they decide it (the block run on the meta
device), else by running the block once on the call's values with every
weight zero and choosing by nearness.

The block's weights are never read, so the client need not hold them (nor fetch
them from the Hub): with its weights and biases zero, each learned transform of
a block gives zero, and what is left of the block is its skip connections, which
hand each stream on exactly (a residual block returns ``x + f(x)``; AdaLN-Zero
gates are zero too). Each returned tensor is then equal to the input it
replaces, where real weights would only make it near it. What a block returns
(how many tensors, their shapes and dtypes) does not depend on its weights'
values; the block is called as the model calls it (its hooks, its buffers).
"""

from __future__ import annotations

import torch

from diffuse.plan.analysis import Analyzer
from diffuse.plan.bnbread import plain_linears
from diffuse.plan.calltree import flatten, slot_names
from diffuse.errors import DiffuseError
from diffuse.plan.kvcache import is_cache
from diffuse.plan.hookspecs import hookimpl
from diffuse.measure import relative_error
from diffuse.plan.contracts import CallPlan, ReturnMap, TensorSpec


class CallRecorder(Analyzer):
    name = "call_recorder"
    phase = "call"
    provides = ("call_plan",)
    description = "positions, names, tensors (nested tuples too) and constants of a stack's first call"

    def analyze(self, call, draft):
        tree, tensors = flatten(call.args, call.kwargs)
        return {"call_plan": CallPlan(
            tree=tree, slot_names=slot_names(tree),
            tensors=[TensorSpec(str(t.dtype).removeprefix("torch."), list(t.shape)) for t in tensors])}


class ReturnMapper(Analyzer):
    name = "return_mapper"
    phase = "call"
    needs = ("call_plan",)
    provides = ("return_map",)
    description = "which input each returned tensor replaces (shape first, then nearness with zero weights)"

    def analyze(self, call, draft):
        _, inputs = flatten(call.args, call.kwargs)
        # a layer called with a key/value cache: a returned tensor that replaces no input, after the hidden state,
        # is a side output the model may ignore (the stand-in checks that it is never handed to the next layer)
        layered = call.layered or any(is_cache(v) for v in (*call.args, *call.kwargs.values()))
        names = draft["call_plan"].slot_names
        decided = None if layered else _decided_by_shapes(call, inputs, names)
        if decided is not None:  # the block's weights were never read
            return {"return_map": decided}
        out = _zero_weight_outputs(call, inputs)
        single = isinstance(out, torch.Tensor)
        outs = [out] if single else list(out)
        mapping, taken = [None] * len(outs), set()
        # closest pairs first, so two same-shaped streams each find their own input
        pairs = []
        for j, o in enumerate(outs):
            if o is None:
                continue
            if not isinstance(o, torch.Tensor):
                raise DiffuseError(f"block {call.stack.path}[0] returned a {type(o).__name__} at position {j}; "
                                   "only tensors (and None) can be threaded through a stack")
            cands = _alike(o, inputs)
            if not cands and layered and j:
                continue  # a language model layer's side output (BLOOM's attention weights): threaded nowhere
            if not cands:
                raise DiffuseError(
                    f"block {call.stack.path}[0] returns a tensor of shape {tuple(o.shape)} at position {j} "
                    f"that matches no input (inputs: {[(n, tuple(t.shape)) for n, t in zip(names, inputs)]})")
            for i in cands:
                pairs.append((relative_error(o, inputs[i]), j, i))
        for _, j, i in sorted(pairs):
            if mapping[j] is None and i not in taken:
                mapping[j] = i
                taken.add(i)
        for j, o in enumerate(outs):
            if o is not None and mapping[j] is None and not (layered and j and not _alike(o, inputs)):
                raise DiffuseError(f"block {call.stack.path}[0]: returned tensor {j} could not be matched to a distinct input")
        return {"return_map": ReturnMap(single=single, outputs=mapping,
                                        names=[names[i] if i is not None else None if o is None else "side output"
                                               for i, o in zip(mapping, outs)])}


def _alike(o: torch.Tensor, inputs: list) -> list[int]:
    """The inputs a returned tensor can replace: those of its shape and dtype."""
    return [i for i, t in enumerate(inputs) if t.shape == o.shape and t.dtype == o.dtype]


def _zero_weight_outputs(call, inputs: list):
    """What the block returns on the call's values with every parameter zero (plain tensors of its parameters'
    shapes and dtypes; a buffer held only weightless too), its own weights never read: see the module's
    docstring. On the device of the block's weights where they are held, else of the call's first tensor."""
    from torch.func import functional_call

    block = call.block
    fallback = next((t.device for t in inputs), torch.device("cpu"))

    def zeros(t):
        return torch.zeros(t.shape, dtype=t.dtype, device=fallback if t.is_meta else t.device)

    with plain_linears(block), torch.no_grad():  # (bitsandbytes' layers: plain ones of their shapes)
        state = {n: zeros(p) for n, p in block.named_parameters(remove_duplicate=False)}
        state.update({n: zeros(b) for n, b in block.named_buffers(remove_duplicate=False) if b.is_meta})
        return functional_call(block, state, tuple(call.args), dict(call.kwargs), tie_weights=False)


def _weightless_outputs(call):
    """What the block returns, run on the meta device (shapes and dtypes, no values; its weights and the inputs'
    values never read), or None where it cannot run so (an operation that needs values)."""
    from torch.func import functional_call
    from torch.utils._pytree import tree_map

    block = call.block
    meta = tree_map(lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v, (tuple(call.args), dict(call.kwargs)))
    try:
        with plain_linears(block), torch.no_grad():
            state = {n: torch.empty_like(t, device="meta") for n, t in
                     [*block.named_parameters(remove_duplicate=False), *block.named_buffers(remove_duplicate=False)]}
            return functional_call(block, state, meta[0], meta[1], tie_weights=False)
    except Exception:
        return None


def _decided_by_shapes(call, inputs: list, names: list) -> ReturnMap | None:
    """The return map where shapes alone decide it: each returned tensor (run weightless) has exactly one input
    of its shape and dtype, and no two share one. Else None, and the learner runs the block on the call's values
    (its weights zero) to choose by nearness."""
    out = _weightless_outputs(call)
    if out is None:
        return None
    single = isinstance(out, torch.Tensor)
    if not single and not isinstance(out, (tuple, list)):
        return None
    outs = [out] if single else list(out)
    mapping = []
    for o in outs:
        if o is None:
            mapping.append(None)
            continue
        if not isinstance(o, torch.Tensor):
            return None
        cands = _alike(o, inputs)
        if len(cands) != 1:
            return None
        mapping.append(cands[0])
    taken = [i for i in mapping if i is not None]
    if len(set(taken)) != len(taken):
        return None
    return ReturnMap(single=single, outputs=mapping, names=[names[i] if i is not None else None for i in mapping])


@hookimpl
def diffuse_analyzers():
    return [CallRecorder(), ReturnMapper()]
