"""What ``generate`` tells the last node of a split language model, and the drafts it verifies there.

``GenerateCapture`` wraps ``generate``: it says how many candidates decoding needs (``diffuse.lm.heads``), and
captures generate's own logits processors and token history so that, when it samples, the last node applies
them and draws (``diffuse.lm.sampling``). Where the session drafts (``diffuse.lm.client_drafts``), it adds the
drafter to the call and counts what is drafted and accepted; a verifying pass brings every position's candidates
home (the whole rows when sampling, whose acceptance rule reads whole distributions), and ``generate`` runs its
processors and draws here, as it does whole.
"""

from __future__ import annotations

import functools

import torch

from diffuse.errors import DiffuseError
from diffuse.lm.client_shortlist import ShortlistCheck


class GenerateCapture:
    """While split, ``generate`` first says how many candidates its decoding reads (``diffuse.lm.heads``); with
    sampling, the last node applies generate's own processors and draws (``diffuse.lm.sampling``)."""

    def __init__(self, ends):
        self.ends = ends  # the LanguageEnds this end belongs to (diffuse.lm.client_ends)
        self.top: int | None = None  # candidates per row the head's answer needs (None: the whole row)
        self.shortlist: torch.Tensor | None = None  # the rows the head last answered from the best candidates only
        self.whole_row: torch.Tensor | None = None  # ... or whole
        self.rows_at = 0  # the position of their first row (diffuse.lm.client_shortlist.ShortlistCheck)
        self.speculating = False  # the generate call under way verifies drafts (assisted decoding)
        self.drafts = None  # its counts (diffuse.lm.client_drafts.DraftCounts) while it runs, then the last call's
        self.steered = False  # its drafter is the session's prompt lookup, whose draft lengths are set here
        self.pausing = False  # its drafts (the session's, greedy) pause while no one takes them
        self.greedy_top: int | None = None  # in a greedy generate call, the candidates a shortlist holds
        self.logits_changed: bool | None = None  # whether the model changes its logits after the head (None: unknown)
        self.active = False  # passes are held back for the head only inside generate, which always calls it
        self.draw = None  # a generate call's draws on the last node (diffuse.lm.sampling.Draw), while it runs
        self.last_draw = None  # the last generate call's (None when it drew nothing on the node), for its report
        self._node_tail = None  # what the open ring's last node holds for draws (diffuse.lm.sampling.NodeTail)

    def wrap(self, changes) -> None:
        from diffuse.plan.kvcache import check_prompt
        from diffuse.lm.heads import candidates_needed, effective_config

        model = self.ends.model
        bound = type(model).generate.__get__(model)

        @functools.wraps(bound)
        def generate(*args, **kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            check_prompt(model.config, ids)  # before any pass
            config = effective_config(model, kwargs)
            drafting, self.steered, self.pausing = self.ends.splitter.drafting, False, False
            if drafting is not None:
                added = drafting.arguments(kwargs, ids.shape[0] if isinstance(ids, torch.Tensor) else 0, config,
                                           model)
                if added:
                    kwargs.update(added)
                    config = effective_config(model, kwargs)
                self.steered = "prompt_lookup_num_tokens" in added  # its lengths follow what is accepted
                # drafts the session added to a greedy call pause while no one takes them (diffuse.lm.client_drafts)
                self.pausing = bool(added) and not getattr(config, "do_sample", False)
            self.speculating, self.drafts = assisted(config, kwargs), None
            if self.speculating:
                self.speculating = self._nodes_cut(kwargs, self.steered and drafting.auto)
            self.top = candidates_needed(config, kwargs)
            # greedy from the best few: until this model is known not to change its logits after the head, its
            # first pass brings the whole last row (diffuse.lm.client_shortlist.ShortlistCheck learns it there)
            self.greedy_top = self.top if not self.ends.head_end.head_list else None
            if self.greedy_top is not None and self.logits_changed is not False:
                self.top = None
            self.active = True
            self.draw = None
            restore = self._capture(model)
            try:
                return bound(*args, **kwargs)
            finally:
                restore()
                if drafting is not None:
                    drafting.last = self.drafts if self.speculating else None
                    if drafting.last is not None:
                        drafting.total.add(drafting.last)
                self.top, self.greedy_top, self.active, self.speculating = None, None, False, False
                self.shortlist = self.whole_row = None
                self.last_draw, self.draw = self.draw, None
                self.ends.pending = None  # a pass nothing read (cannot happen in generate): not left behind

        changes.set(model, "generate", generate)

    def _nodes_cut(self, kwargs: dict, quietly: bool) -> bool:
        """Whether every node of the ring cuts its cache as a verifying pass asks (wire version 3 and later): where
        one does not, drafting the session chose by default (``quietly``) is left out of ``kwargs``, and any
        other is refused in one line."""
        from diffuse.plan.contracts import CUTS_CACHES

        ring = self.ends.splitter.ring
        old = ring.old_nodes(CUTS_CACHES) if hasattr(ring, "old_nodes") else []
        if not old:
            return True
        if quietly:
            kwargs.pop("prompt_lookup_num_tokens", None)
            self.steered = False
            return False
        raise DiffuseError(f"node {', '.join(old)[:300]} speaks a wire version older than {CUTS_CACHES}, whose nodes "
                           "cannot cut their caches after drafts: update it, or --speculate off")

    def node_tail(self):
        """What the open ring's last node holds for draws; a new session starts with nothing."""
        from diffuse.lm.sampling import NodeTail

        channel = self.ends.splitter.ring.channel
        if self._node_tail is None or self._node_tail.channel is not channel:
            self._node_tail = NodeTail(channel)
        return self._node_tail

    def _capture(self, model):
        """For the length of one ``generate`` call: the logits processors it builds are captured (with sampling,
        described for the last node and replaced by ``DrawnToken``), and so is the token history it runs each
        forward with. Returns what undoes both."""
        get_processors, prepare = model._get_logits_processor, model.prepare_inputs_for_generation
        get_drafter = model._get_candidate_generator

        @functools.wraps(get_processors)
        def get_logits_processor(*args, **kwargs):
            built = get_processors(*args, **kwargs)
            config = kwargs["generation_config"] if "generation_config" in kwargs else args[0]
            return self._processors(built, config)

        @functools.wraps(prepare)
        def prepare_inputs_for_generation(input_ids, *args, **kwargs):
            if self.draw is not None:
                self.draw.ids = input_ids
            if self.speculating and kwargs.get("is_first_iteration") and kwargs.get("next_sequence_length") is None:
                kwargs["next_sequence_length"] = past_sliced(input_ids, kwargs)
            return prepare(input_ids, *args, **kwargs)

        @functools.wraps(get_drafter)
        def get_candidate_generator(*args, **kwargs):
            from transformers import LogitsProcessorList

            from diffuse.lm.client_drafts import CountedDrafts, DraftCounts
            from diffuse.lm.sampling import DrawnToken

            # the drafter runs generate's own processors on its drafts, never the checks standing in front of them
            built = kwargs.get("logits_processor")
            if built is not None:
                kwargs["logits_processor"] = LogitsProcessorList(
                    [p for p in built if not isinstance(p, (ShortlistCheck, DrawnToken))])
            inner = get_drafter(*args, **kwargs)
            drafting = self.ends.splitter.drafting
            steer = drafting.most if self.steered and hasattr(inner, "num_output_tokens") else None
            self.drafts = DraftCounts()
            return CountedDrafts(inner, self.drafts, steer, self.pausing)

        model._get_logits_processor = get_logits_processor
        model.prepare_inputs_for_generation = prepare_inputs_for_generation
        model._get_candidate_generator = get_candidate_generator

        def restore():
            for name in ("_get_logits_processor", "prepare_inputs_for_generation", "_get_candidate_generator"):
                model.__dict__.pop(name, None)

        return restore

    def _processors(self, built, config):
        """What generate runs in place of the processors it ``built``: its own, or ``DrawnToken`` when the last
        node applies them and draws."""
        from transformers import LogitsProcessorList

        from diffuse.lm.sampling import Draw, DrawnToken
        from diffuse.lm.heads import GREEDY_TOP, LISTED_TOP

        if getattr(config, "output_scores", False) or (getattr(config, "num_beams", 1) or 1) > 1:
            return built  # output_scores asks for whole rows
        if self.speculating and getattr(config, "do_sample", False):
            return built  # drafts accepted by their whole distributions: whole rows come home, drawn here
        if not getattr(config, "do_sample", False):
            if self.greedy_top is not None:  # greedy reads the best few: checked first
                return LogitsProcessorList([ShortlistCheck(self, self.greedy_top), *built])
            if not self.ends.head_end.head_list or self.top is not None:
                return built  # greedy reads the whole row
            # a list of heads under processors (guidance): the last node applies them and takes the argmax
            try:
                self.draw = Draw(built, sample=False)
            except DiffuseError:
                return built  # a processor the node cannot rebuild: whole rows come home, processed here
        else:
            self.draw = Draw(built, sample=True)
        # the raw best candidates still come home, for output_logits and the report
        self.top = LISTED_TOP if self.ends.head_end.head_list else GREEDY_TOP
        # each generate call's first draw carries everything (processors, whole history, generator state), so
        # the passes of one call, replayed in order on a new node, rebuild its state exactly
        self._node_tail = None
        return LogitsProcessorList([DrawnToken(self.draw)])


def assisted(config, kwargs: dict) -> bool:
    """Does a ``generate(**kwargs)`` call running with ``config`` (``effective_config``) verify drafts
    (transformers' assisted decoding)?"""
    from transformers.generation.configuration_utils import GenerationMode

    if config is None:
        return False
    try:
        return config.get_generation_mode(kwargs.get("assistant_model")) == GenerationMode.ASSISTED_GENERATION
    except (ValueError, TypeError):
        return False  # generate itself says what is wrong with the call


def past_sliced(input_ids, kwargs: dict) -> int | None:
    """The positions the first pass of an assisted ``generate`` must feed where its cache already holds earlier
    turns: transformers 5 feeds the whole history again there (its plain decoding slices it off, as here), which
    writes every earlier position into the cache twice and changes the answer."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    past = cache.get_seq_length() if callable(getattr(cache, "get_seq_length", None)) else 0
    mask = kwargs.get("attention_mask")
    if past <= 0 or input_ids.shape[1] <= past or (mask is not None and mask.shape[1] != input_ids.shape[1]):
        return None
    return input_ids.shape[1] - past
