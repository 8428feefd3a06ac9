"""What a command says while it works: the console (never wrapping a line mid-phrase when output is piped
or logged), one status line (``status``), a phase with its "still ..." lines (``phase``), progress over a
run's steps (``StepLines``: a bar on a terminal, plain lines when output is piped or logged), and a diffusion
pipeline's own call run under it (``run_with_steps``).

This module imports no other part of Diffuse, and rich and torch only when used, so a command's first line
comes at once.
"""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager


def console(stderr: bool = True):
    """A console that never wraps a line mid-phrase when output is piped or logged."""
    from rich.console import Console

    return Console(stderr=stderr, soft_wrap=True, highlight=False)


def status(out, text: str, quiet: bool = False) -> None:
    """One status line: what happens now (the first within a second of start, one per phase after);
    none with ``--quiet``."""
    if not quiet:
        out.print(text, highlight=False, soft_wrap=True, markup=False)


class phase:
    """A phase of a command: its line at the start, and while it lasts a line every ``every`` seconds
    saying it still goes on (imports and loading under a busy machine take long), so the command is
    never long silent."""

    def __init__(self, out, text: str, quiet: bool = False, every: float = 5.0):
        self.out, self.text, self.quiet, self.every = out, text, quiet, every

    def __enter__(self):
        import threading

        status(self.out, self.text, self.quiet)
        self.started, self.done = time.perf_counter(), threading.Event()
        self.ticker = threading.Thread(target=self._tick, name="phase", daemon=True)
        self.ticker.start()
        return self

    def _tick(self) -> None:
        what = self.text.rstrip(".").split(": ")[-1].split(";")[-1].strip()
        while not self.done.wait(self.every) and not self.quiet:
            status(self.out, f"  still {what} ({time.perf_counter() - self.started:.0f} s)")

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.ticker.join()


class StepLines:
    """Progress over the steps of a run: a bar on a terminal; as plain lines when output is piped or
    logged (step i/N, rate, time left), one each ``every`` seconds and at each tenth of the run, so a log
    shows the run moving while it runs. ``quiet``: nothing."""

    def __init__(self, out, label: str = "denoising", quiet: bool = False, every: float = 2.0):
        self.out, self.label, self.quiet, self.every = out, label, quiet, every
        self.total: int | None = None
        self.done = 0
        self.bar = None
        self.started = self.last = time.perf_counter()
        self.last_tenth = 0

    def __enter__(self):
        if not self.quiet and self.out.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn(self.label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                transient=False, console=self.out)
            self.task = self.bar.add_task("steps", total=None)
            self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def set_total(self, total: int) -> None:
        if self.total is None:
            self.total = total
            if self.bar is not None:
                self.bar.update(self.task, total=total)

    def advance(self) -> None:
        self.done += 1
        now = time.perf_counter()
        if self.bar is not None:
            self.bar.advance(self.task)
            return
        if self.quiet:
            return
        tenth = self.done * 10 // self.total if self.total else 0
        if now - self.last >= self.every or tenth > self.last_tenth or self.done == self.total:
            self.last, self.last_tenth = now, tenth
            self.out.print(self.line(now), highlight=False, soft_wrap=True, markup=False)

    def line(self, now: float) -> str:
        spent = now - self.started
        rate = self.done / spent if spent > 0 else 0.0
        of = f"/{self.total}" if self.total else ""
        pace = f"{rate:.2f} steps/s" if rate >= 1 or rate == 0 else f"{1 / rate:.1f} s/step"
        left = ""
        if self.total and rate > 0 and self.done < self.total:
            left = f", about {(self.total - self.done) / rate:.0f} s left"
        return f"{self.label}: step {self.done}{of}, {pace}{left}"


@contextmanager
def step_progress(pipe, quiet: bool, out=None):
    """Progress over the scheduler's steps (``StepLines``: a bar on a terminal, plain lines
    when output is piped); the scheduler's ``step`` is wrapped for the call only."""
    sched = pipe.scheduler
    original = sched.step
    counter = {"steps": 0, "denoising": 0.0}
    started = time.perf_counter()
    lines = StepLines(out or console(), "denoising", quiet)

    # wraps() keeps step's signature visible: pipelines pass generator/eta only if step declares them
    @functools.wraps(original)
    def step(*args, **kwargs):
        if getattr(sched, "timesteps", None) is not None:
            lines.set_total(len(sched.timesteps))
        out = original(*args, **kwargs)
        counter["steps"] += 1
        counter["denoising"] = time.perf_counter() - started  # from the call to the last step: text encoding and steps
        lines.advance()
        return out

    sched.step = step
    try:
        with lines:
            yield counter
    finally:
        del sched.step  # the bound method from the class shows through again


def run_with_steps(pipe, kwargs: dict, out, quiet: bool):
    """A diffusion pipeline's own call, with progress over its steps (``step_progress``): its result, the step
    counts, and its seconds."""
    import torch

    t = time.perf_counter()
    with torch.no_grad(), step_progress(pipe, quiet, out) as steps:
        result = pipe(**kwargs)
    return result, steps, time.perf_counter() - t
