"""What a fetch says while it runs: every few seconds the bytes fetched of how many, the rate and the time left."""

from __future__ import annotations

import sys
import time


class Progress:
    """Bytes fetched of ``total``, said every ``every`` seconds and at the end through ``say`` (default: a line
    on standard error)."""

    def __init__(self, label: str, total: int, say=None, every: float = 2.0):
        self.label, self.total, self.done = label, total, 0
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.every = every
        self.started = self.last = time.monotonic()

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            self.say(self.line())

    def line(self) -> str:
        spent = max(time.monotonic() - self.started, 1e-6)
        rate = self.done / spent
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta = "" if self.done >= self.total else f", {_duration(left)} left"
        return (f"fetching {self.label}: {size_text(self.done)} of {size_text(self.total)} "
                f"({100 * self.done / max(self.total, 1):.0f}%), {size_text(rate)}/s{eta}")

    def end(self) -> None:
        """The last line: said where the fetch was long enough to matter (a megabyte, or a line said before)."""
        if self.total >= 1 << 20 or self.last > self.started:
            self.say(self.line() + f" in {_duration(time.monotonic() - self.started)}")


def size_text(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _duration(s: float) -> str:
    if s == float("inf"):
        return "unknown time"
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.0f} min" if s < 5400 else f"{s / 3600:.1f} h"
