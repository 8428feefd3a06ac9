"""What the benchmarks share: the guided loop's fixed inputs and guidance scale, a mean with its spread, and a
streamer that times tokens (``Clock``)."""

from __future__ import annotations

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
