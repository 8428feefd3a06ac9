"""A language model's output head on a split client, and what ``generate`` tells the last node.

Inside ``generate``, which always calls the output head, a pass is held back (``diffuse.lm.client_ends``) until the head
is called, so that the last node runs the final norm and the head too and sends back only the candidates decoding
reads (``diffuse.lm.heads``); ``HeadEnd`` answers the head's stand-in from that pass, or runs the head here where the
model works on the norm's output in between. What ``generate`` itself tells the last node is
``diffuse.lm.client_generate``'s.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn

from diffuse.changes import is_freed
from diffuse.errors import DiffuseError
from diffuse.plan.kvcache import self_attention_part
from diffuse.wire.passes import Tail
from diffuse.lm.heads import head_path, head_vocab, is_head_list, is_norm



class HeadEnd:
    """A language model's output head, answered by the last node from the pass held back for it (``run_head``),
    or here; its stand-in's hooks watch the model so that a module reading the held-back answer gets the real
    one, and the model's outermost forward call is kept so that it can run again here (``_head_here``)."""

    def __init__(self, ends):
        self.ends = ends  # the LanguageEnds this end belongs to (diffuse.lm.client_ends)
        self.head: tuple[str, nn.Module] | None = None  # the output head: (path, the original)
        self.head_freed = self.head_tied = False
        self.head_list = False  # the head is a list of heads side by side (diffuse.lm.client_head.HeadListStandIn)
        self._heads_answer: tuple | None = None  # (the hidden state, every head's logits) while the heads are called
        # whether the head reads rows of the final norm's output as it is (None: not known yet); a model that
        # works on them in between (T5 scales them) gets its passes sent at once and its head run here
        self.tail_follows: bool | None = None
        self._forward_call: tuple | None = None  # the model's outermost forward call under way: (args, kwargs)
        self._forwards = 0
        self.replay = None  # while the forward runs again on a pass already answered: that answer
        self.tail_passes = 0  # passes whose norm and head ran on the last node
        self.tail_bytes = self.tail_bytes_max = 0  # what their answers' tensors held (in all, the most in one)

    def forget_answer(self) -> None:
        """A new pass, or the ring gone: the heads' last answer is for another hidden state."""
        self._heads_answer = None

    def install(self, changes) -> None:
        """The output head becomes a stand-in answered by the last node (``diffuse.lm.heads``); every other module is
        watched, so that one reading the stack's held-back answer gets the real one."""
        path = head_path(self.ends.model) if self.ends.splitter.plan.stacks else None
        if path is None:
            return
        original = self.ends.model.get_submodule(path)
        if is_head_list(original):
            weights = [h.weight for h in original]
            self.head_list = True
        else:
            weight = getattr(original, "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
                return
            weights = [weight]
        self.head = (path, original)
        self.head_freed = is_freed(original)
        # tied to the input embedding, which the client needs for the first layer's input: never freed here
        self.head_tied = any(p is w for name, p in self.ends.model.named_parameters(remove_duplicate=False)
                             if not name.startswith(path + ".") for w in weights)
        changes.replace(self.ends.model, path, lambda m: HeadListStandIn(self, m) if self.head_list
                        else HeadStandIn(self, head_vocab(m), m))
        changes.hook(self.ends.model.register_forward_pre_hook(self._forward_starts, with_kwargs=True))
        changes.hook(self.ends.model.register_forward_hook(self._forward_ends, always_call=True))
        for mpath, module in self.ends.model.named_modules():
            if changes.made(module):
                continue
            changes.hook(module.register_forward_pre_hook(functools.partial(self._before_module, mpath)))
            changes.hook(module.register_forward_hook(functools.partial(self._after_module, mpath)))

    def _forward_starts(self, _module, args: tuple, kwargs: dict):
        if self._forwards == 0:
            self._forward_call = (args, kwargs)
        self._forwards += 1

    def _forward_ends(self, _module, _args, _output):
        self._forwards -= 1
        if self._forwards == 0:
            self._forward_call = None

    def _before_module(self, path: str, module: nn.Module, args: tuple):
        p = self.ends.pending
        if p is None or not args or args[0] is not p.placeholder:
            return None
        if p.norm is None and p.normed is None and is_norm(module):
            p.norm = path  # runs on the placeholder here; only its output's shape and view matter
            return None
        return (self.ends.send_pending(None), *args[1:])  # anything else reading the answer gets the real one now

    def _after_module(self, path: str, module: nn.Module, args: tuple, output):
        p = self.ends.pending
        if p is not None and p.norm == path and args and args[0] is p.placeholder:
            p.normed = output

    def run_head(self, x: torch.Tensor) -> torch.Tensor:
        """The output head's answer for ``x``: from the last node when the pass is held back (norm, the rows
        ``x`` takes, head, the candidates decoding needs), else from the head here."""
        path, original = self.head
        p = self.ends.pending
        if p is None:
            if self.head_freed:
                raise DiffuseError(f"{path} was called on a hidden state the last node did not make, and its "
                                   "weights are held by the nodes")
            return original(x)
        rows = rows_of(x, p.normed if p.normed is not None else p.placeholder)
        if rows is None:
            return self._head_here(path, original, x)
        self.tail_follows = True
        gen = self.ends.generation
        draw = gen.draw.wire(gen.node_tail()) if gen.draw is not None else None
        before = self_attention_part(p.cache).get_seq_length() if p.cache is not None else 0
        answer = self.ends.send_pending(Tail(p.norm, tuple(rows), gen.top or 0, draw))
        self.tail_passes += 1
        held = sum(t.numel() * t.element_size() for t in (answer.values() if isinstance(answer, dict) else ())
                   if isinstance(t, torch.Tensor))
        self.tail_bytes += held
        self.tail_bytes_max = max(self.tail_bytes_max, held)
        vocab = head_vocab(original)
        self.ends.free_remote_weights()
        # the position of the first row answered: a processor called on the token history up to the row's own
        # position reads that row (one per pass; one per drafted token and one more when drafts are verified)
        gen.rows_at = before + rows[0] if p.cache is not None else rows[0]
        if "logits" in answer:
            logits = answer["logits"]
            gen.shortlist, gen.whole_row = None, logits
        else:
            logits = logits_from(answer["ids"], answer["values"], vocab)
            gen.shortlist = logits
        if gen.draw is not None:  # the row generate will read, as it reads it
            gen.draw.took(answer, gen.node_tail(), logits[:, -1].to(dtype=torch.float32, copy=True))
        return logits

    def _head_here(self, path: str, original: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The head's answer where the model works on the final norm's output before its head (T5 scales it): the
        pass held back goes without its tail, the model's forward runs again on that answer, here, up to the
        head, which runs here on what the forward hands it; later passes go at once (``tail_follows``)."""
        answer = self.ends.send_pending(None)
        if self.tail_follows or self._forward_call is None or self._forwards != 1 or self.head_freed \
                or self.ends.embed is not None or self.head_list:
            raise unsupported_view(path)
        self.tail_follows = False
        args, kwargs = self._forward_call
        self.replay = answer
        try:
            out = type(self.ends.model).forward(self.ends.model, *args, **kwargs)
        finally:
            self.replay = None
        logits = getattr(out, "logits", None)
        if logits is None and isinstance(out, tuple):
            logits = out[0]
        if not isinstance(logits, torch.Tensor):
            raise unsupported_view(path)
        return logits

    def run_head_of(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Head ``index`` of a list of heads, on ``x``: the first head called in a held-back pass sends it (every
        head runs on the last node, ``diffuse.lm.node_tail.stack_heads``), every head then answers its part of that answer;
        each must read the same hidden state."""
        path, original = self.head
        heads = len(original)
        if self.ends.pending is not None:
            logits = self.run_head(x)  # (batch * heads) x rows x vocab
            if logits.shape[0] % heads:
                raise DiffuseError(f"the last node answered {logits.shape[0]} rows for {heads} heads")
            self._heads_answer = (x, logits.reshape(-1, heads, *logits.shape[1:]))
        if self._heads_answer is not None:
            seen, logits = self._heads_answer
            if x is not seen:
                raise DiffuseError(f"{path}[{index}] reads another hidden state than the head called first; the "
                                   "heads run side by side on the last node, so Diffuse cannot answer this call")
            return logits[:, index]
        if self.head_freed:
            raise DiffuseError(f"{path}[{index}] was called on a hidden state the last node did not make, and its "
                               "weights are held by the nodes")
        return original[index](x)


def rows_of(x: torch.Tensor, full: torch.Tensor) -> tuple[int, int] | None:
    """``(start, stop)`` when ``x`` is ``full[:, start:stop]`` (a view sharing its storage), else None."""
    if x.dim() != 3 or full.dim() != 3 or x.shape[0] != full.shape[0] or x.shape[2] != full.shape[2]:
        return None
    if x.untyped_storage().data_ptr() != full.untyped_storage().data_ptr() or x.stride() != full.stride():
        return None
    offset = x.storage_offset() - full.storage_offset()
    if offset < 0 or offset % full.stride(1):
        return None
    start = offset // full.stride(1)
    return (start, start + x.shape[1]) if start + x.shape[1] <= full.shape[1] else None


def logits_from(ids: torch.Tensor, values: torch.Tensor, vocab: int) -> torch.Tensor:
    out = torch.full((*ids.shape[:-1], vocab), float("-inf"), dtype=values.dtype, device=values.device)
    return out.scatter_(-1, ids.long(), values)


FREED_FROM: "weakref.WeakKeyDictionary[nn.Module, torch.device]" = weakref.WeakKeyDictionary()  # freed: where it was


class HeldElsewhere(nn.Module):
    """A stand-in for one of a model's modules whose weights a node holds (the output head, the input
    embedding): code that reads its ``weight`` (tying, resizing) sees the original's."""

    def __init__(self, splitter, original: nn.Module):
        super().__init__()
        self._splitter = (splitter,)
        self._original = (original,)  # tuples: not registered, so their weights are not this module's
        # an empty parameter of the original's dtype and device: a model whose every weight is elsewhere (OLMo's
        # norms have none) still answers ``generate``'s ``self.device`` and ``self.dtype``
        first = next(original.parameters(), None)
        if first is not None:  # (where a split before this one freed the original: the device it was on)
            device = FREED_FROM.get(original, first.device)
            self.held_here = nn.Parameter(torch.empty(0, dtype=first.dtype, device=device), requires_grad=False)

    @property
    def weight(self):
        return self._original[0].weight


class HeadStandIn(HeldElsewhere):
    """Where the output head was: answers with logits built from what the last node sent back."""

    def __init__(self, splitter, vocab: int, original: nn.Module):
        super().__init__(splitter, original)
        self.out_features = vocab

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._splitter[0].run_head(x)

    def extra_repr(self) -> str:
        return f"out_features={self.out_features}, on the last node"


class _HeadProxy(nn.Module):
    def __init__(self, owner: "HeadListStandIn", index: int):
        super().__init__()
        self._owner = (owner,)
        self.index = index
        self.out_features = owner.out_features

    @property
    def weight(self):
        return self._owner[0]._original[0][self.index].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._owner[0]._splitter[0].run_head_of(self.index, x)

    def extra_repr(self) -> str:
        return f"index={self.index}, on the last node"


class HeadListStandIn(nn.ModuleList):
    """Where a list of heads was: as many parameterless heads, each answering its part of what the last node sent
    back for all of them (the first one called sends the pass)."""

    def __init__(self, splitter, original: nn.ModuleList):
        super().__init__()
        self._splitter = (splitter,)
        self._original = (original,)  # a tuple: not registered, its weights are not this module's
        self.out_features = head_vocab(original)
        self.extend([_HeadProxy(self, i) for i in range(len(original))])


def unsupported_view(path: str) -> DiffuseError:
    return DiffuseError(f"the model hands its output head ({path}) rows it did not slice from the final norm's "
                        "output; Diffuse cannot follow that selection to the last node")
