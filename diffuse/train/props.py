"""Measurable properties of a generated clip, and whether they match a prompt.

These are deliberately simple and model-free, so they can judge any video:

- colour: the brightness-weighted mean RGB of the foreground pixels (those far
  from the black background), snapped to the palette colour of closest hue
  (cosine similarity);
- motion: the displacement of the foreground centroid from the first frames to
  the last frames; its dominant axis and sign give left/right/up/down, and a
  displacement under `MIN_TRAVEL` pixels counts as "static";
- shape: how much of its bounding box the foreground fills in the middle frame
  (square ~1.0, circle ~0.79, triangle ~0.5).

`frames` may be uint8 in [0, 255] or float in [0, 1], shaped (F, H, W, 3) — the
layout of `WanPipeline(...).frames[0]` with output_type="np".
"""

from __future__ import annotations

import numpy as np

from .data import BACKGROUND, COLOURS, DIRECTIONS, SHAPES

FG_THRESHOLD = 0.25  # max channel distance from the background, in [0,1]
MIN_FG_PIXELS = 4  # per frame, to count as "something is there"
MIN_TRAVEL = 3.0  # pixels (at 32 px) from first to last frames


def prompt_properties(prompt: str) -> dict[str, str | None]:
    """{'colour': ..., 'shape': ..., 'motion': ...} named in the prompt (None if absent)."""
    words = prompt.lower().replace(",", " ").split()
    pick = lambda names: next((w for w in words if w in names), None)  # noqa: E731
    return {"colour": pick(COLOURS), "shape": pick(SHAPES), "motion": pick(DIRECTIONS)}


def _as_float(frames) -> np.ndarray:
    a = np.asarray(frames)
    if a.ndim == 5:  # (1, F, H, W, 3)
        a = a[0]
    if a.ndim != 4 or a.shape[-1] != 3:
        raise ValueError(f"expected frames shaped (F, H, W, 3), got {a.shape}")
    if a.dtype == np.uint8 or a.max() > 1.5:
        a = a.astype(np.float32) / 255.0
    return a.astype(np.float32)


def foreground(frames) -> np.ndarray:
    """Boolean mask (F, H, W) of pixels that are not background."""
    a = _as_float(frames)
    bg = np.array(BACKGROUND, dtype=np.float32) / 255.0
    return np.abs(a - bg).max(axis=-1) > FG_THRESHOLD


def _nearest_colour(rgb: np.ndarray) -> str:
    """Palette colour with the closest hue: cosine similarity in RGB.

    On a black background an anti-aliased or blurred edge pixel is the shape's
    colour scaled down, so the direction of the RGB vector, not its length,
    names the colour.
    """
    names = list(COLOURS)
    pal = np.array([COLOURS[n] for n in names], dtype=np.float32) / 255.0
    pal = pal / np.linalg.norm(pal, axis=1, keepdims=True)
    v = rgb / max(float(np.linalg.norm(rgb)), 1e-6)
    return names[int(np.argmax(pal @ v))]


def _centroid(mask: np.ndarray) -> np.ndarray | None:
    ys, xs = np.nonzero(mask)
    if len(xs) < MIN_FG_PIXELS:
        return None
    return np.array([xs.mean(), ys.mean()])


def measure(frames) -> dict:
    """Measured properties: colour, motion, shape (names, or None) plus raw numbers."""
    a = _as_float(frames)
    fg = foreground(a)
    n_frames, h, w = fg.shape
    out: dict = {"colour": None, "motion": None, "shape": None,
                 "fg_fraction": float(fg.mean()), "rgb": None, "displacement": None, "fill": None}
    if fg.sum() < MIN_FG_PIXELS:
        return out
    px = a[fg]
    wt = px.max(axis=1)  # brighter (more opaque) pixels count more
    rgb = (px * wt[:, None]).sum(axis=0) / wt.sum()
    out["rgb"] = [round(float(v), 3) for v in rgb]
    out["colour"] = _nearest_colour(rgb)

    # centroid over the first and last ~quarter of the clip (robust to one bad frame)
    k = max(1, n_frames // 4)
    first = [c for c in (_centroid(fg[i]) for i in range(k)) if c is not None]
    last = [c for c in (_centroid(fg[n_frames - 1 - i]) for i in range(k)) if c is not None]
    if first and last:
        d = np.mean(last, axis=0) - np.mean(first, axis=0)
        d = d * (32.0 / max(h, w))  # express in pixels of a 32 px frame
        out["displacement"] = [round(float(d[0]), 2), round(float(d[1]), 2)]
        if np.abs(d).max() < MIN_TRAVEL:
            out["motion"] = "static"
        elif abs(d[0]) >= abs(d[1]):
            out["motion"] = "right" if d[0] > 0 else "left"
        else:
            out["motion"] = "down" if d[1] > 0 else "up"

    mid = fg[n_frames // 2]
    ys, xs = np.nonzero(mid)
    if len(xs) >= MIN_FG_PIXELS:
        box = (xs.max() - xs.min() + 1) * (ys.max() - ys.min() + 1)
        fill = len(xs) / box
        out["fill"] = round(float(fill), 3)
        out["shape"] = "square" if fill > 0.92 else ("circle" if fill > 0.67 else "triangle")
    return out


def matches(prompt: str, frames) -> dict[str, bool]:
    """For each property the prompt names: does the clip show it?"""
    want = prompt_properties(prompt)
    got = measure(frames)
    return {k: (want[k] is not None and got[k] == want[k]) for k in ("colour", "motion", "shape")}
