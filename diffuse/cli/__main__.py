"""``python -m diffuse.cli``: the ``diffuse`` command."""

from diffuse.cli.command import main

main()  # ends the process itself
