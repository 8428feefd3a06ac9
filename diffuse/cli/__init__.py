"""The ``diffuse`` command and its subcommands: the faces a user types.

``command`` is the table of subcommands and the dispatch; ``parsing`` the flags of query and chat, every
flag check and the error reporter; ``query`` (``python -m diffuse.run``) a diffusion run and ``language`` a
language model's; ``chat`` turn by turn is in ``language`` too; ``check``, ``plan``, ``commands`` the
small ones; ``modelread`` the model a request names, read before anything loads.
"""
