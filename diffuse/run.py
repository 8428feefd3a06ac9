"""``python -m diffuse.run``: generate with a model split over a ring of nodes.

The pipeline's own ``__call__`` runs here, unmodified; its block stacks are
replaced by stand-ins that send hidden states through the ring. Flags that are
not given are not passed, so the pipeline's own defaults hold. A transformers
model folder (a language model, with or without a vision tower) generates text
instead: see ``diffuse.lm``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import os
import time
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from diffuse import cli
from diffuse.errors import DiffuseError  # noqa: E402
from diffuse.links import route_lines  # noqa: E402
from diffuse.request import ModelAsk, PipelineCall, QueryRequest, RingAsk  # noqa: E402


def build_parser():
    """The flags of ``diffuse query`` (``diffuse.cli.query_parser``)."""
    from diffuse.cli import query_parser

    return query_parser()


def call_kwargs(call: PipelineCall, pipe, info) -> dict:
    """The pipeline's call arguments for ``call``: each flag given and each ``--arg`` checked against what its
    ``__call__`` takes, the folder's declared defaults, the seeded generator; checked by the pipeline's own input
    check (``diffuse.dryrun.check_inputs``)."""
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
    from diffuse.dryrun import check_inputs

    check_inputs(pipe, kwargs)
    return kwargs


@contextmanager
def step_progress(pipe, quiet: bool, console=None):
    """Progress over the scheduler's steps (``diffuse.cli.StepLines``: a bar on a terminal, plain lines
    when output is piped); the scheduler's ``step`` is wrapped for the call only."""
    sched = pipe.scheduler
    original = sched.step
    counter = {"steps": 0, "denoising": 0.0}
    started = time.perf_counter()
    lines = cli.StepLines(console or cli.console(), "denoising", quiet)

    # wraps() keeps step's signature visible: pipelines pass generator/eta only if step declares them
    @functools.wraps(original)
    def step(*args, **kwargs):
        if getattr(sched, "timesteps", None) is not None:
            lines.set_total(len(sched.timesteps))
        out = original(*args, **kwargs)
        counter["steps"] += 1
        counter["denoising"] = time.perf_counter() - started  # from the call to the last step: text encoding and steps
        lines.advance()
        return out

    sched.step = step
    try:
        with lines:
            yield counter
    finally:
        del sched.step  # the bound method from the class shows through again


def output_array(result) -> np.ndarray:
    arr = result[0] if not isinstance(result, (np.ndarray,)) else result
    if hasattr(arr, "detach"):
        arr = arr.detach().cpu().float().numpy()
    return np.asarray(arr)


def generate(a: argparse.Namespace, console) -> dict:
    """One run of the pipeline, whole (``--whole``) or split; writes the output; returns the report.
    The flags become a typed request once, here at the top (``diffuse.cli.query_request``), and each part
    takes only the piece of it it needs. Everything that can be checked is checked before a node starts: the
    flags, then the model's config, then (once the pipeline without its blocks has loaded) its own input check
    and its denoiser's forward at the call's shapes, run weightless (``diffuse.dryrun``). A status line says
    what happens at each phase, the first within a second of start."""
    t0 = time.perf_counter()
    q = cli.query_request(a)
    model = read_model(q.model, q.call, console, q.output.quiet)
    q = cli.request_for(q, model.info.subject, console)  # --nodes auto: the nodes announced on this network
    if q.ring.nodes is None and not q.model.whole:
        from diffuse.localnodes import warm_launcher

        warm_launcher()  # its imports run while this process loads the model
    if model.info.subject.autoregressive:
        from diffuse.lm import generate_text

        return generate_text(q, console, model.info)
    return generate_pipeline(q, console, model, t0)


class ModelRead(NamedTuple):
    """What ``read_model`` found: the model's analysis (``diffuse.api.ModelInfo``), the name it was asked by,
    and where the client's ends compute (``diffuse.devices.Compute``)."""

    info: object
    name: str
    compute: object


def generate_pipeline(q: QueryRequest, console, model: ModelRead, t0: float) -> dict:
    """A diffusion pipeline's run of request ``q``, its ``model`` read (``read_model``): loaded and checked,
    split, called, its output written and its report made."""
    info = model.info
    out = q.output
    check_output_path(out.out, info.draft)
    pipe, kwargs = load_checked(q.model.whole, q.call, model, console, out.quiet)
    report: dict = {"model": info.path, "mode": "whole" if q.model.whole else "split"}
    times = {"load": time.perf_counter() - t0}
    split, starting = (None, None) if q.model.whole else make_split(q.ring, console, pipe)
    with contextlib.ExitStack() as held:
        t1 = time.perf_counter()
        if split is not None:
            open_split(split, starting, held, q.ring.options.patches, console, out.quiet)
        times["nodes"] = time.perf_counter() - t1
        result, steps, times["pipeline"] = run_pipeline(pipe, kwargs, console, out.quiet)
        times["denoising"] = steps["denoising"]
    arr = output_array(result)
    report.update(seconds=time.perf_counter() - t0, steps=steps["steps"], shape=list(arr.shape),
                  kind=info.output_kind, times=times)
    if split is not None:
        report.update(split_report(split, q.ring.options))
    if out.save_array:
        np.save(out.save_array, arr.astype(np.float32, copy=False))
    rate = kwargs.get("frame_rate") or kwargs.get("fps")
    report["out"] = write_output(arr, out.out, dict(info.draft, frame_rate=rate) if rate else info.draft, pipe)
    summarize(report, console)
    if out.report:
        with open(out.report, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return report


def refuse_early(path: str, label: str, call: PipelineCall) -> None:
    """What can be refused before torch and the model's library are imported (most of a first run's
    seconds): a folder that is no model, a model whose stored check refused it (``diffuse.check.stored``),
    and a size above what its kept verdict says its denoiser takes (``diffuse.dryrun.kept_refusal``; not
    with ``--arg``, which may change what the call's shapes are)."""
    from diffuse.analysis import ModelSubject
    from diffuse.check import REFUSED, kept, stored
    from diffuse.dryrun import kept_refusal
    from diffuse.errors import RefusedModel

    ModelSubject.from_path(path)
    _, verdict = stored(path)
    if verdict and verdict["verdict"] == REFUSED:
        raise RefusedModel(path, verdict["reason"])
    if verdict is None or call.args or verdict.get("output_kind") == "text":
        return
    line = kept_refusal((kept(path) or {}).get("sizes"), call.sizes(), label)
    if line:
        raise DiffuseError(line)


def read_model(ask: ModelAsk, call: PipelineCall, console, quiet: bool) -> ModelRead:
    """The model ``ask`` names (the shipped one by default), analysed from its config: its ``ModelInfo``, the
    name it was asked by, and where the client's ends compute. Refusals happen here, before any node is
    contacted."""
    from diffuse.modelfiles import resolve_model

    if ask.model is None:
        from diffuse.default_model import SHIPPED_MODEL_NAME, default_model_dir

        path, name = default_model_dir(), SHIPPED_MODEL_NAME
    else:
        path, name = resolve_model(ask.model), ask.model
    where = "" if os.path.basename(path.rstrip("/")) == name else f" from {path}"
    refuse_early(path, name, call)
    with cli.phase(console, f"diffuse query: {name}{where}; reading its config (importing torch and its library)",
                   quiet):
        import torch

        from diffuse.api import ModelInfo, client_compute

        if ask.threads:
            torch.set_num_threads(ask.threads)
        info = ModelInfo.of(path)
        return ModelRead(info, name, client_compute(info, ask.device, ask.dtype))


def load_checked(whole: bool, call: PipelineCall, model: ModelRead, console, quiet: bool):
    """The pipeline of ``model`` (its info, name and compute, from ``read_model``) loaded (``whole``, else
    without the blocks the nodes will hold) and the call's arguments, checked against the denoiser's forward
    run weightless at the call's shapes."""
    from diffuse.api import load_whole_or_shell
    from diffuse.dryrun import check_sizes, notes

    info, name, compute = model
    stacks = ", ".join(f"{s.path} ({s.length})" for s in info.draft["stacks"])
    pipeline = info.subject.model_index.get("_class_name", "the pipeline")
    with cli.phase(console, f"{pipeline}, block stacks {stacks}: loading it"
                   f"{' whole' if whole else ' without the blocks the nodes will hold'}", quiet):
        pipe = load_whole_or_shell(info, compute, shell=not whole)
        pipe._diffuse = info
        kwargs = call_kwargs(call, pipe, info)
        check_sizes(pipe, kwargs, info, name, split=not whole)
    for note in notes(pipe, kwargs, info):
        cli.status(console, note, quiet)
    return pipe, kwargs


def make_split(ring: RingAsk, console, pipe):
    """The ``Split`` the request's ``ring`` asks for (nothing started yet), and the line that says what opening
    it starts."""
    from diffuse.api import Split

    split = Split(pipe, ring.nodes, ring.options)
    if ring.options.client_key:
        from diffuse.sealing import load_identity

        console.print(f"client key {load_identity(ring.options.client_key).public_hex}", highlight=False,
                      soft_wrap=True)
    if split.local is None:
        return split, f"opening sessions on {len(split.nodes)} nodes"
    for note in split.local.notes:
        console.print(note, soft_wrap=True)
    return split, (f"starting {split.local.count} local nodes ({split.local.threads} "
                   f"thread{'s' if split.local.threads > 1 else ''} each)")


def open_split(split, starting: str, held: contextlib.ExitStack, patches: int, console, quiet: bool) -> None:
    """Start or dial the nodes (held open until ``held`` closes) and say which node holds what."""
    if quiet and split.local is not None:
        console.print(starting)  # said even with --quiet: processes are started
    with cli.phase(console, starting, quiet):
        held.enter_context(split)
    for k, ring in enumerate(split.rings):
        for stage in ring.plan.route:
            group = f" (group {k + 1})" if len(split.rings) > 1 else ""
            console.print(f"  node {stage.address}{group}: {', '.join(map(str, stage.slices))}")
    if patches > 1 and split.ring.uncut:
        console.print(f"{', '.join(sorted(split.ring.uncut))}: two streams per block (image and text side "
                      f"by side), so steps run uncut there; --patches {patches} not applied", soft_wrap=True)


def run_pipeline(pipe, kwargs: dict, console, quiet: bool):
    """The pipeline's own call, with progress: its result, the step counts, and its seconds."""
    import torch

    t = time.perf_counter()
    with torch.no_grad(), step_progress(pipe, quiet, console) as steps:
        result = pipe(**kwargs)
    return result, steps, time.perf_counter() - t


def split_report(split, options) -> dict:
    """What a split run adds to the report: the wire's figures, the return maps, what each side held, the links
    of its routes, and the figures of branch groups, the first-block cache and patches where ``options`` (the
    split's ``SplitOptions``) used them."""
    st = split.ring.channel_stats
    report = dict(
        transport=split.ring.scheme, calls=st.passes, bytes_sent=st.bytes_sent, bytes_received=st.bytes_received,
        per_stack=st.per_stack, return_maps={k: v.to_dict() for k, v in split.splitter.plan.return_maps.items()},
        client_block_params=split.splitter.held_block_parameters(), client_reused=split.splitter.reused,
        node_params=[r.get("params") for r in split.node_reports], node_stats=split.node_reports,
        messages=st.messages, returns=st.returns,
        links=[line for r in split.rings for line in route_lines([s.address for s in r.plan.route])])
    if len(split.rings) > 1:
        ring = split.ring
        report["branches"] = {"groups": len(split.rings), "ahead_used": ring.ahead_used,
                              "ahead_dropped": ring.ahead_dropped, "batches_cut": ring.batches_cut}
    if options.cache_threshold:
        report["first_block_cache"] = {"threshold": options.cache_threshold, "skipped": split.cache_skipped,
                                       "calls": split.cache_calls, "per_stack": split.cache}
    if options.patches > 1:
        report.update(patches=options.patches, patcher_calls=split.patch_calls, patches_used=split.patches_used,
                      patches_ahead=split.patch_ahead,
                      uncut={k: v for k, v in split.uncut.items() if k not in split.ring.uncut},
                      attention=split.attention_paths())
    return report


PROBE_SHAPES = {"image": (1, 8, 8, 3), "video": (1, 2, 8, 8, 3), "audio": (1, 1, 8)}


def check_output_path(out: str | None, draft: dict) -> None:
    """Fail before generating if no writer takes this file name for what the model makes."""
    import tempfile

    from diffuse.plugins import call_hook
    from diffuse.writers import DEFAULT_SUFFIX, OutputInfo

    kind = draft.get("output_kind", "image")
    suffix = os.path.splitext(out or "")[1] or DEFAULT_SUFFIX[kind]
    with tempfile.TemporaryDirectory(prefix="diffuse-probe-") as tmp:
        probe = os.path.join(tmp, "probe" + suffix)
        info = OutputInfo(kind=kind, frame_rate=16, sample_rate=8000)
        if call_hook("diffuse_write_output", result=np.zeros(PROBE_SHAPES[kind], np.float32), path=probe,
                     info=info) is None:
            raise DiffuseError(f"--out {out}: this model makes {kind}, and no output writer makes {kind} "
                               f"as {suffix}; use e.g. {DEFAULT_SUFFIX[kind]}")


def write_output(arr: np.ndarray, out: str | None, draft: dict, pipe) -> str:
    from diffuse.plugins import call_hook
    from diffuse.writers import DEFAULT_SUFFIX, OutputInfo

    kind = draft.get("output_kind", "image")
    out = out or "out"
    if not os.path.splitext(out)[1]:
        out += DEFAULT_SUFFIX[kind]
    info = OutputInfo(kind=kind, frame_rate=draft.get("frame_rate"), sample_rate=draft.get("sample_rate"))
    if kind == "audio" and not info.sample_rate:
        info.sample_rate = getattr(getattr(pipe, "vae", None), "config", {}).get("sampling_rate")
    written = call_hook("diffuse_write_output", result=arr, path=out, info=info)
    if written is None:
        raise DiffuseError(f"no output writer takes {kind} to {out!r}; use {DEFAULT_SUFFIX[kind]}")
    return written


def summarize(r: dict, console) -> None:
    line = f"[bold green]wrote[/] {r['out']}  ({r['kind']}, shape {tuple(r['shape'])}) in {r['seconds']:.1f} s"
    console.print(line)
    t = r.get("times") or {}
    if t:
        console.print(f"  start-up {t['load'] + t.get('nodes', 0):.1f} s (analysis and loading {t['load']:.1f} s, "
                      f"nodes and session {t.get('nodes', 0):.1f} s); pipeline {t['pipeline']:.1f} s "
                      f"(through the last step {t['denoising']:.1f} s, decoding {t['pipeline'] - t['denoising']:.1f} s)",
                      soft_wrap=True)
    if r.get("calls"):
        steps = max(1, r.get("steps") or 1)
        wire = r["bytes_sent"] + r["bytes_received"]
        console.print(f"  {r['calls']} ring passes, {wire / steps / 1024:.1f} KiB on the client's wire per step "
                      f"({wire / 1024:.1f} KiB in all)", soft_wrap=True)
        for i, ns in enumerate(r.get("node_stats") or [], 1):
            if ns:
                console.print(f"  node {i}: {ns.get('messages', 0)} messages, {ns.get('bytes_in', 0) / 1024:.1f} KiB in, "
                              f"{ns.get('bytes_out', 0) / 1024:.1f} KiB out, busy {ns.get('busy_s', 0.0):.1f} s",
                              soft_wrap=True)
        for line in r.get("links") or []:
            console.print(f"  link {line}", soft_wrap=True)
        fbc = r.get("first_block_cache")
        if fbc:
            from diffuse.firstblock import summary_line

            console.print(f"  {summary_line(fbc['per_stack'], fbc['threshold'])}", soft_wrap=True)
        b = r.get("branches")
        if b:
            console.print(f"  {b['groups']} groups of nodes: {b['batches_cut']} calls cut between them by batch, "
                          f"{b['ahead_used']} answered by a pass sent ahead ({b['ahead_dropped']} sent ahead unused)",
                          soft_wrap=True)
        if r.get("patches", 1) > 1:
            from diffuse.pipefusion import describe_paths

            for stack, used in (r.get("patches_used") or {}).items():
                why = f" ({used['why']})" if used.get("why") else ""
                console.print(f"  {stack}: patches used {used['used']} of {used['asked']} asked{why}", soft_wrap=True)
            for stack, why in r.get("uncut", {}).items():
                console.print(f"  {stack}: uncut steps ({why})", soft_wrap=True)
            ahead = r.get("patches_ahead") or {}
            if ahead.get("used") or ahead.get("dropped"):
                console.print(f"  calls sent ahead while the one before finished: {ahead['used']} used, "
                              f"{ahead['dropped']} dropped", soft_wrap=True)
            for line in describe_paths(r.get("attention", {})):
                console.print(f"  {line}", soft_wrap=True)


def main(argv: list[str] | None = None) -> int:
    """``diffuse query`` (``python -m diffuse.run``): exit status 0, 2 for an expected failure (one line,
    the root cause, last), 130 when interrupted."""
    console = cli.console()
    a = cli.query_parser().parse_args(argv)
    return cli.run_guarded(lambda: generate(a, console), console)


report_error = cli.report_error  # the reporter every command shares


if __name__ == "__main__":
    cli.quiet_libraries()
    cli.exit_now(main())
