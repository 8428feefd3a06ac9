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
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from diffuse import cli
from diffuse.request import PipelineCall, QueryRequest  # noqa: E402


def build_parser():
    """The flags of ``diffuse query`` (``diffuse.cli.query_parser``)."""
    from diffuse.cli import query_parser

    return query_parser()


def generate(a: argparse.Namespace, console) -> dict:
    """One run of the pipeline, whole (``--whole``) or split; writes the output; returns the report.
    The flags become a typed request once, here at the top (``diffuse.cli.query_request``), and each part
    takes only the piece of it it needs. Everything that can be checked is checked before a node starts: the
    flags, then the model and the request against it (``diffuse.modelread``), then (once the pipeline without
    its blocks has loaded) its own input check and its denoiser's forward at the call's shapes, run weightless
    (``diffuse.dryrun``). A status line says what happens at each phase, the first within a second of start."""
    from diffuse.modelread import read_model

    t0 = time.perf_counter()
    q = cli.query_request(a)
    q, model = read_model(q, console)
    if q.ring.nodes is None and not q.model.whole:
        from diffuse.localnodes import warm_launcher

        warm_launcher()  # its imports run while this process loads the model
    if model.info.subject.autoregressive:
        from diffuse.lm import generate_text

        return generate_text(q, console, model.info)
    return generate_pipeline(q, console, model, t0)


def generate_pipeline(q: QueryRequest, console, model, t0: float) -> dict:
    """A diffusion pipeline's run of request ``q``, its ``model`` read (``diffuse.modelread.read_model``):
    loaded and checked, split, called, its output written and its report made (``diffuse.output``)."""
    from diffuse import output
    from diffuse.api import open_split

    pipe, kwargs = load_checked(q.model.whole, q.call, model, console, q.output.quiet)
    times = {"load": time.perf_counter() - t0}
    with contextlib.ExitStack() as held:
        t1 = time.perf_counter()
        split = None if q.model.whole else open_split(q.ring, pipe, held, console, q.output.quiet)
        times["nodes"] = time.perf_counter() - t1
        result, steps, times["pipeline"] = cli.run_with_steps(pipe, kwargs, console, q.output.quiet)
        times["denoising"] = steps["denoising"]
    return output.finish(result, q, pipe, kwargs, split, dict(times, steps=steps["steps"], t0=t0), console)


def load_checked(whole: bool, call: PipelineCall, model, console, quiet: bool):
    """The pipeline of ``model`` (its info, name and compute, from ``diffuse.modelread.read_model``) loaded
    (``whole``, else without the blocks the nodes will hold) and the call's arguments, checked against the
    denoiser's forward run weightless at the call's shapes (``diffuse.dryrun.checked_call``)."""
    from diffuse.api import load_whole_or_shell
    from diffuse.dryrun import checked_call

    info, name, compute = model
    stacks = ", ".join(f"{s.path} ({s.length})" for s in info.draft["stacks"])
    pipeline = info.subject.model_index.get("_class_name", "the pipeline")
    with cli.phase(console, f"{pipeline}, block stacks {stacks}: loading it"
                   f"{' whole' if whole else ' without the blocks the nodes will hold'}", quiet):
        pipe = load_whole_or_shell(info, compute, shell=not whole)
        pipe._diffuse = info
        kwargs, notes = checked_call(call, pipe, info, name, split=not whole)
    for note in notes:
        cli.status(console, note, quiet)
    return pipe, kwargs


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
