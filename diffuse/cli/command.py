"""The ``diffuse`` command: the table of subcommands (``COMMANDS``: a new one is one entry), and the
dispatch to the one asked for.

This module imports only ``diffuse.flags`` at load time, and a subcommand's module only when that
subcommand runs, so ``diffuse --help`` and a flag mistake answer at once. The flags every process's
command shares are ``diffuse.flags``; those of ``query`` and ``chat``, every flag check before anything
loads, the typed request and the error reporter are ``diffuse.cli.parsing``. What a command says while
it works is ``diffuse.client.progress``.

A new subcommand is one entry in ``COMMANDS``, for example
``"serve": Command("diffuse.serve.command:main", "what it does", "--model DIR")``: a function that takes the
rest of the command line and returns the exit status, builds its flags with ``diffuse.flags.Parser``
(``diffuse.cli.parsing.ring_flags`` for the ring's), and runs its body under
``diffuse.cli.parsing.run_guarded`` for the shared error handling.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from dataclasses import dataclass
from diffuse.flags import exit_now
from diffuse.flags import quiet_libraries

from diffuse.home import libraries_offline  # noqa: E402

libraries_offline()


# ---------------------------------------------------------------- subcommands

@dataclass(frozen=True)
class Command:
    """A subcommand: ``target`` is "module:function", called with the rest of the command line and
    returning the exit status; imported only when the subcommand runs."""

    target: str
    summary: str
    usage: str = "..."

    def load(self):
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)


COMMANDS: dict[str, Command] = {
    "query": Command("diffuse.cli.query:main", "generate with a model split over a ring (also: generate, run)"),
    "chat": Command("diffuse.cli.language:chat_main", "talk with a language model split over a ring, turn by turn "
                    "(default: the embedded tiny-qwen-chat)", "[--model DIR]"),
    "node": Command("diffuse.node.command:main", "serve a slice of a model's blocks (python -m diffuse.node)"),
    "host": Command("diffuse.cli.host:main", "host a slice of a Hub model as a node; with no model, choose one "
                    "in a browser over the Hub's search", "[ORG/NAME --blocks K/N]"),
    "serve": Command("diffuse.serve.command:main", "an OpenAI-compatible HTTP service and a page, models kept warm "
                     "on a ring"),
    "key": Command("diffuse.cli.commands:key_main", "print this machine's node key (creating it if missing)",
                   "[--key-file FILE]"),
    "check": Command("diffuse.cli.commands:check_main", "the verdict from config.json files alone: stacks, output, "
                     "patching", "MODEL"),
    "plan": Command("diffuse.cli.plan:plan_command", "the slicing plan as JSON (--nodes N), or where its "
                    "slices go on given nodes (--nodes ADDR,... or --memory GiB,...)", "MODEL --nodes N|ADDR,..."),
    "verify": Command("diffuse.cli.commands:verify_main", "run whole and split, print the largest difference",
                      "MODEL ..."),
    "bench": Command("diffuse.bench.command:main", "speed and wire use, whole and split (python -m diffuse.bench)",
                     "[quality|cache|lm] ..."),
    "plugins": Command("diffuse.cli.commands:plugins_main", "list installed plugins", ""),
}
ALIASES = {"generate": "query", "run": "query"}


def version() -> str:
    try:
        from importlib.metadata import version as installed

        return installed("diffuse")
    except Exception:  # run from a checkout that was never installed
        return "0.1.0"


def usage() -> str:
    width = max(len(f"{n} {c.usage}") for n, c in COMMANDS.items())
    lines = [f"  {f'{n} {c.usage}'.strip():{width}s}  {c.summary}" for n, c in COMMANDS.items()]
    return ("usage: diffuse COMMAND ...   (diffuse COMMAND --help for its flags; diffuse --version)\n\ncommands:\n"
            + "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    """``diffuse COMMAND ...``. Run as the installed command (no ``argv``), the process ends as soon as
    the command returns: everything it started is stopped by then, and the interpreter's own teardown
    (torch's threads, imported modules) would only keep the prompt waiting."""
    as_command = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if as_command:
        quiet_libraries()
    code = dispatch(argv)
    if as_command:
        launchers = sys.modules.get("diffuse.local.launcher")  # loaded by a command that started local nodes
        if launchers is not None:
            launchers.POOL.close()  # they end and are reaped before this process ends (Ctrl-C too)
        exit_now(code)
    return code


def dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version", "version"):
        print(f"diffuse {version()}")
        return 0
    name, rest = ALIASES.get(argv[0], argv[0]), argv[1:]
    command = COMMANDS.get(name)
    if command is None:
        near = difflib.get_close_matches(argv[0], [*COMMANDS, *ALIASES], n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        print(f"diffuse: unknown command {argv[0]!r}{hint}\n\n{usage()}", file=sys.stderr)
        return 2
    return command.load()(rest)


if __name__ == "__main__":
    main()  # ends the process itself
