"""A language model's input embedding on a split client, when the first node holds its table.

Inside the split model's forward the embedding's stand-in (``diffuse.lm.client_embedding.EmbedStandIn``) answers a
placeholder; the first decoder layer must get that placeholder unchanged, and the pass then carries the token
ids in its place for the first node to embed (``diffuse.lm.client_ends.LanguageEnds.run_layers``). Where the table goes
is decided once, on the model's own forward, before any stand-in is in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from diffuse.changes import is_freed
from diffuse.lm.embedding import TEXT_INPUTS, embedding_path, embedding_stays, placeholder
from diffuse.errors import DiffuseError
from diffuse.lm.heads import head_path
from diffuse.lm.client_head import HeldElsewhere



@dataclass
class _Embedded:
    """The placeholder the embedding answered in this forward, until the first decoder layer takes it."""

    placeholder: torch.Tensor
    ids: torch.Tensor
    version: int  # its in-place version counter then: a write to it after shows



class EmbeddingEnd:
    """A language model's input embedding, when the first node holds its table: inside the split model's
    forward its stand-in answers a placeholder, and the pass carries the token ids instead (``run_layers``)."""

    def __init__(self, ends):
        self.ends = ends  # the LanguageEnds this end belongs to (diffuse.lm.client_ends)
        self.table: tuple[str, nn.Module] | None = None  # (path, the original), when the first node holds it
        self.kept: str | None = None  # else why the client keeps it (diffuse.lm.embedding.embedding_stays)
        self._path: str | None = None
        self._decided = False
        self.freed = False
        self.passes = 0  # passes that carried token ids for the first node to embed
        self.embedded: _Embedded | None = None
        self.forwards = 0  # the model's own forward calls under way (the placeholder is answered only inside one)
        self.plain_pass = True  # whether the forward under way got token ids only (no media to merge)

    def decide(self) -> None:
        """Where the embedding table goes, decided once on the model's own forward, before any stand-in is in
        place: to the first node when asked (``embedding_on_node``) and the forward allows (``diffuse.lm.embedding``),
        else ``kept`` says why."""
        if self._decided:
            return
        self._decided = True
        plan = self.ends.splitter.plan
        if len(plan.stacks) != 1 or head_path(self.ends.model) is None:
            return
        path = embedding_path(self.ends.model)
        stack = plan.stacks[0].path
        if path is not None and (path == stack or path.startswith(stack + ".")):
            path = None
        if not self.ends.splitter.embedding_on_node:
            self.kept = "the default: passes carry hidden states, not token ids (--embedding-on-node)"
            return
        self.kept = embedding_stays(self.ends.model, path, self.ends.model.get_submodule(stack)[0])
        self._path = path if self.kept is None else None

    def install(self, changes) -> None:
        if self._path is None:
            return
        model = self.ends.model
        original = changes.replace(model, self._path, lambda m: EmbedStandIn(self, m))
        self.table = (self._path, original)
        self.freed = is_freed(original)
        changes.hook(model.register_forward_pre_hook(self._forward_starts, with_kwargs=True))
        changes.hook(model.register_forward_hook(self._forward_ends, always_call=True))

    def _forward_starts(self, _module, args: tuple, kwargs: dict):
        if self.forwards == 0:
            self.embedded = None
            # media or anything else beside token ids: its values may be merged into the embeddings
            self.plain_pass = len(args) <= 1 and not any(
                isinstance(v, torch.Tensor) for k, v in kwargs.items() if k not in TEXT_INPUTS)
        self.forwards += 1

    def _forward_ends(self, _module, _args, output):
        self.forwards -= 1
        if self.forwards == 0 and self.embedded is not None:
            self.embedded = None
            if output is not None:  # a forward that ended normally without handing them to the first layer
                raise DiffuseError("the model's forward made token embeddings and never handed them to its first "
                                   "decoder layer; the embedding table is held by the first node, so Diffuse cannot "
                                   "answer this call")

    def run_embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embedding's answer: inside the split model's forward, a placeholder whose token ids the pass
        takes to the first node; else the table here while it is held here."""
        path, original = self.table
        if self.ends.splitter.ring is not None and self.forwards > 0 and self.plain_pass \
                and isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point():
            out = placeholder(ids, original.weight.shape[1], original.weight.dtype)
            self.embedded = _Embedded(out, ids.detach().clone(), out._version)
            return out
        if original.weight.device.type != "meta":
            return original(ids)
        if self.forwards > 0 and not self.plain_pass:
            raise DiffuseError(f"this call gives the model more than token ids, which it may merge into the "
                               f"embeddings; its embedding table ({path}) is held by the first node")
        raise DiffuseError(f"this model's embedding table ({path}) is held by the first node: call the model "
                           "inside `with diffuse.split(...)`")

    def take_ids(self, hidden) -> torch.Tensor | None:
        """The token ids of this pass when its first layer got the embedding's placeholder unchanged (the first
        node embeds them); None when the embedding made nothing in this forward."""
        e, self.embedded = self.embedded, None
        if e is None:
            return None
        if hidden is not e.placeholder or e.placeholder._version != e.version:
            raise DiffuseError("the model changed the token embeddings before its first decoder layer in this pass; "
                               "its embedding table is held by the first node, so Diffuse refuses the pass rather "
                               "than give a wrong answer")
        return e.ids


class EmbedStandIn(HeldElsewhere):
    """Where the input embedding was: inside the split model's forward, a placeholder whose token ids the pass
    carries to the first node; elsewhere, the table itself while the client still holds it."""

    def __init__(self, splitter, original: nn.Module):
        super().__init__(splitter, original)
        self.num_embeddings, self.embedding_dim = original.weight.shape
        self.padding_idx = getattr(original, "padding_idx", None)
        self.dtype = original.weight.dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._splitter[0].run_embedding(input_ids)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, on the first node"
