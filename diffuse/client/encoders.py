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
afresh; the last node answers with what
the stack's last layer returned, and the model goes on to its final norm, here.
"""

from __future__ import annotations

import time

from diffuse.errors import DiffuseError
from diffuse.lm.client_ends import shaped, threaded_sides
from diffuse.plan.calltree import flatten_layers
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
        if _recording_layers():
            raise DiffuseError(f"the pipeline reads the hidden state after each layer of {stack.path} (its prompt "
                               "embedding is an inner layer's output), which a pass through the ring does not give "
                               "back: run with --encoders client (encoders=\"client\")")
        block = splitter.first_block(stack.path)
        if block is not None:
            splitter.learned(stack, *learn_call(stack, *call, block, layered=True))
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
        try:
            rmap = threaded_sides(calls, self.splitter.plan.return_maps[stack.path])
            tree, layer_trees, tensors = flatten_layers(calls)
            part = LayerPass(type(cache).__name__ if cache is not None else None, cache is not None,
                             layer_trees or None)
            out = ring.receive(ring.send(stack.path, tree, tensors, rmap, extra=part))
            self.passes += 1
            return out
        finally:
            self.splitter.stand_in_s += time.perf_counter() - t0


def _recording_layers() -> bool:
    """Whether transformers is recording each layer's hidden state for the call being made (the model was asked
    for ``output_hidden_states``): its collector for the running forward holds a list of them."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # a transformers that records them otherwise: their absence shows later
        return False
    collected = _active_collector.get()
    return isinstance(collected, dict) and "hidden_states" in collected
