"""A language model's pass on a node: its layers with the session's cache, the embedding, the tail and sampling.

The session keeps each stack's key/value cache for the layers held here
(``diffuse.lm.node_cache.NodeCaches``); layers whose call differs from the first
layer's get their own call plan. A pass whose first layer's input slot carries
token ids (``Embed``) is embedded by the node holding the first layer, with the
table it loads on first use (``diffuse.lm.embedding``). On the last node the
``Tail`` runs the final norm and the output head on the rows decoding needs and
answers the best candidates or whole rows; with a ``DrawState`` it also applies
``generate``'s processors and draws there (``diffuse.lm.sampling``).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from diffuse.errors import DiffuseError
from diffuse.wire.passes import Embed, LayerPass, Tail
from diffuse.plan.contracts import ReturnMap
from diffuse.wire.kinds import PassKind, kind, run_blocks


def embed_spec(wire, rmap: ReturnMap, slots: int) -> tuple[int, torch.dtype]:
    """(slot, dtype) of a pass whose first layer's input is token ids, checked: a stream slot, a float dtype."""
    embed = wire if isinstance(wire, Embed) else Embed.from_wire(wire, slots)
    if embed.slot not in rmap.streams:
        raise DiffuseError("embed names a slot that does not carry the stack's hidden state")
    return embed.slot, embed.torch_dtype


@kind(LayerPass)
class LanguageModelPass(PassKind):
    def check(self, sess, message, rmap) -> None:
        if message.part.embed is not None:
            embed_spec(message.part.embed, rmap, len(message.slots))

    def prepare(self, sess, p) -> None:
        part: LayerPass = p.part
        if part.embed is not None and p.sl.start == 0:  # token ids in the first layer's input slot: embedded here
            p.values[part.embed.slot] = embedded(sess.store, p.values[part.embed.slot], part.embed.torch_dtype)
            p.part = replace(part, embed=None)
        p.layer_trees = part.trees
        p.cache = sess.kv.get(p.stack, part.kind, part.fresh) if part.kind is not None else None
        if p.cache is not None and (part.record or part.crops):
            sess.kv.edit(p.cache, part.record, part.crops)  # drafts verified: cut back as the client's was
        stream = p.values[p.rmap.streams[0]] if p.rmap.streams else None
        if p.cache is not None and isinstance(stream, torch.Tensor) and stream.dim() >= 2:
            sess.kv.check_room(p.cache, stream.shape[1])  # before the layers write anything into it

    def run(self, sess, p):
        keep = set(p.part.keep)
        if not keep.intersection(i for i, _ in p.blocks):
            return run_blocks(p.blocks, p.tree, p.values, p.rmap, p.layer_trees, p.cache)
        out = None
        for i, block in p.blocks:  # one at a time, keeping the hidden state of each layer asked for
            out = run_blocks([(i, block)], p.tree, p.values, p.rmap, p.layer_trees, p.cache)
            if i in keep:
                p.kept.append(_stream(p, out))
        return out

    def answer(self, sess, p, out) -> tuple:
        tail = p.part.tail
        if p.part.keep:  # what the stack's last layer returned, and every kept layer's hidden state
            if tail is not None:
                raise DiffuseError("a pass that brings inner layers back runs no tail")
            if len(p.kept) != len(p.part.keep):
                raise DiffuseError(f"the pass asked for {len(p.part.keep)} inner layers' outputs and brought "
                                   f"{len(p.kept)}: a layer it names is not in the stack")
            return [out, p.kept], None
        if tail is None:
            return out, None
        if p.tail_answer is not None:  # run with the other passes of its batch (joint_tails)
            return p.tail_answer, None
        # the head runs on the stream, where a layer returns a tuple (Falcon's hidden states and weights)
        return run_tail(sess, _stream(p, out), tail), None


def embedded(store, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The first hidden states of a pass: its token ids looked up in this node's copy of the table."""
    table = store.embedding(dtype)
    ids = checked_ids(ids, table.weight.shape[0])
    with torch.no_grad():
        return table(ids)


def _stream(p, out):
    """The hidden state the head reads from a pass's output (``LanguageModelPass.answer``)."""
    return out if p.rmap.single else out[p.rmap.output_of(p.rmap.hidden_streams[0])]


def joint_tails(passes: list[tuple], outs: list) -> None:
    """The tails of a batch's passes (``diffuse.lm.node_batching``) that read one row each with the same final norm, head
    and number of candidates, run together: each pass's norm alone, the head over all their rows in one product
    (``diffuse.lm.node_tail.JointHead``), each row's candidates and their bits as its tail alone gives them. Sets
    ``tail_answer`` on each pass so answered; the others' tails run alone, as before. ``passes``: (session, pass)
    pairs; ``outs``: each pass's last layer's output."""
    from diffuse.lm.node_tail import joint_head

    groups: dict = {}
    for (sess, p), out in zip(passes, outs):
        tail = p.part.tail if p.sl.stop == sess.store.stacks[p.stack].length else None  # the stack's last node
        hidden = _stream(p, out) if tail is not None else None
        if tail is None or tail.draw is not None or tail.top <= 0 or not isinstance(hidden, torch.Tensor) \
                or hidden.dim() != 3 or hidden.shape[0] != 1 or tail.rows[1] - tail.rows[0] != 1 \
                or not 0 <= tail.rows[0] < hidden.shape[1]:
            continue
        key = (tail.norm, sess.tail_dtype, tail.top, id(sess.store))
        groups.setdefault(key, (sess.store, []))[1].append((p, hidden))
    for (norm_path, dtype, top, _), (store, members) in groups.items():
        if len(members) < 2:
            continue
        norm, head = store.tail(norm_path, dtype)
        joint = joint_head(head)
        if joint is None or not 0 < top < head.weight.shape[0]:
            continue
        with torch.no_grad():
            rows = []
            for p, hidden in members:
                h = norm(hidden) if norm is not None else hidden
                start = p.part.tail.rows[0]
                rows.append(h[:, start:start + 1])
            if not joint.agrees(head, rows[0]):
                continue
            for (p, _), found in zip(members, joint.top(rows, top)):
                if found is not None:
                    p.tail_answer = {"ids": found[0], "values": found[1]}


def run_tail(sess, hidden: torch.Tensor, tail: Tail) -> dict:
    """Final norm, the rows decoding needs, output head; the best candidates or the whole rows; with a
    ``draw``, also the token generate's processors and sampling pick from the whole last row. A list of heads
    runs whole, laid out as generate reads it (``diffuse.lm.node_tail.stack_heads``), its ids as int32."""
    from diffuse.lm.node_tail import stack_heads, top_candidates

    norm, head = sess.store.tail(tail.norm, sess.tail_dtype)
    start, stop = tail.rows
    if not 0 <= start < stop <= hidden.shape[1]:
        raise DiffuseError("tail rows out of range")
    listed = isinstance(head, torch.nn.ModuleList)
    with torch.no_grad():
        h = norm(hidden) if norm is not None else hidden
        logits = stack_heads(head, h[:, start:stop]) if listed else head(h[:, start:stop])
    if 0 < tail.top < logits.shape[-1]:
        ids, values = top_candidates(logits, tail.top)
        if listed and logits.shape[-1] <= torch.iinfo(torch.int32).max:
            ids = ids.to(torch.int32)
        answer = {"ids": ids, "values": values}
    else:
        answer = {"logits": logits}
    if tail.draw is not None:  # generate's processors and its draw, here (diffuse.lm.sampling)
        from diffuse.lm.node_sampling import NodeSampler

        sampler = getattr(sess, "sampler", None)
        if sampler is None:
            sampler = sess.sampler = NodeSampler()
        with torch.no_grad():
            answer.update(sampler.draw(tail.draw, logits[:, -1]))
        if listed:
            answer["drawn"] = answer["drawn"].to(torch.int32)
    return answer


def checked_ids(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Token ids from a peer, checked before the lookup: integers, (batch, positions), inside the table."""
    if ids.dtype not in (torch.int64, torch.int32) or ids.dim() != 2:
        raise DiffuseError(f"the token ids of a pass must be a 2-D integer tensor, not {str(ids.dtype)[6:]} "
                           f"of {ids.dim()} dimensions")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise DiffuseError(f"a token id of this pass is outside the embedding table's {vocab} rows")
    return ids
