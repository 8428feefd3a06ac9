"""Call-phase analyzers: the call recorder and the return-mapping learner.

Both look at the first call the denoiser makes into a stack. The recorder takes
the call apart into a call plan; the learner runs the stack's first block once
and finds, for each tensor it returns, the input it replaces, which tells a
node how to thread its loop of blocks.
"""

from __future__ import annotations

import torch

from diffuse.analysis import Analyzer
from diffuse.callplan import flatten, slot_names
from diffuse.errors import DiffuseError
from diffuse.hookspecs import hookimpl
from diffuse.measure import relative_error
from diffuse.plan import CallPlan, ReturnMap, TensorSpec


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
    description = "which input each returned tensor replaces (shape first, then nearness)"

    def analyze(self, call, draft):
        _, inputs = flatten(call.args, call.kwargs)
        with torch.no_grad():
            out = call.block(*call.args, **call.kwargs)
        single = isinstance(out, torch.Tensor)
        outs = [out] if single else list(out)
        names = draft["call_plan"].slot_names
        mapping, taken = [None] * len(outs), set()
        # closest pairs first, so two same-shaped streams each find their own input
        pairs = []
        for j, o in enumerate(outs):
            if o is None:
                continue
            if not isinstance(o, torch.Tensor):
                raise DiffuseError(f"block {call.stack.path}[0] returned a {type(o).__name__} at position {j}; "
                                   "only tensors (and None) can be threaded through a stack")
            cands = [i for i, t in enumerate(inputs) if t.shape == o.shape and t.dtype == o.dtype]
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
            if o is not None and mapping[j] is None:
                raise DiffuseError(f"block {call.stack.path}[0]: returned tensor {j} could not be matched to a distinct input")
        return {"return_map": ReturnMap(single=single, outputs=mapping,
                                        names=[names[i] if i is not None else None for i in mapping])}


@hookimpl
def diffuse_analyzers():
    return [CallRecorder(), ReturnMapper()]
