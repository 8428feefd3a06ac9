"""Sizes checked before work starts: the pipeline's own call, run weightless.

``check_sizes`` runs the pipeline's ``__call__`` on a copy of it whose denoiser
is rebuilt from its config on the meta device: its tensors have shapes and no
data, so its forward costs milliseconds, reads no weight and starts no node.
The rest of the call is the pipeline's own (the prompt is encoded once, and
kept for the further probes and for the real call), and it stops once the first
denoiser call has gone through the denoiser's own forward at the call's shapes
(or at the scheduler's first step, whichever comes first). A size the model
cannot take fails there exactly as it would after loading and starting nodes,
and is refused in one line that names the largest sizes it does take. A failure the dry call
cannot stand for (an operation with no meta kernel, a pipeline that reads a
tensor's values before its first step) skips the check: it never refuses a
call the model would run.

The same dry call watches each block stack of the denoiser (``NotAChain``): its
blocks must be called in list order, each handed every tensor the block before
it returned, untouched. That is what lets one pass through the nodes stand for
the whole stack; a denoiser that adds to a block's output before the next block
or keeps each block's output is refused here, in one line, before any node
starts. (Wan VACE, which does both, says so in its config and is refused
earlier, at analysis: ``analyzers/side_stacks.py``.)

``largest_sizes`` runs the same search once for a model folder (each size alone, up to
``SEARCH_UP_TO``) for its kept verdict (``diffuse.cli.check.keep``); ``diffuse.cli.check.kept_refusal`` then
refuses a size above those bounds from the verdict alone, before torch is imported.

``notes`` gives one-line warnings where a run would go through but make little:
a size other than the one a model folder declares it was made for
(``diffuse_defaults.json``), words its tokenizer does not know, an empty prompt.
"""

from __future__ import annotations

import inspect
import json
import time

from diffuse.errors import DiffuseError

SEARCH_S = 6.0  # at most this long looking for the largest size taken, per size
SIZE_ARGS = ("height", "width", "num_frames")
SIZE_WORDS = {"height": "px high", "width": "px wide", "num_frames": "frames"}


class _FirstStep(Exception):
    """The first denoiser call went through (or the scheduler's first step came first): the call's shapes fit."""


class _Refused(Exception):
    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


class NotAChain(DiffuseError):
    """A stack's blocks, in the dry call, were not called as a chain: in list order, each handed what the one
    before it returned, as it returned it (the stand-in answers for all of them at once)."""


def _watch_chains(meta, stacks: list[str]) -> list:
    """Hooks on each stack of the weightless denoiser that raise ``NotAChain`` where the denoiser calls a block
    out of order, or calls it without every tensor the block before returned, untouched (work between blocks,
    such as a residual added after some of them, or a block's output used elsewhere than in the next block's
    call); the hooks, to remove."""
    from diffuse.plan.calltree import flatten, encode_value

    hooks = []
    for path in stacks:
        try:
            blocks = meta.get_submodule(path)
        except AttributeError:
            continue
        seen = {"next": 0, "out": []}

        def before(module, args, kwargs, i, path=path, seen=seen):
            if i and i != seen["next"]:
                raise NotAChain(f"{path}[{i}] is called after {path}[{seen['next'] - 1}]: the denoiser does not run "
                                "this stack as a chain in list order, so it cannot be split")
            try:
                given = {id(t) for t in flatten(args, kwargs)[1]}
            except DiffuseError:  # a call that cannot travel: the split says so itself, not this check
                return
            if i and any(id(t) not in given for t in seen["out"]):
                raise NotAChain(f"the denoiser does not hand {path}[{i}] what {path}[{i - 1}] returned, as it "
                                f"returned it (it works between the blocks, e.g. adds something to their output, or "
                                f"uses a block's output elsewhere): {path} is not a plain chain, so it cannot be split")

        def after(module, args, kwargs, out, i, seen=seen):
            try:
                outs = encode_value(out)[1]
            except DiffuseError:  # an answer that cannot travel: the split says so itself, not this check
                outs = []
            seen["next"], seen["out"] = i + 1, outs

        for i, block in enumerate(blocks):
            hooks.append(block.register_forward_pre_hook(
                lambda m, a, k, i=i, f=before: f(m, a, k, i), with_kwargs=True))
            hooks.append(block.register_forward_hook(
                lambda m, a, k, o, i=i, f=after: f(m, a, k, o, i), with_kwargs=True))
    return hooks


def _meta_copy(module):
    """``module`` rebuilt from its config on the meta device (no weights, no memory), or None."""
    import torch

    config = getattr(module, "config", None)
    if config is None:
        return None
    try:
        with torch.device("meta"):
            if hasattr(type(module), "from_config") and not hasattr(module, "generation_config"):
                return type(module).from_config(config)  # diffusers
            return type(module)(config)  # transformers
    except Exception:
        return None


class DryPipeline:
    """A pipeline's call with its denoiser weightless: see the module's docstring."""

    def __init__(self, pipe, denoiser: str, stacks: list[str] = ()):
        self.pipe, self.denoiser = pipe, denoiser
        self.meta = _meta_copy(getattr(pipe, denoiser, None))
        if self.meta is None:
            raise _Skip(f"{denoiser} cannot be rebuilt from its config")
        self.stacks = list(stacks)  # watched: their blocks must be called as a chain (``NotAChain``)
        self.prompt: tuple | None = None  # encode_prompt's (args, kwargs, answer), kept from the first call

    def run(self, kwargs: dict) -> None:
        """The call with ``kwargs`` up to its first scheduler step. Raises ``_Refused`` when the denoiser's
        forward refuses these shapes, ``_Skip`` when the dry call cannot tell."""
        import copy

        import torch

        dry = copy.copy(self.pipe)
        dry.__dict__ = dict(self.pipe.__dict__)
        scheduler = copy.deepcopy(self.pipe.scheduler)

        def first_step(*_, **__):
            raise _FirstStep()

        scheduler.step = first_step
        object.__setattr__(dry, "scheduler", scheduler)
        meta, forward = self.meta, type(self.meta).forward

        def checked_forward(*args, **kw):
            to_meta = lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v  # noqa: E731
            hooks = _watch_chains(meta, self.stacks)
            try:
                forward(meta, *map(to_meta, args), **{k: to_meta(v) for k, v in kw.items()})
            except NotAChain:
                raise
            except Exception as exc:
                raise _Refused(exc) from None
            finally:
                for h in hooks:
                    h.remove()
            raise _FirstStep()  # the first call went through at these shapes

        meta.forward = checked_forward
        object.__setattr__(dry, self.denoiser, meta)
        encode = getattr(self.pipe, "encode_prompt", None)
        if encode is not None:
            def kept(*args, **kw):
                if self.prompt is None:
                    self.prompt = (args, kw, encode(*args, **kw))
                return _cloned(self.prompt[2])  # what the dry call does to them leaves the kept answer as it was

            object.__setattr__(dry, "encode_prompt", kept)
        kwargs = dict(kwargs, generator=torch.Generator("cpu").manual_seed(0))
        try:
            with torch.no_grad():
                type(self.pipe).__call__(dry, **kwargs)
        except (_FirstStep, NotAChain) as done:
            if isinstance(done, NotAChain):
                raise
            return
        except _Refused as r:
            if "meta" in str(r.cause).lower():  # no meta kernel, or a value read: the dry call cannot tell
                raise _Skip(str(r.cause)) from None
            raise
        except Exception as exc:
            raise _Skip(f"{type(exc).__name__}: {exc}") from None
        finally:
            del meta.forward
        raise _Skip("the call ended without a scheduler step")


def _cloned(value):
    import torch

    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_cloned(v) for v in value)
    return value


class _Skip(Exception):
    """The dry call cannot stand for the real one here."""


def check_sizes(pipe, kwargs: dict, info, label: str, split: bool = True) -> None:
    """Refuse, in one line and before any node starts, a call whose shapes the denoiser's own forward
    refuses; the line names the largest height, width or frame count it takes where that alone is refused
    (the others at the size the model folder declares, else as asked). ``label``: the model as the user
    named it. ``split``: the run is to be split, so its stacks must also be chains (``NotAChain``)."""
    if info.subject.autoregressive or not info.subject.denoiser:
        return
    stacks = [] if info.subject.several or not split else [s.path for s in info.draft["stacks"]]
    try:
        dry = DryPipeline(pipe, info.subject.denoiser, stacks)
        dry.run(kwargs)
        hand_over(pipe, dry.prompt)
        return
    except _Skip:
        return
    except NotAChain as exc:
        raise DiffuseError(f"cannot split {label}: {exc}; nothing was started") from None
    except _Refused as refused:
        cause = " ".join(str(refused.cause).split())
    asked = {k: kwargs[k] for k in SIZE_ARGS if k in kwargs}
    what = ", ".join(f"{v} {SIZE_WORDS[k]}" for k, v in asked.items()) or "these arguments"
    takes = []
    base = dict(kwargs, **{k: v for k, v in info.call_defaults().items() if k in asked})
    for name, value in asked.items():
        alone = dict(base, **{name: value})
        try:
            dry.run(alone)
            continue  # this size is not the one refused
        except (_Refused, _Skip):
            pass
        best = largest_taken(dry, pipe, alone, name, value)
        if best is not None:
            takes.append(f"{name.replace('num_', '')} up to {best}")
    hint = f"; it takes {', '.join(takes)}" if takes else ""
    raise DiffuseError(f"{label} cannot make {what}: the denoiser's own forward refuses these shapes ({cause[:200]})"
                       f"{hint}; nothing was started")


def hand_over(pipe, kept: tuple | None) -> None:
    """The prompt the dry call encoded serves the real call's first ``encode_prompt`` when that asks the
    same (the same function on the same arguments: the same tensors), so the check costs no second encoding;
    any other first call goes through. Either way the pipeline's own method shows through again after."""
    import torch

    if kept is None:
        return
    args, kw, answer = kept
    if any(isinstance(v, torch.Tensor) for v in (*args, *kw.values())):
        return

    def once(*a, **k):
        del pipe.encode_prompt
        try:
            same = bool(a == args and k == kw)
        except Exception:  # values that do not compare as a whole (arrays): not the same call, as far as known
            same = False
        return answer if same else pipe.encode_prompt(*a, **k)

    pipe.encode_prompt = once


SEARCH_UP_TO = {"height": 4096, "width": 4096, "num_frames": 1024}  # where ``largest_sizes`` looks for a bound
PROBE_PROMPT = "a shape"


def largest_sizes(path: str) -> dict | None:
    """For a folder that declares the size it was made for (``diffuse_defaults.json``): that size
    (``made_for``) and, for each of height, width and frame count alone (the others as made for), the largest
    value the pipeline's input check and its denoiser's forward take, or None where nothing up to
    ``SEARCH_UP_TO`` was refused (``largest``). Kept in the folder's verdict (``diffuse.cli.check.keep``), so
    ``diffuse.cli.check.kept_refusal`` can refuse a size before torch is imported. Loads the pipeline without its blocks."""
    import diffuse

    pipe = diffuse.from_pretrained(path)
    info = pipe._diffuse
    made_for = {k: v for k, v in info.call_defaults().items() if k in SIZE_ARGS}
    if not made_for or not info.subject.denoiser:
        return None
    base = dict(info.call_defaults(), prompt=PROBE_PROMPT, output_type="np")
    dry = DryPipeline(pipe, info.subject.denoiser)
    dry.run(base)  # the size it was made for goes through (else the verdict has no ground to stand on)
    largest = {}
    for name in made_for:
        top = SEARCH_UP_TO[name] + 1
        best = largest_taken(dry, pipe, base, name, top, deadline_s=None)
        taken_all = best is not None and not any(_input_check_takes(pipe, dict(base, **{name: v}))
                                                 for v in range(best + 1, top))
        largest[name] = None if best is None or taken_all else best
    return {"made_for": made_for, "largest": largest, "prompt": PROBE_PROMPT}


def largest_taken(dry: DryPipeline, pipe, kwargs: dict, name: str, asked: int,
                  deadline_s: float | None = SEARCH_S) -> int | None:
    """The largest value of ``name`` below ``asked`` that the pipeline's input check and the dry call both
    take, the other arguments as given (a binary search: a size that fits means every smaller one does), or None
    after ``deadline_s`` seconds (None: no limit)."""
    candidates = [v for v in range(1, asked) if _input_check_takes(pipe, dict(kwargs, **{name: v}))]
    lo, hi, best = 0, len(candidates) - 1, None
    deadline = time.monotonic() + (deadline_s if deadline_s is not None else float("inf"))
    while lo <= hi:
        if time.monotonic() > deadline:
            return None  # a slow forward: the refusal stands without the bound
        mid = (lo + hi) // 2
        try:
            dry.run(dict(kwargs, **{name: candidates[mid]}))
            best, lo = candidates[mid], mid + 1
        except _Refused:
            hi = mid - 1
        except _Skip:
            return best
    return best


def _input_check_takes(pipe, kwargs: dict) -> bool:
    try:
        check_inputs(pipe, kwargs)
        return True
    except DiffuseError:
        return False


def check_inputs(pipe, kwargs: dict) -> None:
    """The pipeline's own input check, run before any node starts: what it refuses is refused now,
    in one line. An argument the check takes that the call does not give gets the pipeline call's
    own default (PixArt checks ``callback_steps``, which its call defaults to 1), else None; a check
    that cannot be called that way is skipped, not guessed at."""
    fn = getattr(pipe, "check_inputs", None)
    if fn is None:
        return
    call_defaults = {n: p.default for n, p in inspect.signature(pipe.__call__).parameters.items()
                     if p.default is not inspect.Parameter.empty}
    given = {}
    for name, p in inspect.signature(fn).parameters.items():
        if name in kwargs:
            given[name] = kwargs[name]
        elif name in call_defaults:
            given[name] = call_defaults[name]
        elif p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            given[name] = None
    try:
        fn(**given)
    except ValueError as exc:
        raise DiffuseError(f"{type(pipe).__name__} refuses these arguments: {' '.join(str(exc).split())}") from None
    except (TypeError, AttributeError):
        pass


def notes(pipe, kwargs: dict, info) -> list[str]:
    """One-line warnings for a run that will go through but make little: see the module's docstring."""
    out = []
    made_for = {k: v for k, v in info.call_defaults().items() if k in SIZE_ARGS}
    if made_for and any(kwargs.get(k, v) != v for k, v in made_for.items()):
        asked = ", ".join(f"{kwargs.get(k, v)} {SIZE_WORDS[k]}" for k, v in made_for.items())
        trained = ", ".join(f"{v} {SIZE_WORDS[k]}" for k, v in made_for.items())
        out.append(f"note: this model was made for {trained}; at {asked} expect little of the prompt in the output")
    prompt = kwargs.get("prompt")
    if isinstance(prompt, str):
        if not prompt.strip():
            out.append("note: the prompt is empty: the model makes what it makes unprompted")
        else:
            unknown = unknown_words(getattr(pipe, "tokenizer", None), prompt)
            if unknown:
                out.append(f"note: the model's tokenizer does not know {', '.join(repr(w) for w in unknown)} "
                           f"(read as its unknown token); the rest of the prompt steers the output")
    return out


def unknown_words(tokenizer, prompt: str) -> list[str]:
    """Words of ``prompt`` that ``tokenizer`` reads as its unknown token."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if tokenizer is None or unk is None:
        return []
    try:
        if unk not in tokenizer(prompt, add_special_tokens=False)["input_ids"]:
            return []
        return [w for w in dict.fromkeys(prompt.split())
                if unk in tokenizer(w, add_special_tokens=False)["input_ids"]]
    except Exception:
        return []


def call_kwargs(call, pipe, info) -> dict:
    """The pipeline's call arguments for ``call``: each flag given and each ``--arg`` checked against what its
    ``__call__`` takes, the folder's declared defaults, the seeded generator; checked by the pipeline's own input
    check (``diffuse.client.dryrun.check_inputs``)."""
    import torch

    params = inspect.signature(type(pipe).__call__).parameters
    kwargs = {}
    for flag, (name, value) in call.named().items():
        if name not in params:
            raise DiffuseError(f"--{flag.replace('_', '-')} does not apply: {type(pipe).__name__} takes no {name!r}")
        kwargs[name] = value
    for key, value in call.args.items():
        if key not in params and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            raise DiffuseError(f"--arg {key}: {type(pipe).__name__}.__call__ has no such argument")
        kwargs[key] = value
        default = params[key].default if key in params else None
        if isinstance(default, (int, float)) and not isinstance(default, bool) and (
                not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise DiffuseError(f"--arg {key}={json.dumps(value) if not isinstance(value, str) else value}: "
                               f"{type(pipe).__name__} takes a number there (default {default!r})")
    for k, v in info.call_defaults().items():  # what the folder declares for its size (the embedded model does)
        if k in params:
            kwargs.setdefault(k, v)
    kwargs["generator"] = torch.Generator("cpu").manual_seed(call.seed)
    kwargs["output_type"] = "np"
    check_inputs(pipe, kwargs)
    return kwargs


def checked_call(call, pipe, info, label: str, split: bool = True) -> tuple[dict, list[str]]:
    """The pipeline's call arguments for ``call`` (``call_kwargs``: its own input check included), checked
    against the denoiser's forward run weightless at the call's shapes (``check_sizes``), and the one-line
    notes on a run that will go through but make little (``notes``)."""
    kwargs = call_kwargs(call, pipe, info)
    check_sizes(pipe, kwargs, info, label, split=split)
    return kwargs, notes(pipe, kwargs, info)
