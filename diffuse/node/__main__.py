"""``python -m diffuse.node``: join a ring, holding slices of a model's block stacks."""

from diffuse.flags import exit_now
from diffuse.node.command import main

exit_now(main())
