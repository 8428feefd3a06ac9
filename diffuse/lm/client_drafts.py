"""Several tokens per trip around the ring: drafts made on the client, verified by one pass (speculative decoding).

A split language model pays one trip around the ring per pass, and a pass that checks a few drafted tokens costs
about what a pass of one costs, since every hop waits on its link more than on its arithmetic. So the client
drafts, and ``generate``'s own assisted decoding runs as it runs whole: the pass carries the drafted tokens, the
last node answers the head's candidates for every position (``diffuse.lm.client_head``), ``generate`` keeps the
longest prefix the model agrees with plus the model's own next token, and the cut it makes in its cache travels
to every node with the next pass (``diffuse.lm.client_cache``). Two drafters, both transformers' own:

- prompt lookup: the continuation of the last n-gram where it appeared earlier in the context (no model; pays on
  text that repeats the prompt: editing, quoting, code);
- an assistant: a small model with the model's tokenizer, run whole on the client.

Greedy decoding gives the tokens plain ``generate`` gives. Sampling keeps transformers' acceptance rule (prompt
lookup: each position drawn from the model's distribution, the draft kept while the draws match it; an assistant:
the speculative sampling rule), so what comes out is distributed as the model's own samples; a seed reproduces
transformers' assisted generation with the same drafter and the same draft lengths, not the sequence plain
sampling draws.

``Drafting`` is a session's setting (``--speculate``, ``--draft-tokens``, ``diffuse.split(speculate=...)``): it
adds the drafter to ``generate`` calls that name none, lets the draft length follow what is accepted (longer after
a draft accepted whole, down to pausing a greedy call's drafts after drafts rejected in a row), and counts drafts,
accepted tokens and trips for the report. A ``generate`` call that names its own drafter (``prompt_lookup_num_tokens``,
``assistant_model``) runs it as transformers does, counted but not steered.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diffuse.errors import DiffuseError

MAX_DRAFT = 32  # drafted tokens one pass verifies at most (--draft-tokens)
DEFAULT_DRAFT = 8
MISSES_TO_PAUSE = 3  # drafts rejected whole in a row before drafting pauses (greedy calls)
LONGEST_PAUSE = 64  # trips; a pause doubles while drafts keep missing


@dataclass
class DraftCounts:
    """What drafting did in one ``generate`` call (or, summed, in a session)."""

    drafts: int = 0  # passes that carried drafted tokens
    drafted: int = 0  # tokens drafted
    accepted: int = 0  # of those, kept
    passes: int = 0  # every pass verifying or decoding, the prompt's included
    paused: int = 0  # passes made without drafting while drafting paused

    def add(self, other: "DraftCounts") -> None:
        for name in ("drafts", "drafted", "accepted", "passes", "paused"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def report(self, new_tokens: int | None = None) -> dict:
        """Acceptance rate and tokens per trip (``new_tokens`` made by these passes), as the report shows them."""
        out = {"drafts": self.drafts, "drafted": self.drafted, "accepted": self.accepted, "passes": self.passes,
               "acceptance": round(self.accepted / self.drafted, 4) if self.drafted else None}
        if new_tokens is not None and self.passes:
            out["tokens_per_trip"] = round(new_tokens / self.passes, 4)
        return out


def parse_speculate(text) -> str | None:
    """``--speculate``: "off" (None), "auto", "lookup", or an assistant model (a folder or a Hub id) as given."""
    if text is None:
        return None
    if not isinstance(text, str) or not text.strip():
        raise DiffuseError("--speculate takes off, auto, lookup, or an assistant model (a folder or ORG/NAME)")
    text = text.strip()
    return None if text == "off" else text


def check_draft_tokens(k) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT:
        raise DiffuseError(f"--draft-tokens {str(k)[:16]}: drafted tokens per trip are 1 to {MAX_DRAFT}")
    return k


@dataclass
class Drafting:
    """A session's drafting: prompt lookup (``assistant`` None) or an assistant model, up to ``most`` tokens a pass."""

    most: int = DEFAULT_DRAFT
    assistant: object = None  # a transformers model run whole on the client, or None for prompt lookup
    auto: bool = False  # the default: prompt lookup only where the tokens cannot change (see ``arguments``)
    total: DraftCounts = field(default_factory=DraftCounts)
    last: DraftCounts | None = None  # the last generate call's counts

    def __post_init__(self):
        check_draft_tokens(self.most)

    @property
    def name(self) -> str:
        if self.assistant is None:
            return "lookup"
        return getattr(getattr(self.assistant, "config", None), "_name_or_path", None) or type(self.assistant).__name__

    def arguments(self, kwargs: dict, batch: int, config, model) -> dict:
        """What a ``generate`` call (its ``kwargs``, ``batch`` rows, its effective generation ``config``, on
        ``model``) adds to draft: nothing when it names a drafter itself, or beams, or more than one row
        (transformers' assisted decoding takes one), or a model whose ``generate`` is its own (MusicGen's refuses
        drafts). By default (``auto``) only greedy float32 calls that ask for no logits or scores draft, on
        decoder-only models. A call with images, video or sound does not draft (prompt lookup would copy their
        placeholder tokens into a draft, which the model reads as more media than it was given). Greedy tokens are
        the plain ones (a pass of several tokens rounds its last bits otherwise
        than a pass of one, far below a float32 model's gaps between candidates, not a bfloat16's; not so through
        bitsandbytes' LLM.int8 layers, whose outlier columns come from every position of a pass: such a model does
        not draft by default), and a seeded sampling call keeps drawing what it draws whole."""
        import torch
        from transformers import GenerationMixin

        from diffuse.plan.bnbread import rows_depend_config

        if batch != 1 or any(kwargs.get(k) is not None for k in ("prompt_lookup_num_tokens", "assistant_model")) \
                or (getattr(config, "num_beams", 1) or 1) > 1 or media_inputs(kwargs) \
                or type(model).generate is not GenerationMixin.generate:
            return {}
        if self.auto and (getattr(config, "do_sample", False) or getattr(config, "output_logits", False)
                          or getattr(config, "output_scores", False) or model.config.is_encoder_decoder
                          or model.dtype not in (torch.float32, torch.float64) or rows_depend_config(model.config)):
            return {}
        if self.assistant is None:
            return {"prompt_lookup_num_tokens": self.most}
        config = self.assistant.generation_config
        # each call starts at the most (transformers keeps where its schedule left the last call: a seed would then
        # draw otherwise from one call to the next), longer after a draft taken whole, shorter after a miss
        config.num_assistant_tokens = self.most
        config.num_assistant_tokens_schedule = "heuristic"
        config.assistant_confidence_threshold = 0  # every draft as long as the schedule says
        return {"assistant_model": self.assistant}


TEXT_KWARGS = ("input_ids", "attention_mask", "position_ids", "token_type_ids", "past_key_values", "cache")


def media_inputs(kwargs: dict) -> list[str]:
    """The tensors of a ``generate`` call beyond its text (pixel values, audio features)."""
    import torch

    return [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k not in TEXT_KWARGS]


class CountedDrafts:
    """Wraps the candidate generator one assisted ``generate`` call builds: counts what it drafts and what is
    accepted. Where ``steer`` is set (prompt lookup asked by ``Drafting``) it sets each draft's length: two longer
    after a draft accepted whole, one past what was accepted after a partial one. Where ``pauses`` (drafts the
    session added to a greedy call, whose tokens drafting cannot change) it stops drafting for a while (doubling,
    up to ``LONGEST_PAUSE`` passes) after ``MISSES_TO_PAUSE`` drafts rejected whole in a row: a pass with drafts
    no one takes costs their rows' work on every node, and an assistant's drafting its time here. (An assistant
    picks up what it missed meanwhile at its next draft: transformers feeds it the positions its cache lacks.)"""

    def __init__(self, inner, counts: DraftCounts, steer: int | None, pauses: bool = False):
        self.inner, self.counts, self.most, self.pauses = inner, counts, steer, pauses or bool(steer)
        self.k = min(steer, 4) if steer else None
        self.misses = self.pause = self.pause_left = 0
        self.drafted_now = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get_candidates(self, input_ids, *args, **kwargs):
        self.counts.passes += 1
        if self.pauses and self.pause_left > 0:
            self.pause_left -= 1
            self.counts.paused += 1
            self.drafted_now = 0
            return input_ids, None
        if self.most:
            self.inner.num_output_tokens = self.k
        candidates, logits = self.inner.get_candidates(input_ids, *args, **kwargs)
        self.drafted_now = candidates.shape[1] - input_ids.shape[1]
        if self.drafted_now:
            self.counts.drafts += 1
            self.counts.drafted += self.drafted_now
        return candidates, logits

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        drafted, self.drafted_now = self.drafted_now, 0
        if not drafted:
            return None  # nothing drafted: nothing learnt (an assistant's schedule would shrink for nothing)
        accepted = min(int(num_matches), drafted)
        self.counts.accepted += accepted
        if self.most:
            self.k = min(self.most, self.k + 2) if accepted == drafted else min(self.most, accepted + 1)
        if accepted:
            self.misses = self.pause = 0
        elif self.pauses:
            self.misses += 1
            if self.misses >= MISSES_TO_PAUSE:
                self.pause = min(LONGEST_PAUSE, max(4, 2 * self.pause))
                self.pause_left, self.misses = self.pause, 0
        return self.inner.update_candidate_strategy(input_ids, scores, num_matches)


def drafting_for(speculate, draft_tokens: int | None = None, model_dir: str | None = None, say=None):
    """A session's ``Drafting`` from ``--speculate`` / ``diffuse.split(speculate=)``: None or "off" (none),
    "auto" (the default: prompt lookup where it cannot change the tokens), "lookup", a transformers model (the
    assistant itself), or an assistant's folder or Hub id, loaded here whole after the checks that refuse it in
    one line (its tokenizer must be ``model_dir``'s; it must fit the memory this process may still take).
    ``draft_tokens``: the most tokens one pass of lookup verifies, where an assistant's drafts start (default 8)."""
    most = check_draft_tokens(draft_tokens) if draft_tokens is not None else DEFAULT_DRAFT
    if speculate is None or isinstance(speculate, Drafting):
        return speculate
    if speculate == "auto":
        return Drafting(most, auto=True)
    if not isinstance(speculate, str):  # a model object: the assistant
        if not callable(getattr(speculate, "generate", None)):
            raise DiffuseError(f"speculate={type(speculate).__name__}: give off, lookup, an assistant model, or its "
                               "folder or Hub id")
        return Drafting(most, speculate)
    name = parse_speculate(speculate)
    if name is None:
        return None
    if name == "lookup":
        return Drafting(most)
    return Drafting(most, load_assistant(name, model_dir, say))


def load_assistant(name: str, model_dir: str | None, say=None):
    """The assistant ``name`` names (a folder, a shipped name or a Hub id), checked, then loaded whole on the
    client in its own dtype."""
    import os

    from diffuse.plan.reports import memory_report
    from diffuse.plan.resolve import resolve_model

    folder = resolve_model(name, "headers", say)  # configs, tokenizer and headers: enough to refuse it
    if model_dir is not None:
        check_same_tokenizer(name, folder, model_dir)
    folder = resolve_model(name, "whole", say)
    need = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
               if f.endswith((".safetensors", ".bin")))
    free = memory_report()["available"]
    if free is not None and need > free:  # before a byte of it is read
        raise DiffuseError(f"--speculate {name}: the assistant's weights take {need / 2**30:.2f} GiB and this "
                           f"process may take {free / 2**30:.2f} GiB more; choose a smaller assistant, or lookup")
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise DiffuseError(f"--speculate {name}: not a model transformers loads for text ({str(exc)[:160]})") from None
    return model.eval()


def check_same_tokenizer(name: str, folder: str, model_dir: str) -> None:
    """An assistant drafts token ids the model reads as its own: their tokenizers must give every text the
    same ids, which equal vocabularies (and special tokens) make so."""
    from diffuse.lm.client_media import load_tokenizer

    try:
        mine, theirs = load_tokenizer(model_dir), load_tokenizer(folder)
    except (OSError, ValueError) as exc:
        raise DiffuseError(f"--speculate {name}: its tokenizer does not load ({str(exc)[:160]})") from None
    if mine.get_vocab() != theirs.get_vocab() or mine.all_special_ids != theirs.all_special_ids:
        raise DiffuseError(f"--speculate {name}: the assistant's tokenizer is not the model's ({len(theirs)} tokens "
                           f"against {len(mine)}, or other ids), so its drafts would be other words; choose an "
                           "assistant of the model's family, or lookup")
