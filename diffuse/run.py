"""``python -m diffuse.run``: generate with a model split over a ring of nodes.

The pipeline's own ``__call__`` runs here, unmodified; its block stacks are
replaced by stand-ins that send hidden states through the ring. Flags that are
not given are not passed, so the pipeline's own defaults hold. A transformers
model folder (a language model, with or without a vision tower) generates text
instead: see ``diffuse.lm``.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import sys
import time
from contextlib import contextmanager, nullcontext

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from diffuse.text import plain
from diffuse.errors import DiffuseError  # noqa: E402

FLAG_TO_ARG = {  # flag -> pipeline __call__ argument
    "prompt": "prompt", "negative_prompt": "negative_prompt", "steps": "num_inference_steps",
    "height": "height", "width": "width", "frames": "num_frames",
}


def positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is less than 1")
    return n


def threshold(text: str) -> float:
    from diffuse.firstblock import checked_threshold

    try:
        return checked_threshold(float(text))
    except (ValueError, DiffuseError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of 0 or more") from None


class Parser(argparse.ArgumentParser):
    """A flag mistake is one line and exit status 2, before anything is loaded or started."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="python -m diffuse.run", description=plain(__doc__.split("\n")[0]))
    ap.add_argument("--model", help="a diffusers pipeline folder or a transformers model folder, a shipped model's "
                    "name, or a Hub id in the local cache (default: the embedded tiny model)")
    ap.add_argument("--prompt")
    ap.add_argument("--negative-prompt")
    ap.add_argument("--steps", type=positive, help="denoising steps (default: the pipeline's)")
    ap.add_argument("--patches", type=positive, default=1, help="patches per step (1: exact; >1: PipeFusion)")
    ap.add_argument("--cache-threshold", type=threshold, default=0.0, metavar="T",
                    help="first-block cache: skip the rest of a step's blocks where the first block's residual "
                    "changed less than T (relative) since the last step computed in full, reusing what each node's "
                    "blocks added then (default 0: off, exact)")
    ap.add_argument("--seed", type=int, default=0, help='generator=torch.Generator("cpu").manual_seed(SEED)')
    ap.add_argument("--height", type=positive)
    ap.add_argument("--width", type=positive)
    ap.add_argument("--frames", type=positive, help="video frames (num_frames)")
    ap.add_argument("--nodes", help="comma-separated node addresses, each optionally #HEXKEY to pin its key; "
                    "';' separates groups, each a whole ring, that run guidance branches side by side")
    ap.add_argument("--local-nodes", type=positive, default=None, help="start N nodes on this machine (default 2; "
                    "never more than the longest stack has blocks)")
    ap.add_argument("--placement", choices=("planned", "even"), default="planned",
                    help="for nodes started without --blocks: slices planned from each node's memory and speed "
                    "(default), or even slices; either is refused, with the shortfall, where it does not fit")
    ap.add_argument("--branch-groups", type=positive, default=1, metavar="G",
                    help="with --local-nodes: share the local nodes out into G groups, one per guidance branch, "
                    "which then run side by side (default 1)")
    ap.add_argument("--local-transport", default="tcp", metavar="SCHEME",
                    help="URL scheme local nodes listen on (tcp; ipc with the diffuse-ipc plugin)")
    ap.add_argument("--out", help="output file (.png / .mp4 / .wav by what the model makes)")
    ap.add_argument("--save-array", metavar="FILE.npy", help="save the float32 array the pipeline returns")
    ap.add_argument("--whole", action="store_true", help="run unsplit in this process (the reference)")
    ap.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                    help="any other pipeline argument; VALUE is JSON where it parses, else a string")
    ap.add_argument("--threads", type=positive, help="torch threads here and on local nodes; equal bits need equal "
                    "counts here, on every node and in the run compared with (default: torch's here, and at "
                    "--patches 1 the same on local nodes, so a default run equals a default whole run)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one pass through the ring may take while "
                    "every node still answers pings (a dead or frozen node is named within seconds regardless)")
    ap.add_argument("--client-key", metavar="FILE", help="this client's long-term identity (created 0600 if "
                    "missing; its public key is printed), for nodes run with --allow-client; default: a fresh one per run")
    ap.add_argument("--report", metavar="FILE.json", help="write run statistics as JSON")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    from diffuse import lm

    lm.add_flags(ap, positive)
    return ap


def parse_value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def call_kwargs(a: argparse.Namespace, pipe, info) -> dict:
    import torch

    params = inspect.signature(type(pipe).__call__).parameters
    kwargs = {}
    for flag, name in FLAG_TO_ARG.items():
        value = getattr(a, flag)
        if value is None:
            continue
        if name not in params:
            raise DiffuseError(f"--{flag.replace('_', '-')} does not apply: {type(pipe).__name__} takes no {name!r}")
        kwargs[name] = value
    for item in a.arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise DiffuseError(f"--arg {item!r}: expected KEY=VALUE")
        if key not in params and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            raise DiffuseError(f"--arg {key}: {type(pipe).__name__}.__call__ has no such argument")
        kwargs[key] = parse_value(value)
        default = params[key].default if key in params else None
        if isinstance(default, (int, float)) and not isinstance(default, bool) and (
                not isinstance(kwargs[key], (int, float)) or isinstance(kwargs[key], bool)):
            raise DiffuseError(f"--arg {key}={value}: {type(pipe).__name__} takes a number there "
                               f"(default {default!r})")
    for k, v in info.call_defaults().items():  # what the folder declares for its size (the embedded model does)
        if k in params:
            kwargs.setdefault(k, v)
    kwargs["generator"] = torch.Generator("cpu").manual_seed(a.seed)
    kwargs["output_type"] = "np"
    check_inputs(pipe, kwargs)
    return kwargs


def check_inputs(pipe, kwargs: dict) -> None:
    """The pipeline's own input check, run before any node starts: what it refuses is refused now,
    in one line. An argument the check takes that the call does not give gets the pipeline call's
    own default (PixArt checks ``callback_steps``, which its call defaults to 1), else None; a check
    that cannot be called that way is skipped, not guessed at."""
    import inspect as _inspect

    fn = getattr(pipe, "check_inputs", None)
    if fn is None:
        return
    call_defaults = {n: p.default for n, p in _inspect.signature(pipe.__call__).parameters.items()
                     if p.default is not _inspect.Parameter.empty}
    given = {}
    for name, p in _inspect.signature(fn).parameters.items():
        if name in kwargs:
            given[name] = kwargs[name]
        elif name in call_defaults:
            given[name] = call_defaults[name]
        elif p.default is _inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            given[name] = None
    try:
        fn(**given)
    except ValueError as exc:
        raise DiffuseError(f"{type(pipe).__name__} refuses these arguments: {' '.join(str(exc).split())}") from None
    except (TypeError, AttributeError):
        pass


@contextmanager
def step_progress(pipe, quiet: bool):
    """One bar over the scheduler's steps; the scheduler's ``step`` is wrapped for the call only."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    sched = pipe.scheduler
    original = sched.step
    from rich.console import Console

    progress = Progress(TextColumn("denoising"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        disable=quiet, transient=False, console=Console(stderr=True))
    task = progress.add_task("steps", total=None)
    counter = {"steps": 0, "denoising": 0.0}
    started = time.perf_counter()

    # wraps() keeps step's signature visible: pipelines pass generator/eta only if step declares them
    @functools.wraps(original)
    def step(*args, **kwargs):
        if progress.tasks[task].total is None and getattr(sched, "timesteps", None) is not None:
            progress.update(task, total=len(sched.timesteps))
        out = original(*args, **kwargs)
        counter["steps"] += 1
        counter["denoising"] = time.perf_counter() - started  # from the call to the last step: text encoding and steps
        progress.advance(task)
        return out

    sched.step = step
    try:
        with progress:
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
    Everything that can be checked is checked before a node starts (the pipeline's own input check
    needs the loaded pipeline, so local nodes start after it has loaded)."""
    import torch

    import diffuse
    from diffuse.api import ModelInfo, Split
    from diffuse.known_nodes import parse_nodes
    from diffuse.planner import load_pipeline

    t0 = time.perf_counter()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.nodes is not None:
        from diffuse.branches import parse_groups

        for group in parse_groups(a.nodes):
            parse_nodes(group)  # address and key mistakes, before anything is loaded
    info = ModelInfo.of(a.model)  # refusals happen here, before any node is contacted
    if a.nodes is None and not a.whole:
        from diffuse.localnodes import warm_launcher

        warm_launcher()  # its imports run while this process loads the model
    if info.subject.autoregressive:
        from diffuse.lm import generate_text

        return generate_text(a, console, info, parse_value)
    for flag in ("max_new_tokens", "temperature", "top_p", "top_k", "save_tokens"):
        if getattr(a, flag) is not None:
            raise DiffuseError(f"--{flag.replace('_', '-')} applies to language models, not to a diffusion pipeline")
    if a.image or a.video or a.media or a.no_template or getattr(a, "embedding_on_node", False):
        raise DiffuseError("--image, --video, --media, --no-template and --embedding-on-node apply to language models")
    if a.cache_threshold and a.patches > 1:
        from diffuse.firstblock import not_with_patches

        raise DiffuseError(not_with_patches(a.patches))
    if a.cache_threshold and a.whole:
        raise DiffuseError("--cache-threshold applies to split runs; --whole runs the model as it is")
    check_output_path(a.out, info.draft)
    if a.whole:
        pipe = load_pipeline(info.path)
        pipe._diffuse = info
    else:
        pipe = diffuse.from_pretrained(info.path)
    kwargs = call_kwargs(a, pipe, info)
    report: dict = {"model": info.path, "mode": "whole" if a.whole else "split"}
    times = {"load": time.perf_counter() - t0}
    split = None
    if not a.whole:
        split = Split(pipe, nodes=a.nodes, local_nodes=a.local_nodes, patches=a.patches, threads=a.threads,
                      timeout=a.timeout, client_key=a.client_key, local_transport=a.local_transport,
                      branch_groups=a.branch_groups, cache_threshold=a.cache_threshold, placement=a.placement)
        if a.client_key:
            from diffuse.sealing import load_identity

            console.print(f"client key {load_identity(a.client_key).public_hex}", highlight=False, soft_wrap=True)
        if split.local is not None:
            for note in split.local.notes:
                console.print(note, soft_wrap=True)
            console.print(f"starting {split.local.count} local nodes ({split.local.threads} "
                          f"thread{'s' if split.local.threads > 1 else ''} each)")
    t1 = time.perf_counter()
    with split or nullcontext():
        if split is not None:
            for k, ring in enumerate(split.rings):
                for stage in ring.plan.route:
                    group = f" (group {k + 1})" if len(split.rings) > 1 else ""
                    console.print(f"  node {stage.address}{group}: {', '.join(map(str, stage.slices))}")
            if a.patches > 1 and split.ring.uncut:
                console.print(f"{', '.join(sorted(split.ring.uncut))}: two streams per block (image and text side "
                              f"by side), so steps run uncut there; --patches {a.patches} not applied", soft_wrap=True)
        times["nodes"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        with torch.no_grad(), step_progress(pipe, a.quiet) as steps:
            result = pipe(**kwargs)
        times["pipeline"] = time.perf_counter() - t2
        times["denoising"] = steps["denoising"]
    elapsed = time.perf_counter() - t0
    arr = output_array(result)
    report.update(seconds=elapsed, steps=steps["steps"], shape=list(arr.shape), kind=info.output_kind, times=times)
    if split is not None:
        st = split.ring.channel_stats
        report.update(
            transport=split.ring.scheme, calls=st.passes, bytes_sent=st.bytes_sent, bytes_received=st.bytes_received,
            per_stack=st.per_stack, return_maps={k: v.to_dict() for k, v in split.splitter.plan.return_maps.items()},
            client_block_params=split.splitter.held_block_parameters(), client_reused=split.splitter.reused,
            node_params=[r.get("params") for r in split.node_reports], node_stats=split.node_reports,
            messages=st.messages, returns=st.returns)
        if len(split.rings) > 1:
            ring = split.ring
            report["branches"] = {"groups": len(split.rings), "ahead_used": ring.ahead_used,
                                  "ahead_dropped": ring.ahead_dropped, "batches_cut": ring.batches_cut}
        if a.cache_threshold:
            report["first_block_cache"] = {"threshold": a.cache_threshold, "skipped": split.cache_skipped,
                                           "calls": split.cache_calls, "per_stack": split.cache}
        if a.patches > 1:
            report.update(patches=a.patches, patcher_calls=split.patch_calls, patches_used=split.patches_used,
                          patches_ahead=split.patch_ahead,
                          uncut={k: v for k, v in split.uncut.items() if k not in split.ring.uncut},
                          attention=split.attention_paths())
    if a.save_array:
        np.save(a.save_array, arr.astype(np.float32, copy=False))
    rate = kwargs.get("frame_rate") or kwargs.get("fps")
    out = write_output(arr, a.out, dict(info.draft, frame_rate=rate) if rate else info.draft, pipe)
    report["out"] = out
    summarize(report, console)
    if a.report:
        with open(a.report, "w") as f:
            json.dump(report, f, indent=1, default=str)
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
    from rich.console import Console

    console = Console(stderr=True)
    a = build_parser().parse_args(argv)
    try:
        generate(a, console)
    except DiffuseError as exc:
        return report_error(console, exc)
    except KeyboardInterrupt:  # sessions are closed and local nodes stopped on the way out
        console.print("interrupted", highlight=False)
        if __name__ == "__main__":  # nothing is left to tear down: skip the interpreter's slow exit
            sys.stderr.flush()
            os._exit(130)
        return 130
    return 0


def report_error(console, exc: Exception) -> int:
    """An expected failure: one clear line, no traceback, exit status 2."""
    console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
    return 2


if __name__ == "__main__":
    sys.exit(main())
