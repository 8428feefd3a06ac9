"""What a fetch says while it runs: every few seconds the bytes fetched of how many, the rate and the time left;
and the same as a map (``Progress.state``), which a node fetching its slice gives in its hello and status, and
its client and the service say in words (``fetch_text``)."""

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
        self.file = ""  # the file being fetched now (its path in the repo), where the caller says it

    def state(self) -> dict:
        """Where the fetch stands now: bytes done of the total, the mean rate so far, seconds left (None while
        no byte has come), what is fetched and the file now."""
        done, total = self.done, self.total
        rate = done / max(time.monotonic() - self.started, 1e-6)
        left = max(total - done, 0) / rate if rate > 0 else None
        return {"what": self.label, "file": self.file, "bytes_done": done, "bytes_total": total,
                "rate_bps": round(rate), "eta_s": round(left, 1) if left is not None else None}

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


def checked_state(state: dict) -> dict:
    """A fetch's ``state`` as another process said it: its known fields of the right kinds only (numbers at
    least 0 and finite, short strings), None for the rest."""
    out: dict = {}
    for name in ("bytes_done", "bytes_total", "rate_bps", "eta_s"):
        x = state.get(name)
        ok = isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < float("inf")
        out[name] = x if ok else None
    for name in ("what", "file"):
        out[name] = state[name][:200] if isinstance(state.get(name), str) else None
    return out


def fetch_text(state: dict) -> str:
    """A fetch's ``state`` (``checked_state`` here) in words: "1.2 GB of 4.7 GB (26%), 80.0 MB/s, about 44 s
    left"."""
    s = checked_state(state)
    done, total, rate, eta = s["bytes_done"] or 0, s["bytes_total"] or 0, s["rate_bps"], s["eta_s"]
    text = f"{size_text(done)} of {size_text(total)} ({100 * done / max(total, 1):.0f}%)"
    if rate is not None:
        text += f", {size_text(rate)}/s"
    return text + (f", about {_duration(eta)} left" if eta is not None else ", time left unknown yet")
