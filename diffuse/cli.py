"""The ``diffuse`` command: query (run), node, plan, check, verify, plugins."""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

USAGE = """usage: diffuse COMMAND ...

commands:
  query ...            generate (the same as python -m diffuse.run ...)
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
        return print_check(resolve_model(a.model), console)
    except DiffuseError as exc:
        from diffuse.run import report_error

        return report_error(console, exc)


def cmd_verify(argv: list[str]) -> int:
    import copy
    import tempfile

    import numpy as np
    from rich.console import Console

    from diffuse.errors import DiffuseError
    from diffuse.run import build_parser, generate

    ap = build_parser()
    ap.prog = "diffuse verify"
    ap.add_argument("model_pos", nargs="?", metavar="MODEL")
    a = ap.parse_args(argv)
    a.model = a.model or a.model_pos
    console = Console(stderr=True)
    arrays = {}
    with tempfile.TemporaryDirectory(prefix="diffuse-verify-") as tmp:
        try:
            for whole in (True, False):
                b = copy.copy(a)
                b.whole, b.quiet, b.report = whole, True, None
                b.save_array = os.path.join(tmp, f"{int(whole)}.npy")
                b.out = os.path.join(tmp, f"{int(whole)}")  # the writer adds the suffix for the kind
                generate(b, console)
                arrays[whole] = np.load(b.save_array)
        except DiffuseError as exc:
            from diffuse.run import report_error

            return report_error(console, exc)
    diff = float(np.abs(arrays[True].astype(np.float64) - arrays[False]).max())
    same = arrays[True].tobytes() == arrays[False].tobytes()
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
