"""``python -m diffuse.run``: generate with a model split over a ring of nodes.

The pipeline's own ``__call__`` runs here, unmodified; its block stacks are
replaced by stand-ins that send hidden states through the ring. Flags that are
not given are not passed, so the pipeline's own defaults hold. A transformers
model folder (a language model, with or without a vision tower) generates text
instead: see ``diffuse.cli.language``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

from diffuse.home import libraries_offline  # noqa: E402

libraries_offline()

from diffuse.cli import parsing
from diffuse import flags
from diffuse.client import progress


def build_parser():
    """The flags of ``diffuse query`` (``diffuse.cli.parsing.query_parser``)."""
    from diffuse.cli.parsing import query_parser

    return query_parser()


def generate(a: argparse.Namespace, console) -> dict:
    """One run of the pipeline, whole (``--whole``) or split; writes the output; returns the report.

    The run goes down through its parts once each, in order: the flags become a typed request
    (``diffuse.cli.parsing.query_request``); the model it names is read and the request checked against it
    (``diffuse.cli.modelread``; a language model goes on in ``diffuse.cli.language``); the pipeline loads without its blocks
    and its call is checked by its own input check and its denoiser's forward run weightless at the call's
    shapes (``diffuse.client.dryrun.checked_call``); the nodes start or are dialled (``diffuse.cli.ringopen.open_split``); the
    pipeline's own call runs under progress (``diffuse.client.progress.run_with_steps``); the output is written and the
    run reported (``diffuse.client.output.finish``). Everything that can be checked is checked before a node starts, and a
    status line says what happens at each phase, the first within a second of start."""
    from diffuse.client import output
    from diffuse.client.api import load_whole_or_shell
    from diffuse.cli.ringopen import open_split
    from diffuse.client.dryrun import checked_call
    from diffuse.cli.modelread import quantize_client, read_model

    t0 = time.perf_counter()
    q = parsing.query_request(a)
    q, (info, name, compute) = read_model(q, console)
    whole, quiet = q.model.whole, q.output.quiet
    if q.ring.nodes is None and not whole:
        from diffuse.local.nodes import warm_launcher

        warm_launcher()  # its imports run while this process loads the model
    if info.subject.autoregressive:
        from diffuse.cli.language import generate_text

        return generate_text(q, console, info, compute)
    stacks = ", ".join(f"{s.path} ({s.length})" for s in info.draft["stacks"])
    pipeline = info.subject.model_index.get("_class_name", "the pipeline")
    with progress.phase(console, f"{pipeline}, block stacks {stacks}: loading it"
                        f"{' whole' if whole else ' without the blocks the nodes will hold'}", quiet):
        pipe = load_whole_or_shell(info, compute, shell=not whole, quantize=q.ring.options.quantize or "")
        quantize_client(pipe, info, q.model.quantize_client)
        kwargs, notes = checked_call(q.call, pipe, info, name, split=not whole)
    for note in notes:
        progress.status(console, note, quiet)
    times = {"load": time.perf_counter() - t0}
    with contextlib.ExitStack() as held:
        t1 = time.perf_counter()
        split = None if whole else open_split(q.ring, pipe, held, console, quiet)
        times["nodes"] = time.perf_counter() - t1
        result, steps, times["pipeline"] = progress.run_with_steps(pipe, kwargs, console, quiet)
        times["denoising"] = steps["denoising"]
    return output.finish(result, q, pipe, kwargs, split, dict(times, steps=steps["steps"], t0=t0), console)


def main(argv: list[str] | None = None) -> int:
    """``diffuse query`` (``python -m diffuse.run``): exit status 0, 2 for an expected failure (one line,
    the root cause, last), 130 when interrupted."""
    console = progress.console()
    a = parsing.query_parser().parse_args(argv)
    return parsing.run_guarded(lambda: generate(a, console), console)



def run_main() -> None:
    """``python -m diffuse.run``: the libraries quiet, the exit status the process's own."""
    flags.quiet_libraries()
    code = main()
    from diffuse.local.launcher import POOL

    POOL.close()  # the nodes' launcher ends and is reaped before this process ends (Ctrl-C too)
    flags.exit_now(code)
