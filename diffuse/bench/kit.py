"""What the benchmarks share: the guided loop's fixed inputs and guidance scale, a mean with its spread, a
streamer that times tokens (``Clock``), a process's peak memory, a bench's role run in a process of its own, and
a model of seeded random bf16 weights."""

from __future__ import annotations

import json
import subprocess
import sys
import time

GUIDANCE = 5.0


def inputs(cfg: dict, seed: int = 0) -> dict:
    import torch

    g = torch.Generator("cpu").manual_seed(seed)
    return {
        "latent": torch.randn(1, 16, cfg["frames"], cfg["size"], cfg["size"], generator=g),
        "text": torch.randn(1, cfg["text_len"], cfg["text_dim"], generator=g),
        "negative": torch.randn(1, cfg["text_len"], cfg["text_dim"], generator=g),
    }


def mean_se(xs: list[float]) -> tuple[float, float]:
    """Mean and its standard error."""
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, 0.0
    var = sum((v - m) ** 2 for v in xs) / (len(xs) - 1)
    return m, (var / len(xs)) ** 0.5


def ratio(whole: list[float], split: list[float]) -> tuple[float, float]:
    """whole / split of the mean step times, and its spread (standard errors combined)."""
    (mw, sw), (ms, ss) = mean_se(whole), mean_se(split)
    r = mw / ms
    return r, r * ((sw / mw) ** 2 + (ss / ms) ** 2) ** 0.5


class Clock:
    """A streamer that notes when each token arrives (the first ``put`` is the prompt)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.times: list[float] = []
        self._prompt = True

    def put(self, value) -> None:
        if self._prompt:
            self._prompt = False
            return
        self.times.append(time.perf_counter() - self.start)

    def end(self) -> None:
        pass

    @property
    def first(self) -> float:
        return self.times[0]

    @property
    def per_second(self) -> float:
        """Tokens per second after the first (the steady decoding rate)."""
        return (len(self.times) - 1) / (self.times[-1] - self.times[0]) if len(self.times) > 1 else 0.0


def peak_bytes(pid: int, field: str = "VmHWM") -> int:
    """A process's peak resident bytes (``field`` VmRSS: its present ones), as the kernel counts them."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    return 0


def run_role(module: str, args: list[str], timeout: float = 3600) -> dict:
    """``python -m MODULE ARGS...`` in a process of its own, with the nodes' environment; the JSON its last
    line of output holds (its failure: a RuntimeError with the end of what it said)."""
    from diffuse.local.nodes import node_env

    proc = subprocess.run([sys.executable, "-m", module, *args], env=node_env(), capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{args[0]} failed: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def random_bf16(make):
    """The module ``make()`` builds, made empty in bf16 (no float32 copy first) and filled with seeded random weights
    (norms at one): how the benches build models at real geometries."""
    import torch

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            module = make()
        module = module.to_empty(device="cpu")
    finally:
        torch.set_default_dtype(default)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0, 0.02, generator=g)
        for name, b in module.named_buffers():  # rotary tables and the like: as the module's own code makes them
            if b.is_floating_point():
                b.zero_()
    if hasattr(module, "tie_weights"):  # made empty, tied tables are tensors of their own: one again
        module.tie_weights()
    return module.eval()
