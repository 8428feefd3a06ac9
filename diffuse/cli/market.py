"""What ``diffuse host`` shows of the Hub: its live search, each model's verdict (from its configs and safetensors
headers, kilobytes: ``diffuse check``'s), its size, what this machine can hold of it, and one model's card, files
and plan. No terminal here: ``diffuse.cli.host`` draws it."""

from __future__ import annotations

import math
import os
import shutil
import threading
from dataclasses import dataclass, field

from diffuse.errors import DiffuseError

TASKS = (None, "text-to-video", "text-to-image", "image-to-video", "text-generation", "image-text-to-text",
         "automatic-speech-recognition", "text-to-audio")
MARGIN = 1.1  # what holding a model's bytes takes in memory, counted as this much more


def size_text(n: float | None) -> str:
    from diffuse.plan.fetchprogress import size_text as sized

    return "?" if n is None else sized(n)


@dataclass
class Machine:
    """What this machine may give a model: memory (a cgroup's limit where one is set), disk where models are
    fetched, and what computes (filled in once torch is imported)."""

    memory: int
    disk: int
    where: str
    device: str = "CPU"

    @classmethod
    def here(cls) -> "Machine":
        from diffuse.plan.fetching import hub_cache
        from diffuse.plan.reports import memory_report

        where = hub_cache()
        probe = where
        while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)
        return cls(memory_report()["available"] or 0, shutil.disk_usage(probe).free, where)

    def line(self) -> str:
        return (f"this machine: {self.device}, {size_text(self.memory)} of memory free, "
                f"{size_text(self.disk)} of disk free in {self.where}")

    def holds(self, whole: int, blocks: int) -> str:
        """What of a model (``whole`` bytes, ``blocks`` of them in its block stacks) this machine can hold."""
        if whole * MARGIN <= self.memory and whole <= self.disk:
            return "all of it"
        if not blocks:
            return "none of it"
        n = max(2, math.ceil(blocks * MARGIN / max(self.memory, 1)))
        if blocks / n > self.disk:
            return f"none: 1/{n} of its blocks needs {size_text(blocks / n)} of disk"
        return f"1/{n} of its blocks" if n <= 64 else "none of it"


@dataclass
class Row:
    """One model of the search, judged once its files are read (``judged``)."""

    repo: str
    downloads: int = 0
    likes: int = 0
    task: str | None = None
    judged: bool = False
    verdict: str = "reading its configs…"
    splittable: bool = False
    size: int | None = None  # bytes of the safetensors files a whole run loads
    blocks: int = 0  # bytes of those in the split component(s)
    holds: str = ""
    folder: str = ""
    commit: str = ""
    check: dict = field(default_factory=dict)


class Market:
    """The search as the browser shows it: ``words``, ``sort`` (``diffuse.plan.hub.SORTS``), ``task``; rows judged
    one after another on a thread of its own, best first."""

    def __init__(self, words: str = "", sort: str = "downloads", task: str | None = None, limit: int = 40):
        self.words, self.sort, self.task, self.limit = words, sort, task, limit
        self.rows: list[Row] = []
        self.error = ""
        self.machine = Machine.here()
        self._lock = threading.Lock()
        self._generation = 0
        self._known: dict[str, Row] = {}
        self._judging = threading.Lock()

    def search(self) -> None:
        """The rows for the current words, sort and task (judged from then on, in the background)."""
        from diffuse.plan.hub import search

        self._generation += 1
        try:
            found = search(self.words, self.sort, self.task, self.limit)
            self.error = ""
        except DiffuseError as exc:
            found, self.error = [], str(exc)
        rows = [self._known.get(r["id"]) or Row(r["id"], int(r.get("downloads") or 0), int(r.get("likes") or 0),
                                                 r.get("pipeline_tag")) for r in found]
        self._known.update((r.repo, r) for r in rows)  # a model judged once is not read again in this browser
        with self._lock:
            self.rows = rows
        threading.Thread(target=self._judge_all, args=(self._generation, rows), daemon=True,
                         name="host-judge").start()

    def _judge_all(self, generation: int, rows: list[Row]) -> None:
        for row in rows:
            if generation != self._generation:
                return  # a newer search took over
            self.judge(row)

    def judge(self, row: Row) -> Row:
        """``row``'s verdict, size and what this machine holds of it, from its configs and headers."""
        with self._judging:  # the background thread and a page opened meanwhile never read one model at once
            if not row.judged:
                self._judge(row)
        return row

    def _judge(self, row: Row) -> None:
        from diffuse.cli.check import check
        from diffuse.plan.fetching import hub_folder
        from diffuse.plan.hub import HubRef
        from diffuse.plan.hubmodel import fetch_model, loaded_files, stored_listing

        try:
            row.folder = fetch_model(HubRef(row.repo), "headers", say=lambda line: None)
            row.commit = hub_folder(row.folder)["commit"]
            listed = stored_listing(row.folder)
            weights = [p for p in loaded_files(listed, row.folder) if p.endswith(".safetensors")]
            row.size = sum(listed.files[p][0] for p in weights)
            row.check = check(row.folder, cache=True)
            row.splittable = row.check["verdict"] == "splittable"
            if row.splittable:
                stacks = ", ".join(f"{s['path']} ({s['length']})" for s in row.check["stacks"])
                row.verdict = f"splittable: {row.check.get('output_kind') or 'text'}, {stacks}"
                split = {os.path.relpath(d, row.folder) for d in _split_dirs(row.folder)}
                row.blocks = sum(listed.files[p][0] for p in weights if os.path.dirname(p) in split or
                                 (split == {"."} and "/" not in p))
            else:
                row.verdict = f"refused: {row.check.get('reason')}"
            row.holds = self.machine.holds(row.size, row.blocks) if row.splittable else "—"
        except Exception as exc:  # a model Diffuse cannot read is a row that says why, not a browser that ends
            row.verdict = f"cannot read: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        if self.machine.device == "CPU":
            self.machine.device = _device()
        row.judged = True

    def details(self, row: Row) -> dict:
        """The model's card (its first lines), files (largest first) and, if it splits, what each node of 2, 3
        and 4 fetches."""
        from diffuse.plan.hubmodel import fetch_card, loaded_files, stored_listing

        self.judge(row)
        out = {"card": [], "files": [], "plans": {}}
        if not row.folder:
            return out
        out["card"] = _card_lines(fetch_card(row.folder) or os.path.join(row.folder, "README.md"))
        listed = stored_listing(row.folder)
        out["files"] = sorted(((p, listed.files[p][0]) for p in loaded_files(listed, row.folder)),
                              key=lambda f: -f[1])
        if row.splittable:
            out["plans"] = _plans(row.folder)
        return out


def _split_dirs(folder: str) -> list[str]:
    from diffuse.plan.analysis import ModelSubject

    return list(ModelSubject.from_path(folder).component_dirs().values())


def _plans(folder: str) -> dict[str, int]:
    """"K/N" -> bytes that node fetches (its blocks' tensors, as stored), for N of 2, 3 and 4."""
    from diffuse.plan.contracts import parse_slices
    from diffuse.plan.hubmodel import downloads
    from diffuse.plan.planner import analyze

    subject, draft = analyze(folder)
    stacks = list(draft["stacks"])
    out = {}
    for n in (2, 3, 4):
        if min(s.length for s in stacks) < n:
            break
        rows = [tuple(parse_slices(f"{k}/{n}", stacks)) for k in range(1, n + 1)]
        fetched = downloads(subject, stacks, rows)
        if fetched is None:
            break
        out.update((f"{k}/{n}", b) for k, b in zip(range(1, n + 1), fetched[0]))
    return out


def _card_lines(path: str, most: int = 8) -> list[str]:
    """The card's first lines of prose: past its YAML front matter, blank lines and pictures left out."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(20000)
    except OSError:
        return ["(no model card)"]
    if text.startswith("---"):
        end = text.find("\n---", 3)
        text = text[end + 4:] if end >= 0 else text
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith(("![", "<"))]
    return lines[:most] or ["(an empty model card)"]


def _device() -> str:
    """What computes here, once torch is imported (the verdicts import it): the first accelerator, or the CPU."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return f"{props.name} ({size_text(props.total_memory)})"
    return "CPU"
