"""Whether a process still exists: how a node started with ``--exit-with PID`` and the local nodes'
launcher notice that the client that started them is gone.

Its own module because both sides ask it: the node runtime must not reach into the launcher (a client
tool, which forks nodes) for it.
"""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (one owned by another user counts).

    >>> alive(os.getpid())
    True
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
