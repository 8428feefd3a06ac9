"""What the benchmarks share: the guided loop's fixed inputs and guidance scale, and a mean with its spread."""

from __future__ import annotations

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
