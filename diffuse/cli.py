"""The ``diffuse`` command: query (run), chat, node, plan, check, verify, plugins."""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

USAGE = """usage: diffuse COMMAND ...

commands:
  query ...            generate (the same as python -m diffuse.run ...)
  chat [--model DIR]   talk with a language model split over a ring, turn by turn (default: tiny-qwen-chat)
  node ...             serve a slice of a model (python -m diffuse.node ...)
  plan MODEL --nodes N print the slicing plan as JSON
  check MODEL          verdict from config.json files alone: stacks, output kind, patching
  verify MODEL ...     run whole and split, print the maximum absolute difference
  plugins              list installed plugins
"""


def cmd_plan(argv: list[str]) -> int:
    from rich.console import Console

    from diffuse.errors import DiffuseError
    from diffuse.modelfiles import resolve_model
    from diffuse.planner import analyze, make_plan

    ap = argparse.ArgumentParser(prog="diffuse plan")
    ap.add_argument("model")
    ap.add_argument("--nodes", type=int, default=2, help="how many nodes to split over")
    a = ap.parse_args(argv)
    try:
        subject, draft = analyze(resolve_model(a.model))
        plan = make_plan(subject, draft, [f"node{i + 1}" for i in range(a.nodes)])
    except DiffuseError as exc:
        from diffuse.run import report_error

        return report_error(Console(stderr=True), exc)
    print(plan.to_json())
    return 0


def cmd_check(argv: list[str]) -> int:
    from rich.console import Console

    from diffuse.check import print_check
    from diffuse.errors import DiffuseError
    from diffuse.modelfiles import resolve_model

    ap = argparse.ArgumentParser(prog="diffuse check")
    ap.add_argument("model")
    a = ap.parse_args(argv)
    console = Console()
    try:
        return print_check(resolve_model(a.model), console, cache=True)
    except DiffuseError as exc:
        from diffuse.run import report_error

        return report_error(console, exc)


def cmd_verify(argv: list[str]) -> int:
    import numpy as np
    import torch
    from rich.console import Console

    import diffuse
    from diffuse.api import ModelInfo
    from diffuse.errors import DiffuseError
    from diffuse.planner import load_pipeline
    from diffuse.run import build_parser, call_kwargs, output_array, report_error

    ap = build_parser()
    ap.prog = "diffuse verify"
    ap.description = "Run the model whole and split with the same arguments; print the largest difference."
    ap.add_argument("model_pos", nargs="?", metavar="MODEL")
    a = ap.parse_args(argv)
    a.model = a.model or a.model_pos
    console = Console(stderr=True)
    try:
        if a.threads:
            torch.set_num_threads(a.threads)
        info = ModelInfo.of(a.model)
        whole = load_pipeline(info.path)
        with torch.no_grad():
            reference = output_array(whole(**call_kwargs(a, whole, info)))
        del whole
        pipe = diffuse.from_pretrained(info.path)
        with diffuse.split(pipe, nodes=a.nodes, local_nodes=a.local_nodes, patches=a.patches, threads=a.threads,
                           timeout=a.timeout, local_transport=a.local_transport), torch.no_grad():
            split = output_array(pipe(**call_kwargs(a, pipe, info)))
    except DiffuseError as exc:
        return report_error(console, exc)
    diff = float(np.abs(reference.astype(np.float64) - split).max())
    same = reference.tobytes() == split.tobytes()
    print(f"max abs difference, whole vs split ({a.patches} patch{'es' if a.patches > 1 else ''}): {diff:.3g}"
          f"{'  (byte-identical)' if same else ''}")
    return 0 if (same or a.patches > 1) else 1


def cmd_plugins(argv: list[str]) -> int:
    from diffuse.plugins import plugin_manager

    pm = plugin_manager()
    for plugin in pm.get_plugins():
        name = pm.get_name(plugin)
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or [])
        print(f"{name:12s} {getattr(plugin, '__name__', plugin)}  {', '.join(hooks)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd in ("query", "run"):
        from diffuse.run import main as run_main

        return run_main(rest)
    if cmd == "chat":
        from diffuse.lm import chat_main

        return chat_main(rest)
    if cmd == "node":
        from diffuse.node import main as node_main

        return node_main(rest)
    commands = {"plan": cmd_plan, "check": cmd_check, "verify": cmd_verify, "plugins": cmd_plugins}
    if cmd not in commands:
        print(f"diffuse: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return commands[cmd](rest)


if __name__ == "__main__":
    sys.exit(main())
