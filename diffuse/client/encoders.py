"""A pipeline's encoder stacks called through the ring (``--encoders ring``, ``diffuse.plan.encoders``).

An encoder runs once per request, and the model's code may hand its layers
more than the hidden state: T5 gives the position biases block 0 computed to
every later block, Gemma 2 gives each layer the mask of its own attention kind.
So an encoder's stand-in collects every layer's call, as a language model's
does (``diffuse.client.proxies.StandIn``), answering each layer but the last
with its input untouched (side outputs as empty placeholders the model may
only hand on), and sends them in one pass with each layer's own call plan where
it differs and the side outputs threaded from the node that makes them to the
layers that read them (``diffuse.lm.client_ends.threaded_sides``). The pass
carries no cache (``LayerPass`` with no kind), or, where the model made one for
the call (a language model read as an encoder), asks the nodes to make theirs
afresh; the last node answers with what the stack's last layer returned, and
the model goes on to its final norm, here.

A model asked for every layer's hidden state (``output_hidden_states``) records
them with hooks on its layers, which stand-ins do not carry: the pass then asks
the nodes for each inner layer's hidden state too (``LayerPass.keep``, wire
version 4; only those transformers was told to keep, where it was told), and
what it brings back is recorded here as those hooks would have recorded it. So
pipelines that read an inner layer (SD3's CLIP encoders, HunyuanVideo's Llama,
Lumina's and CogView's) are exact as well as those that read the last.
"""

from __future__ import annotations

import contextlib
import copy
import time

from diffuse.errors import DiffuseError
from diffuse.lm.client_ends import shaped, threaded_sides
from diffuse.plan.calltree import flatten_layers
from diffuse.plan.contracts import KEEPS_LAYERS
from diffuse.plan.kvcache import is_cache
from diffuse.plan.planner import learn_call
from diffuse.wire.passes import LayerPass


class EncoderPasses:
    """The passes of the encoder stacks (``paths``) of a pipeline split by ``splitter``
    (``diffuse.client.standin.Splitter``)."""

    def __init__(self, splitter, paths):
        self.splitter = splitter
        self.paths = frozenset(paths)
        self.passes = 0  # encoder passes sent through the ring

    def answer(self, stack, hidden, call: tuple):
        """What every layer but the last answers: ``hidden``, untouched, in the structure the first layer returns
        (the first call teaches it: the stack's first block runs here once, as for any stack)."""
        splitter = self.splitter
        block = splitter.first_block(stack.path)
        if block is not None:  # run aside: on a copy of the model's cache, recorded by none of its hooks
            args, kwargs = call
            aside = {id(v): copy.deepcopy(v) for v in (*args, *kwargs.values()) if is_cache(v)}
            with _unrecorded():
                splitter.learned(stack, *learn_call(stack, tuple(aside.get(id(a), a) for a in args),
                                                    {k: aside.get(id(v), v) for k, v in kwargs.items()}, block,
                                                    layered=True))
        rmap = splitter.plan.return_maps[stack.path]
        if len(rmap.hidden_streams) != 1:
            raise DiffuseError(f"{stack.path}[0] returns {len(rmap.hidden_streams)} hidden states; an encoder's stack "
                               "is split where its layers carry one")
        return shaped(rmap, hidden)

    def run(self, stack, calls: list[tuple[tuple, dict]], cache=None):
        """Every layer's call in one pass through the ring; what the stack's last layer returned. ``cache``: the
        key/value cache the model made for this one call (a language model read as an encoder makes one, then
        drops it): the nodes make theirs afresh for the pass, as empty as this one."""
        ring = self.splitter.ring
        ring = getattr(ring, "rings", (ring,))[0]  # with groups of nodes (each holds every stack): the first's
        if ring is None:
            raise DiffuseError("this pipeline's encoder layers are held by nodes: call it inside "
                               "`with diffuse.split(...)`")
        t0 = time.perf_counter()
        keep = inner_layers_kept(len(calls))
        if keep and getattr(ring, "old_nodes", None) and ring.old_nodes(KEEPS_LAYERS):
            raise DiffuseError(f"the pipeline reads {stack.path}'s inner layers, which node "
                               f"{', '.join(ring.old_nodes(KEEPS_LAYERS))[:300]} cannot send back (it speaks a wire "
                               f"version older than {KEEPS_LAYERS}): update it, or run with --encoders client")
        try:
            rmap = threaded_sides(calls, self.splitter.plan.return_maps[stack.path])
            tree, layer_trees, tensors = flatten_layers(calls)
            part = LayerPass(type(cache).__name__ if cache is not None else None, cache is not None,
                             layer_trees or None, keep=keep)
            out = ring.receive(ring.send(stack.path, tree, tensors, rmap, extra=part))
            self.passes += 1
        finally:
            self.splitter.stand_in_s += time.perf_counter() - t0
        inner = {}
        if keep:
            out, states = out
            if len(states) != len(keep):
                raise DiffuseError(f"the nodes brought {len(states)} of the {len(keep)} inner layers of "
                                   f"{stack.path} asked for")
            inner = dict(zip(keep, states))
        record(len(calls), calls[0], out, rmap, inner)
        return out


def inner_layers_kept(layers: int) -> tuple[int, ...]:
    """The inner layers (all but the last of ``layers``) whose hidden states the running forward records, when
    transformers records them (``output_hidden_states``): every one, or those it was told to keep; else none."""
    collected = _recording()
    if collected is None:
        return ()
    kept, chosen = collected["hidden_states"], collected.get("_hidden_states_layers")
    first = len(kept) + (0 if kept else 1)  # where layer 0's output will stand (after the stack's input)
    return tuple(i for i in range(layers - 1) if chosen is None or first + i in chosen)


def record(layers: int, first: tuple, out, rmap, inner: dict) -> None:
    """Where transformers is recording each layer's hidden state for the running forward (``output_hidden_states``):
    this stack's, as its layers' hooks would have recorded them (the first layer's input, when the model records
    it, then each layer's output: the last the pass brought back, the inner ones brought back beside it, ``inner``
    by layer index)."""
    collected = _recording()
    if collected is None:
        return
    last = out if rmap.single else out[rmap.output_of(rmap.hidden_streams[0])]
    kept, chosen = collected["hidden_states"], collected.get("_hidden_states_layers")
    args, kwargs = first
    # as transformers' recorder does by default: the first layer's input first (its index 0 is the hidden state)
    states = [args[0] if args else kwargs.get("hidden_states")] if not kept else []
    states += [inner.get(i) for i in range(layers - 1)] + [last]
    for state in states:
        kept.append(state if chosen is None or len(kept) in chosen else None)


@contextlib.contextmanager
def _unrecorded():
    """While the stack's first block runs here to learn what it returns, which is no part of the model's forward:
    transformers records nothing of it (a hook its recorder put on that block earlier, as a weightless dry call
    of the pipeline does, would add its output to the running forward's hidden states)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        yield
        return
    token = _active_collector.set(None)
    try:
        yield
    finally:
        _active_collector.reset(token)


def _recording() -> dict | None:
    """Transformers' collector of the running forward, when it records hidden states; else None."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # a transformers that records them otherwise: they stay as it records them
        return None
    collected = _active_collector.get()
    return collected if isinstance(collected, dict) and "hidden_states" in collected else None
