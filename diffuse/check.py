"""`diffuse check MODEL`: the verdict and its reasons, from config.json files alone (no weights read)."""

from __future__ import annotations

import time

from diffuse.analysis import ModelSubject
from diffuse.errors import RefusedModel
from diffuse.plan import PATCHABLE, UNCUT_STEPS

SPLITTABLE, REFUSED = "splittable", "refused"
EXIT_CODES = {SPLITTABLE: 0, REFUSED: 2}


def check(path: str) -> dict:
    """Run the config-phase analyzers on a local pipeline folder and sum up what they found.

    Returns a plain dict: ``verdict`` ("splittable" or "refused"), ``reason``
    (the refusal, or None), ``denoiser``, ``stacks`` (path, length, config key,
    block class, params per block, width, two-stream and why), ``output_kind``,
    ``frame_rate``, ``sample_rate``, ``patches`` (how ``--patches P>1`` will run),
    ``other_lists`` and ``seconds``.
    """
    start = time.perf_counter()
    subject = ModelSubject.from_path(path)
    result = {"model": path, "denoiser": f"{subject.denoiser}: {subject.denoiser_class_name}" if subject.denoiser else None}
    try:
        from diffuse.planner import config_draft

        draft = config_draft(subject)
    except RefusedModel as exc:
        return {**result, "verdict": REFUSED, "reason": exc.reason, "stacks": [],
                "seconds": time.perf_counter() - start}
    two, why = draft.get("two_stream", {}), draft.get("two_stream_evidence", {})
    stacks = [{
        "path": s.path, "length": s.length, "config_key": s.config_key, "block_class": s.block_class,
        "params_per_block": s.params_per_block, "width": draft.get("stack_widths", {}).get(s.path),
        "two_stream": bool(two.get(s.path)), "two_stream_evidence": why.get(s.path),
        "patch_policy": UNCUT_STEPS if two.get(s.path) else PATCHABLE,
    } for s in draft["stacks"]]
    return {
        **result,
        "verdict": SPLITTABLE,
        "reason": None,
        "stacks": stacks,
        "output_kind": draft.get("output_kind"),
        "output_evidence": draft.get("output_evidence"),
        "frame_rate": draft.get("frame_rate"),
        "sample_rate": draft.get("sample_rate"),
        "patches": UNCUT_STEPS if any(s["two_stream"] for s in stacks) else PATCHABLE,
        "other_lists": draft.get("other_lists", {}),
        "seconds": time.perf_counter() - start,
    }


def print_check(path: str, console=None) -> int:
    """Print the verdict (first line: "splittable" or "refused: <reason>") and what it rests on.

    Returns the exit status for ``diffuse check``: 0 splittable, 2 refused.
    """
    from rich.console import Console

    console = console or Console()
    r = check(path)
    if r["verdict"] == REFUSED:
        console.print(f"[bold red]refused[/]: {r['reason']}", highlight=False)
        console.print(f"model {path} ({r['denoiser']}), checked in {r['seconds']:.2f} s", style="dim", highlight=False)
        return EXIT_CODES[REFUSED]
    console.print("[bold green]splittable[/]", highlight=False)
    console.print(f"model {path} ({r['denoiser']}), checked in {r['seconds']:.2f} s from config.json alone",
                  style="dim", highlight=False)
    console.print("block stacks, in call order:", highlight=False)
    for s in r["stacks"]:
        console.print(f"  [bold]{s['path']}[/]: {s['length']} x {s['block_class'].rpartition('.')[2]}, sized by "
                      f"{s['config_key'] or '(no config setting found)'}, width {s['width']}, "
                      f"{s['params_per_block']:,} params per block, {'two streams' if s['two_stream'] else 'one stream'}",
                      highlight=False)
        console.print(f"    {s['two_stream_evidence']}", style="dim", highlight=False)
    rates = ", ".join(x for x in (r["frame_rate"] and f"{r['frame_rate']} fps",
                                  r["sample_rate"] and f"{r['sample_rate']} Hz") if x)
    console.print(f"output: {r['output_kind']}{f' ({rates})' if rates else ''}  [dim]({r['output_evidence']})[/]",
                  highlight=False)
    if r["patches"] == UNCUT_STEPS:
        two = ", ".join(s["path"] for s in r["stacks"] if s["two_stream"])
        console.print(f"--patches: steps run uncut (blocks of {two} carry two streams)", highlight=False)
    else:
        console.print("--patches: patchable (every stack carries one stream)", highlight=False)
    for p, what in r["other_lists"].items():
        console.print(f"note: {p} holds {what}; it is not a stack and runs on the client", highlight=False)
    return EXIT_CODES[SPLITTABLE]
