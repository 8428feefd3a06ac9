"""How far one tensor is from another: the one measure the core and the analyzers compare outputs by.

PipeFusion keeps a block's quick attention path only where it agrees with the
plain one (``diffuse.pipefusion.node``); the return-mapping analyzer
(``analyzers.calls``) pairs each tensor a block returns with the input it
replaces by the smallest distance.
"""

from __future__ import annotations

import torch


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in double precision (complex as pairs of reals; inf when shapes differ or
    values are not finite).

    >>> relative_error(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.0])), relative_error(torch.ones(2), torch.ones(3))
    (0.0, inf)
    >>> relative_error(torch.tensor([3.0, 4.0]), torch.tensor([0.0, 4.0]))
    0.75
    >>> relative_error(torch.zeros(1), torch.tensor([float("nan")]))
    inf
    """
    if a.shape != b.shape:
        return float("inf")
    a, b = (torch.view_as_real(t) if t.is_complex() else t for t in (a.detach(), b.detach()))
    a, b = a.double(), b.double()
    err = float((a - b).norm() / b.norm().clamp_min(1e-30))
    return err if err == err else float("inf")
