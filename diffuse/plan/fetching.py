"""Files of a Hub model on this disk, fetched by byte ranges: whole, or only the parts a process runs.

A model at one commit is a folder, ``<HF hub cache>/diffuse/models--ORG--NAME/<commit>/``, laid out as the repo
is, so the loaders read it as any model folder. A file is complete there, or it is *partial*: as large as on the
Hub but holding only some byte ranges (a sparse file: the ranges not fetched take no disk), with a note beside it
(``.NAME.diffuse.json``: its size, its sha256, the ranges held). A safetensors file a node holds part of is
partial: its header and the tensors of its slice. A whole file is fetched the same way and its note removed once
every byte is there and its sha256 is the Hub's, so an interrupted fetch resumes from the ranges held, and no
file is ever taken for complete that is not.

``Progress`` says, every few seconds, what is fetched of how much, the rate and the time left.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import struct
import sys
import time
import urllib.error

from diffuse.errors import DiffuseError
from diffuse.plan.hub import RETRIES, HubRef, backoff_s, file_url, hub_failure, request

CHUNK = 1 << 20  # bytes read and written at a time
NOTE_EVERY_S = 1.0  # seconds between two writes of a partial file's note while fetching (what a kill may lose)
GAP = 64 << 10  # ranges closer than this are fetched as one (fewer requests, a little more data)


MARKER = os.path.join(".diffuse", "hub.json")  # in a folder made from a Hub repo: {"repo", "commit", "revision"}


def hub_folder(folder: str) -> dict | None:
    """{"repo", "commit", "revision"} of a folder made from a Hub repo (``diffuse.plan.hubmodel``), else None."""
    return _read_json(os.path.join(folder, MARKER))


def hub_commit(folder: str) -> str:
    """The commit a folder made from a Hub repo holds; "" for any other folder."""
    return (hub_folder(folder) or {}).get("commit", "")


def hub_cache() -> str:
    """``huggingface_hub``'s cache folder, read from the environment now (``HF_HUB_CACHE``, ``HF_HOME``)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def repo_root(repo: str) -> str:
    return os.path.join(hub_cache(), "diffuse", "models--" + repo.replace("/", "--"))


def _note_path(path: str) -> str:
    d, name = os.path.split(path)
    return os.path.join(d, f".{name}.diffuse.json")


def merged(spans) -> list[list[int]]:
    out: list[list[int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def missing(wanted, held) -> list[list[int]]:
    """The parts of ``wanted`` spans not in ``held`` (both lists of [start, stop)), merged across small gaps."""
    out = []
    held = merged(held)
    for a, b in merged(wanted):
        for ha, hb in held:
            if hb <= a or ha >= b:
                continue
            if ha > a:
                out.append([a, ha])
            a = max(a, hb)
            if a >= b:
                break
        if a < b:
            out.append([a, b])
    joined: list[list[int]] = []
    for a, b in out:
        if joined and a - joined[-1][1] <= GAP:
            joined[-1][1] = b
        else:
            joined.append([a, b])
    return joined


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK * 8), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


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
        return (f"fetching {self.label}: {_size(self.done)} of {_size(self.total)} "
                f"({100 * self.done / max(self.total, 1):.0f}%), {_size(rate)}/s{eta}")

    def end(self) -> None:
        """The last line: said where the fetch was long enough to matter (a megabyte, or a line said before)."""
        if self.total >= 1 << 20 or self.last > self.started:
            self.say(self.line() + f" in {_duration(time.monotonic() - self.started)}")


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _duration(s: float) -> str:
    if s == float("inf"):
        return "unknown time"
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.0f} min" if s < 5400 else f"{s / 3600:.1f} h"


class RepoFile:
    """One file of a repo at one commit, on this disk: complete, partial (some ranges held) or absent."""

    def __init__(self, ref: HubRef, commit: str, folder: str, path: str, size: int, sha256: str | None):
        self.ref, self.commit, self.path, self.size, self.sha256 = ref, commit, path, size, sha256
        self.local = os.path.join(folder, path)
        self.note_path = _note_path(self.local)

    def _note(self) -> dict | None:
        return _read_json(self.note_path)

    def complete(self) -> bool:
        """Every byte here and checked: its note says so (sealed) and the file is as it was sealed. A file changed
        since (or found with no note) is checked against the Hub's sha256 again, and removed if it differs (or
        where the Hub gives none), so that it is fetched anew."""
        if not os.path.isfile(self.local):
            return False
        note = self._note()
        if note is not None and not note.get("sealed"):
            return False
        st = os.stat(self.local)
        if note is not None and note.get("size") == st.st_size == self.size and note.get("mtime_ns") == st.st_mtime_ns:
            return True
        if st.st_size == self.size and self.sha256 and _sha256(self.local) == self.sha256:
            self._write_note(None)
            return True
        print(f"{self.local} is damaged ({st.st_size} bytes, changed since it was fetched and checked): "
              "fetching it again", file=sys.stderr)
        os.unlink(self.local)
        if note is not None:
            os.unlink(self.note_path)
        return False

    def held(self) -> list[list[int]]:
        if self.complete():
            return [[0, self.size]]
        note = self._note()
        if note is None or note.get("sealed") or note.get("size") != self.size or \
                not os.path.isfile(self.local) or os.path.getsize(self.local) != self.size:
            return []
        return note["spans"]

    def to_fetch(self, spans) -> list[list[int]]:
        return missing(spans, self.held())

    @classmethod
    def at(cls, local: str) -> "RepoFile | None":
        """The partial file at ``local`` as its note describes it (repo, commit, path); None where it has no note."""
        note = _read_json(_note_path(local))
        if not note or "repo" not in note:
            return None
        folder = local[: len(local) - len(note["path"])]
        return cls(HubRef(note["repo"]), note["commit"], folder, note["path"], note["size"], note.get("sha256"))

    def fetch(self, spans, progress: Progress | None = None) -> None:
        """Hold ``spans`` (lists of [start, stop)); the whole file once every byte is held (sha256 checked).
        Processes fetching the same file take turns (a lock beside it) and fetch only what the other left."""
        if not self.to_fetch(spans):
            return
        os.makedirs(os.path.dirname(self.local), exist_ok=True)
        with open(_note_path(self.local)[: -len(".json")] + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._fetch_locked(spans, progress)

    def _fetch_locked(self, spans, progress) -> None:
        todo = self.to_fetch(spans)
        if not todo:
            return
        held = self.held()
        if not held:
            with open(self.local, "wb") as f:
                f.truncate(self.size)  # sparse: the ranges not fetched take no disk
            held = []
        self._write_note(held)
        fd = os.open(self.local, os.O_WRONLY)
        try:
            for a, b in todo:
                held = self._fetch_span(fd, a, b, held, progress)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise DiffuseError(f"the disk holding {os.path.dirname(self.local)} is full: free space there (or "
                                   "set HF_HOME to a disk with room) and run again; what was fetched is kept") from None
            raise
        finally:
            os.close(fd)
        self._write_note(held)
        if merged(held) == [[0, self.size]]:
            self._seal()

    def _fetch_span(self, fd: int, a: int, b: int, held: list, progress) -> list:
        at, noted, tries = a, time.monotonic(), 0
        while at < b:
            try:
                with request(file_url(self.ref.repo, self.commit, self.path), self.ref,
                             headers={"Range": f"bytes={at}-{b - 1}"}) as r:
                    if r.status != 206 and not (r.status == 200 and at == 0 and b == self.size):
                        raise DiffuseError(f"{self.ref}: {self.path} was not served by range (HTTP {r.status}); "
                                           "is HF_ENDPOINT a Hugging Face Hub?")
                    while at < b:
                        chunk = r.read(min(CHUNK, b - at))
                        if not chunk:
                            raise ConnectionResetError("the answer ended early")
                        os.pwrite(fd, chunk, at)
                        at += len(chunk)
                        if progress is not None:
                            progress.add(len(chunk))
                        if time.monotonic() - noted >= NOTE_EVERY_S:
                            held = merged(held + [[a, at]])
                            self._write_note(held)
                            noted = time.monotonic()
            except (ConnectionError, TimeoutError, urllib.error.URLError) as exc:
                tries += 1
                if tries >= RETRIES:
                    raise hub_failure(exc, self.ref) from None
                time.sleep(backoff_s(tries))
        return merged(held + [[a, b]])

    def _write_note(self, held: list | None) -> None:
        """The note beside the file: the spans held, or (``held`` None) that it is complete and checked."""
        note = {"repo": self.ref.repo, "commit": self.commit, "path": self.path, "size": self.size,
                "sha256": self.sha256}
        if held is None:
            note.update(sealed=True, mtime_ns=os.stat(self.local).st_mtime_ns)
        else:
            note["spans"] = merged(held)
        tmp = f"{self.note_path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(note, f)
        os.replace(tmp, self.note_path)

    def _seal(self) -> None:
        """Every byte held: checked against the Hub's sha256, then sealed (the note says it is complete)."""
        if self.sha256:
            digest = _sha256(self.local)
            if digest != self.sha256:
                os.unlink(self.local)
                os.unlink(self.note_path)
                raise DiffuseError(f"{self.ref}: {self.path} arrived damaged (sha256 {digest[:12]}…, the Hub "
                                   f"lists {self.sha256[:12]}…); it was removed: run again to fetch it anew")
        self._write_note(None)

    def header(self) -> tuple[int, dict]:
        """A safetensors file's header (its length and its JSON), fetched and held where it is not yet (each byte
        once: its length first, then the rest)."""
        for _ in range(2):  # a damaged header is fetched once more
            self.fetch([[0, 8]])
            with open(self.local, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 << 20 or 8 + n > self.size:
                raise DiffuseError(f"{self.ref}: {self.path} is not a safetensors file (header of {n} bytes)")
            self.fetch([[0, 8 + n]])
            with open(self.local, "rb") as f:
                f.seek(8)
                try:
                    return n, json.loads(f.read(n))
                except ValueError:
                    pass
            os.unlink(self.local)
            if os.path.exists(self.note_path):
                os.unlink(self.note_path)
        raise DiffuseError(f"{self.ref}: {self.path} has a header that is not JSON: is it a safetensors file?")


def check_room(folder: str, needed: int, what: str) -> None:
    """Refused before the first byte where the disk holding ``folder`` lacks ``needed`` bytes (and a margin)."""
    os.makedirs(folder, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if needed > free - (64 << 20):
        raise DiffuseError(f"fetching {what} needs {_size(needed)} in {folder}, which has {_size(free)} free: free "
                           "space there, or set HF_HOME to a disk with room")


def spans_of(header: tuple[int, dict], keys) -> list[list[int]]:
    """The byte ranges of the named tensors in a safetensors file (``header``: its length and JSON)."""
    n, meta = header
    out = []
    for k in keys:
        a, b = meta[k]["data_offsets"]
        out.append([8 + n + a, 8 + n + b])
    return merged(out)


def hold(needs: dict[str, list[str]], say=None) -> None:
    """Every tensor ``needs`` names (safetensors file -> tensor names) held on this disk: in a partial file of a
    Hub model, the byte ranges of those not held yet are fetched first (one progress line for them all). A file
    with no note is complete, or not a Hub model's: nothing to do."""
    todo = []
    for local, keys in needs.items():
        f = RepoFile.at(local)
        if f is None:
            continue
        spans = f.to_fetch(spans_of(f.header(), keys))
        if spans:
            todo.append((f, spans))
    if not todo:
        return
    total = sum(b - a for _, spans in todo for a, b in spans)
    check_room(os.path.dirname(todo[0][0].local), total, f"{todo[0][0].ref}'s tensors")
    progress = Progress(str(todo[0][0].ref), total, say)
    for f, spans in todo:
        f.fetch(spans, progress)
    progress.end()
