"""Procedural training data: a coloured shape moving on a dark background.

Everything here is numpy only and deterministic given a seed, so the dataset,
the held-out split and the evaluation are reproducible without downloads.
A clip is a uint8 array of shape (frames, height, width, 3).
"""

from __future__ import annotations

import itertools

import numpy as np

# Palette: well separated in RGB so a dominant colour can be measured robustly.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (230, 40, 40),
    "green": (40, 210, 60),
    "blue": (50, 90, 240),
    "yellow": (235, 225, 40),
    "cyan": (40, 220, 230),
    "magenta": (225, 50, 220),
}
SHAPES = ("square", "circle", "triangle")
DIRECTIONS = ("left", "right", "up", "down")
BACKGROUND = (0, 0, 0)

# unit motion vectors in image coordinates (x to the right, y downwards)
DIR_VECTORS = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0)}

FRAMES = 9
SIZE = 32

WORDS = ("a", "moving") + tuple(COLOURS) + SHAPES + DIRECTIONS


def make_prompt(colour: str, shape: str, direction: str) -> str:
    return f"a {colour} {shape} moving {direction}"


def all_combos() -> list[tuple[str, str, str]]:
    return list(itertools.product(COLOURS, SHAPES, DIRECTIONS))


def is_held_out(colour: str, shape: str, direction: str) -> bool:
    """12 of the 72 combinations are never trained on.

    (ci + si + di) % 6 == 0 picks every colour twice, every shape four times and
    every direction three times, so each word is seen in training, only the
    combination is new.
    """
    ci = list(COLOURS).index(colour)
    si = SHAPES.index(shape)
    di = DIRECTIONS.index(direction)
    return (ci + si + di) % 6 == 0


def train_combos() -> list[tuple[str, str, str]]:
    return [c for c in all_combos() if not is_held_out(*c)]


def heldout_combos() -> list[tuple[str, str, str]]:
    return [c for c in all_combos() if is_held_out(*c)]


def heldout_prompts() -> list[str]:
    return [make_prompt(*c) for c in heldout_combos()]


def train_prompts() -> list[str]:
    return [make_prompt(*c) for c in train_combos()]


_SS = 4  # supersampling factor for anti-aliased edges


def _shape_mask(shape: str, cx: float, cy: float, r: float, size: int) -> np.ndarray:
    """Coverage in [0,1] of `shape` centred at (cx, cy) with half-size r (pixels)."""
    n = size * _SS
    coords = (np.arange(n) + 0.5) / _SS
    xx, yy = np.meshgrid(coords, coords)
    dx, dy = xx - cx, yy - cy
    if shape == "square":
        m = (np.abs(dx) <= r) & (np.abs(dy) <= r)
    elif shape == "circle":
        m = dx * dx + dy * dy <= r * r
    elif shape == "triangle":
        # upward-pointing isosceles triangle inscribed in the 2r x 2r box
        t = (dy + r) / (2 * r)  # 0 at the apex, 1 at the base
        m = (t >= 0) & (t <= 1) & (np.abs(dx) <= t * r)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return m.reshape(size, _SS, size, _SS).mean(axis=(1, 3))


def render_clip(
    colour: str,
    shape: str,
    direction: str,
    rng: np.random.Generator | int | None = None,
    frames: int = FRAMES,
    size: int = SIZE,
) -> np.ndarray:
    """One clip, uint8 (frames, size, size, 3). Position, size and speed vary with rng."""
    rng = np.random.default_rng(rng)
    r = rng.uniform(0.14, 0.19) * size  # half-size: 4.5..6 px at 32 px
    speed = rng.uniform(0.50, 0.65) * size / (frames - 1)  # total travel ~ half the frame
    travel = speed * (frames - 1)
    vx, vy = DIR_VECTORS[direction]
    margin = r + 1.0
    # the coordinate along the motion starts so that the whole path stays inside
    def along_start(v):
        lo, hi = margin, size - margin - travel
        s = rng.uniform(lo, max(lo, hi))
        return s if v > 0 else size - s

    def across():
        return rng.uniform(margin + 2, size - margin - 2)

    if vx != 0:
        x0, y0 = along_start(vx), across()
    else:
        x0, y0 = across(), along_start(vy)
    fg = np.array(COLOURS[colour], dtype=np.float32)
    bg = np.array(BACKGROUND, dtype=np.float32)
    out = np.empty((frames, size, size, 3), dtype=np.uint8)
    for f in range(frames):
        cx, cy = x0 + vx * speed * f, y0 + vy * speed * f
        a = _shape_mask(shape, cx, cy, r, size)[..., None]
        out[f] = np.clip(np.rint(a * fg + (1 - a) * bg), 0, 255).astype(np.uint8)
    return out


def make_dataset(
    combos: list[tuple[str, str, str]], per_combo: int, seed: int
) -> tuple[np.ndarray, list[str]]:
    """Clips (N, F, H, W, 3) uint8 and their prompts, deterministic in seed."""
    rng = np.random.default_rng(seed)
    clips, prompts = [], []
    for _ in range(per_combo):
        for c in combos:
            clips.append(render_clip(*c, rng=rng))
            prompts.append(make_prompt(*c))
    return np.stack(clips), prompts
