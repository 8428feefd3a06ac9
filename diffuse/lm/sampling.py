"""Sampling on the last node: ``generate``'s own logits processors, rebuilt there, and the draw made there.

With ``do_sample``, ``generate`` builds a list of logits processors (temperature,
top-k, top-p, repetition penalty, ... including what its generation config
implies, such as ``top_k=50`` when unset), applies it to the last row of logits,
and draws with ``torch.multinomial`` from the global torch generator. Split, the
client captures that very list as ``generate`` builds it (``Splitter`` scopes an
override of ``_get_logits_processor`` to the call) and describes it as data:
class names from a closed list and their parameters, never code. The last node
rebuilds the list with transformers' own classes, applies it to the whole row it
just computed, and draws with a ``torch.Generator`` in the client's state, so
the token is the one ``generate`` would draw whole. Only the drawn token (and the
few top candidates the report shows) comes home.

The client hands ``generate`` one processor of its own instead of the list
(``DrawnToken``): it checks that what ``generate`` is about to process is what
the node processed (the same token history, the logits the head answered, not
changed after the head) and leaves ``-inf`` everywhere but the drawn token, so
``generate``'s own ``multinomial`` picks it. That draw consumes the client's
generator exactly as the node's draw consumed the node's (the same shape), so the
two stay in step: the client sends its generator state only when its digest
differs from the one the node reported after its last draw (the first draw of a
session, or after ``torch.manual_seed``). The token history the processors read
(repetition penalty, n-gram bans, length rules) travels as what changed: the
columns the node keeps and the ones to add, usually the one token just drawn.

Classifier-free guidance (``ClassifierFreeGuidanceLogitsProcessor``, which
MusicGen's ``generate`` adds) is rebuilt too: the logits have twice the rows of
the token history (conditional half, then unconditional), both halves computed
on the last node, and the processor hands on one row per history row. With a
list of heads (``diffuse.lm.heads``) the same machinery serves greedy decoding: the
node applies the processors and takes the argmax (``sample`` false), and the
client's ``DrawnToken`` leaves only that token for ``generate``'s argmax.
"""

from __future__ import annotations

import hashlib
import math

import torch

from diffuse.errors import DiffuseError
from diffuse.wire.passes import DrawState
from diffuse.plan.contracts import is_int

# The processors a node rebuilds, with their constructor's parameters (read from the instance under the same
# names) and what each holds: "float", "int", "ids" (token ids, a tensor or a list), "lengths" (None, an int, or
# one int per row). Anything else generate builds (watermarks, a user's own processor) is refused.
PROCESSORS: dict[str, dict[str, str]] = {
    "TemperatureLogitsWarper": {"temperature": "float"},
    "TopKLogitsWarper": {"top_k": "int", "filter_value": "float", "min_tokens_to_keep": "int"},
    "TopPLogitsWarper": {"top_p": "float", "filter_value": "float", "min_tokens_to_keep": "int"},
    "MinPLogitsWarper": {"min_p": "float", "filter_value": "float", "min_tokens_to_keep": "int"},
    "TypicalLogitsWarper": {"mass": "float", "filter_value": "float", "min_tokens_to_keep": "int"},
    "EpsilonLogitsWarper": {"epsilon": "float", "filter_value": "float", "min_tokens_to_keep": "int"},
    "EtaLogitsWarper": {"epsilon": "float", "filter_value": "float", "min_tokens_to_keep": "int"},
    "RepetitionPenaltyLogitsProcessor": {"penalty": "float", "prompt_ignore_length": "lengths"},
    "NoRepeatNGramLogitsProcessor": {"ngram_size": "int"},
    "MinLengthLogitsProcessor": {"min_length": "int", "eos_token_id": "ids"},
    "MinNewTokensLengthLogitsProcessor": {"prompt_length_to_skip": "int", "min_new_tokens": "int",
                                          "eos_token_id": "ids"},
    "SuppressTokensLogitsProcessor": {"suppress_tokens": "ids"},
    "SuppressTokensAtBeginLogitsProcessor": {"begin_suppress_tokens": "ids", "begin_index": "int"},
    "ForcedBOSTokenLogitsProcessor": {"bos_token_id": "int"},
    "ForcedEOSTokenLogitsProcessor": {"max_length": "int", "eos_token_id": "ids"},
    "InfNanRemoveLogitsProcessor": {},
    "ClassifierFreeGuidanceLogitsProcessor": {"guidance_scale": "float"},
}
MAX_IDS = 1 << 16  # token ids one parameter may list


def _read(value, kind: str):
    """A parameter's value as plain data, or raise ValueError when it is not of its kind."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and kind == "float" and value.dim() == 0:
            return float(value.item())
        if value.is_floating_point() or value.is_complex():
            raise ValueError("a tensor of the wrong kind")
        value = value.tolist()
    if kind == "float":
        if isinstance(value, float) or is_int(value):
            return float(value) if isinstance(value, float) else value
    elif kind == "int":
        if is_int(value):
            return value
    elif kind == "ids":
        value = [value] if is_int(value) else value
        if isinstance(value, (list, tuple)) and len(value) <= MAX_IDS and all(is_int(v) for v in value):
            return list(value)
    elif kind == "lengths":
        if value is None or is_int(value):
            return value
        if isinstance(value, (list, tuple)) and len(value) <= MAX_IDS and all(is_int(v) for v in value):
            return list(value)
    raise ValueError(f"not {kind}")


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def describe(processors) -> list[list]:
    """``[[class name, {parameter: value}], ...]`` for ``generate``'s list, checked by rebuilding it here: a
    processor outside the closed list, or one whose state the description would not carry whole, is refused."""
    import transformers.generation.logits_process as lp

    out = []
    for p in processors:
        name = type(p).__name__
        spec = PROCESSORS.get(name)
        if spec is None or type(p) is not getattr(lp, name, None):
            raise DiffuseError(f"generate's logits processor {name} cannot be rebuilt on the last node, where sampling "
                               f"draws; Diffuse samples with {', '.join(sorted(n for n in PROCESSORS))}")
        try:
            params = {key: _read(getattr(p, key), kind) for key, kind in spec.items()}
        except (AttributeError, ValueError):
            params = None
        if params is None or not _same_state(p, _build_one(name, params)):
            raise DiffuseError(f"generate's {name} holds state its description would not carry to the last node, "
                               "where sampling draws")
        out.append([name, params])
    return out


def _same_state(a, b) -> bool:
    va, vb = vars(a), vars(b)
    return va.keys() == vb.keys() and all(_same(va[k], vb[k]) for k in va)


def _build_one(name: str, params: dict):
    import transformers.generation.logits_process as lp

    spec = PROCESSORS[name]
    kwargs = {}
    for key, kind in spec.items():
        value = params[key]
        if kind == "lengths" and isinstance(value, list):
            value = torch.tensor(value, dtype=torch.long)
        kwargs[key] = value
    return getattr(lp, name)(**kwargs)


def rebuild(described) -> list:
    """The processors a ``describe`` list names, built with transformers' own classes (a node's side: every
    name, parameter and value is checked first)."""
    if not isinstance(described, list) or len(described) > 64:
        raise DiffuseError("malformed sampling processors")
    built = []
    for item in described:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], dict)):
            raise DiffuseError("malformed sampling processors")
        name, params = item
        spec = PROCESSORS.get(name)
        if spec is None:
            raise DiffuseError(f"{name[:64]!r} is not a logits processor a node rebuilds")
        if set(params) != set(spec):
            raise DiffuseError(f"{name}: expected the parameters {sorted(spec)}")
        try:
            checked = {key: _read(params[key], kind) for key, kind in spec.items()}
            built.append(_build_one(name, checked))
        except (ValueError, TypeError) as exc:
            raise DiffuseError(f"{name}: {str(exc)[:120]}") from None
    return built


def draw_on_device_refusal(device) -> str:
    """Why a seeded draw is refused for a client on an accelerator (``diffuse.cli.language`` says it before any node starts)."""
    return (f"sampling with the client on {device}: generate run whole there draws from {device}'s own generator, "
            "while the last node draws on the CPU from the client's CPU generator state, so the tokens would differ; "
            "sample with the client on the CPU (--device cpu), or decode greedily (exact on any device)")


def rng_digest(state: torch.Tensor) -> str:
    """A short fingerprint of a torch generator's state, as hex (both ends compute it the same way)."""
    return hashlib.blake2b(state.contiguous().numpy().tobytes(), digest_size=8).hexdigest()


class NodeTail:
    """What the client knows one ring session's last node holds for its draws (sent once, then changes)."""

    def __init__(self, channel):
        self.channel = channel
        self.processors = None
        self.history: torch.Tensor | None = None
        self.rng: str | None = None


class Draw:
    """One ``generate`` call's draws on the last node, from the client's side."""

    def __init__(self, built, sample: bool):
        self.built = built  # generate's own list: used here only when a pass's head ran here (nothing drawn)
        self.described = describe(built)
        self.sample = sample
        self.ids: torch.Tensor | None = None  # the token history generate runs the next forward with
        self.sent_ids: torch.Tensor | None = None
        self.row: torch.Tensor | None = None  # the logits the head answered for the draw, as generate reads them
        self.token: torch.Tensor | None = None
        self.draws = 0
        self.states_sent = 0

    def wire(self, node: NodeTail) -> DrawState:
        """The ``draw`` of a pass's tail: what the node lacks of the processors, history and generator."""
        ids = self.ids
        if ids is None:
            raise DiffuseError("generate ran its model without the token history it draws after")
        if ids.device.type != "cpu":
            raise DiffuseError(draw_on_device_refusal(ids.device))
        ids = ids.detach().to(torch.long)
        processors = rng = None
        if node.processors != self.described:
            processors = node.processors = self.described
        old = node.history
        keep = old.shape[1] if (old is not None and old.shape[0] == ids.shape[0] and old.shape[1] <= ids.shape[1]
                                and torch.equal(ids[:, :old.shape[1]], old)) else 0
        history = {"keep": keep, "add": ids[:, keep:].tolist()}
        node.history = self.sent_ids = ids.clone()
        if self.sample:
            state = torch.get_rng_state()
            if rng_digest(state) != node.rng:
                rng = state.numpy().tobytes()
                self.states_sent += 1
        return DrawState(self.sample, history, processors, rng)

    def took(self, answer: dict, node: NodeTail, row: torch.Tensor) -> None:
        drawn = answer.get("drawn")
        if not isinstance(drawn, torch.Tensor) or drawn.dim() != 1 or drawn.shape[0] != self.sent_ids.shape[0] \
                or drawn.is_floating_point() or not ((drawn >= 0) & (drawn < row.shape[-1])).all():
            raise DiffuseError("the last node answered a draw without its tokens")
        self.token, self.row = drawn.to(torch.long), row
        node.rng = answer.get("rng") if self.sample else node.rng
        self.draws += 1


class DrawnToken:
    """The one logits processor ``generate`` runs while its draws are made on the last node: ``-inf`` everywhere
    but the drawn token, after checking that ``generate`` is at the very step the node drew for."""

    def __init__(self, draw: Draw):
        self.draw = draw

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        d = self.draw
        if d.token is None:  # this pass's head ran here: generate's own processors, on the whole row
            for p in d.built:
                scores = p(input_ids, scores)
            return scores
        token, d.token = d.token, None
        if d.sent_ids is None or not torch.equal(input_ids.detach().cpu().to(torch.long), d.sent_ids):
            raise DiffuseError("generate processed another token history than the one the last node drew with; "
                               "Diffuse cannot sample on the last node for this way of calling generate")
        if scores.shape != d.row.shape or not torch.equal(scores.detach().cpu(), d.row):
            raise DiffuseError("the model changes its logits after the output head (a soft cap or a scale), so "
                               "the last node would sample from another distribution; Diffuse cannot sample it")
        # one row per token history row (fewer than the logits' under guidance, as generate's processors leave)
        forced = torch.full((token.shape[0], scores.shape[1]), float("-inf"), dtype=scores.dtype, device=scores.device)
        return forced.scatter_(1, token.to(scores.device)[:, None], 0.0)
