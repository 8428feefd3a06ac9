"""Sizes checked before work starts: the pipeline's own call, run weightless.

``check_sizes`` runs the pipeline's ``__call__`` with its denoiser weightless
(``diffuse.client.weightless.DryPipeline``): it reads no weight and starts no
node, and the prompt it encodes is kept for the real call (``hand_over``). A
size the model cannot take fails there exactly as it would after loading and
starting nodes, and is refused in one line that names the largest sizes it
does take. A failure the dry call cannot stand for skips the check: it never
refuses a call the model would run. A stack whose blocks are not called as a
chain (``NotAChain``), or a model that reads a block's weights outside the
stack's loop (``ReadsBlocks``), is refused there too, before any node starts.

``largest_sizes`` runs the same search once for a model folder (each size alone, up to
``SEARCH_UP_TO``) for its kept verdict (``diffuse.cli.check.keep``); ``diffuse.cli.check.kept_refusal`` then
refuses a size above those bounds from the verdict alone, before torch is imported.

``call_kwargs`` turns a ``PipelineCall`` into the pipeline's call arguments,
checked by the pipeline's own input check (``check_inputs``); ``checked_call``
adds the size check and the notes.

``notes`` gives one-line warnings where a run would go through but make little:
a size other than the one a model folder declares it was made for
(``diffuse_defaults.json``), words its tokenizer does not know, an empty prompt.
"""

from __future__ import annotations

import inspect
import json
import time

from diffuse.errors import DiffuseError
from diffuse.errors import ReadsBlocks
from diffuse.client.weightless import DryPipeline, NotAChain, _Refused, _Skip

SEARCH_S = 6.0  # at most this long looking for the largest size taken, per size
SIZE_ARGS = ("height", "width", "num_frames")
SIZE_WORDS = {"height": "px high", "width": "px wide", "num_frames": "frames"}


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
    except (NotAChain, ReadsBlocks) as exc:
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
    from diffuse.client.api import from_pretrained

    pipe = from_pretrained(path)
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
