"""Files of a Hub model on this disk: whole, or only the parts a process runs.

A model at one commit is a folder, ``<HF hub cache>/diffuse/models--ORG--NAME/<commit>/``, laid out as the repo
is, so the loaders read it as any model folder. A file is complete there, or it is *partial*: as large as on the
Hub but holding only some byte ranges (a sparse file: the ranges not fetched take no disk), with a note beside it
(``.NAME.diffuse.json``: its size, its digest, the ranges held). A safetensors file a node holds part of is
partial: its header and the tensors of its slice. A file is sealed (its note says so, with the file's size and
modification time) once every byte is there and its digest is the Hub's (the sha256 of a file in LFS, the git
blob id of one in git), so an interrupted fetch resumes from the ranges held, and no file is ever taken for
complete that is not.

A file wanted whole comes through ``huggingface_hub`` into its own cache and is linked here from there
(``diffuse.plan.libfetch``, which says why and how it resumes); parts of files come by Diffuse's own range
reads, which the library has no way to ask for. Progress lines: ``diffuse.plan.fetchprogress``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import struct
import sys
import threading
import time
import urllib.error

from diffuse.errors import DiffuseError
from diffuse.plan.fetchbytes import CHUNK, _git_blob, _range_start, _read_json, _sha256, merged, missing
from diffuse.plan.fetchprogress import Progress, size_text
from diffuse.plan.hub import RETRIES, HubRef, backoff_s, file_url, hub_failure, offline, request
from diffuse.plan.libfetch import LIBRARY_MIN_BYTES, fetch_whole, library_wanted, offer

NOTE_EVERY_S = 1.0  # seconds between two writes of a partial file's note while fetching (what a kill may lose)


MARKER = os.path.join(".diffuse", "hub.json")  # in a folder made from a Hub repo: {"repo", "commit", "revision"}


def hub_folder(folder: str) -> dict | None:
    """{"repo", "commit", "revision"} of a folder made from a Hub repo (``diffuse.plan.hubmodel``), else None."""
    return _read_json(os.path.join(folder, MARKER))


def hub_commit(folder: str) -> str:
    """The commit a folder made from a Hub repo holds; "" for any other folder."""
    return (hub_folder(folder) or {}).get("commit", "")


def partial_folder(folder: str) -> bool:
    """Whether a folder made from a Hub repo lacks some bytes of its files (a client's, a node's): a note there
    that is not sealed."""
    if hub_folder(folder) is None:
        return False
    for here, _, names in os.walk(folder):
        for name in names:
            if name.endswith(".diffuse.json"):
                note = _read_json(os.path.join(here, name))
                if not (note or {}).get("sealed"):
                    return True
    return False


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


class RepoFile:
    """One file of a repo at one commit, on this disk: complete, partial (some ranges held) or absent. Its
    digest, to check it by: the Hub's sha256 (an LFS file), else its git blob id (``blob``, a plain git file)."""

    def __init__(self, ref: HubRef, commit: str, folder: str, path: str, size: int, sha256: str | None,
                 blob: str | None = None):
        self.ref, self.commit, self.path, self.size, self.sha256, self.blob = ref, commit, path, size, sha256, blob
        self.local = os.path.join(folder, path)
        self.note_path = _note_path(self.local)

    def _note(self) -> dict | None:
        return _read_json(self.note_path)

    def _digest_ok(self) -> bool | None:
        """Whether the bytes here are the Hub's (None: the Hub gave nothing to check them by)."""
        if self.sha256:
            return _sha256(self.local) == self.sha256
        if self.blob:
            return _git_blob(self.local) == self.blob
        return None

    def complete(self) -> bool:
        """Every byte here and checked: its note says so (sealed) and the file is as it was sealed. A file changed
        since (or found with no note) is checked against the Hub's digest again and removed if it differs, so that
        it is fetched anew; one the Hub gives no digest for is kept offline, fetched anew online. A file not whole
        here that ``huggingface_hub`` holds for this commit is taken from its cache (``_adopt``)."""
        note = self._note()
        if not (note or {}).get("sealed") and self._adopt():
            return True
        if not os.path.isfile(self.local):
            return False
        if note is not None and not note.get("sealed"):
            return False
        st = os.stat(self.local)
        if note is not None and note.get("size") == st.st_size == self.size and note.get("mtime_ns") == st.st_mtime_ns:
            return True
        ok = self._digest_ok() if st.st_size == self.size else False
        if ok or (ok is None and offline()):
            self._write_note(None)
            return True
        print(f"{self.local} is damaged ({st.st_size} bytes, changed since it was fetched and checked): "
              "fetching it again", file=sys.stderr)
        self._drop_library_copy(st)
        os.unlink(self.local)
        if note is not None:
            os.unlink(self.note_path)
        return False

    def _snapshot(self) -> str:
        """Where ``huggingface_hub``'s cache keeps this file of this commit (a link to its blob)."""
        return os.path.join(hub_cache(), "models--" + self.ref.repo.replace("/", "--"), "snapshots", self.commit,
                            self.path)

    def _drop_library_copy(self, st: os.stat_result) -> None:
        """The library's blob of this file removed where it is this very file (``st``: its stat; linked by
        ``_adopt``), which was found damaged: else the library would hand the same bytes back."""
        real = os.path.realpath(self._snapshot())
        try:
            if os.path.samestat(os.stat(real), st):
                os.unlink(real)
        except OSError:
            pass

    def _adopt(self, check: bool = False) -> bool:
        """This commit's copy of the file in ``huggingface_hub``'s own cache (``hf download``, or any tool of the
        Hub's library, put it in ``snapshots/<commit>/``), made this folder's by a hard link where the disk allows
        (no byte copied or fetched), else copied, and sealed. The cache names each blob by the digest the Hub gave
        for it: a blob of another name, or any where ``check`` (one just fetched), is checked against the Hub's
        digest first."""
        real = os.path.realpath(self._snapshot())
        if not os.path.isfile(real) or os.path.getsize(real) != self.size or not self.size:
            return False
        if check or os.path.basename(real) not in {d for d in (self.sha256, self.blob) if d}:
            digest = _sha256(real) if self.sha256 else _git_blob(real) if self.blob else None
            if digest is None or digest not in (self.sha256, self.blob):
                return False
        os.makedirs(os.path.dirname(self.local), exist_ok=True)
        tmp = f"{self.local}.{os.getpid()}.{threading.get_ident()}.adopt"
        try:
            os.link(real, tmp)
        except OSError:
            shutil.copyfile(real, tmp)
        os.replace(tmp, self.local)  # over a partial file of ours, if there was one
        self._write_note(None)
        return True

    def whole_wanted(self, spans) -> bool:
        """Whether holding ``spans`` means fetching the whole file, bar its header where that is all it holds: a
        file for ``huggingface_hub`` to fetch (``diffuse.plan.libfetch.fetch_whole``)."""
        held = self.held()
        if not self.size or merged(held + [list(s) for s in spans]) != [[0, self.size]]:
            return False
        if not held:
            return True
        with open(self.local, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
        return merged(held) == [[0, 8 + n]]

    @contextlib.contextmanager
    def locked(self):
        """This file's lock (beside it), held: processes fetching the same file take turns."""
        os.makedirs(os.path.dirname(self.local), exist_ok=True)
        with open(_note_path(self.local)[: -len(".json")] + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

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
        """The file at ``local`` as its note describes it (repo, commit, path); None where it has no note."""
        note = _read_json(_note_path(local))
        if not note or "repo" not in note:
            return None
        folder = local[: len(local) - len(note["path"])]
        return cls(HubRef(note["repo"]), note["commit"], folder, note["path"], note["size"], note.get("sha256"),
                   note.get("blob"))

    def fetch(self, spans, progress: Progress | None = None) -> None:
        """Hold ``spans`` (lists of [start, stop)); the whole file once every byte is held (its digest checked).
        Processes fetching the same file take turns (a lock beside it) and fetch only what the other left."""
        if not self.to_fetch(spans) and not self._unsealed_whole() and (self.size or self.complete()):
            return
        with self.locked():
            self._fetch_locked(spans, progress)

    def _unsealed_whole(self) -> bool:
        """Every byte held but not yet checked (a process stopped while it checked them)."""
        note = self._note()
        return bool(note) and not note.get("sealed") and merged(note.get("spans") or []) == [[0, self.size]]

    def _fetch_locked(self, spans, progress) -> None:
        todo = self.to_fetch(spans)
        held = self.held()
        if todo and not held:
            self._write_note([])  # first: a file with no note beside it would be taken for one to check
            with open(self.local, "wb") as f:
                f.truncate(self.size)  # sparse: the ranges not fetched take no disk
        elif not self.size and not self.complete():
            open(self.local, "wb").close()
        fd = os.open(self.local, os.O_WRONLY)
        try:
            for a, b in todo:
                held = self._fetch_span(fd, a, b, held, progress)
                self._write_note(held)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise DiffuseError(f"the disk holding {os.path.dirname(self.local)} is full: free space there (or "
                                   "set HF_HOME to a disk with room) and run again; what was fetched is kept") from None
            raise
        finally:
            os.close(fd)
        if merged(held) == [[0, self.size]] and (todo or self._unsealed_whole()) or not self.size:
            self._seal()

    def _fetch_span(self, fd: int, a: int, b: int, held: list, progress) -> list:
        at, tries = a, 0
        noted = time.monotonic()
        while at < b:
            try:
                with request(file_url(self.ref.repo, self.commit, self.path), self.ref,
                             headers={"Range": f"bytes={at}-{b - 1}"}) as r:
                    whole = r.status == 200 and at == 0 and b == self.size
                    if not whole and (r.status != 206 or _range_start(r.headers.get("Content-Range")) != at):
                        raise DiffuseError(f"{self.ref}: {self.path} was not served the range asked for (HTTP "
                                           f"{r.status}, {r.headers.get('Content-Range')}); is HF_ENDPOINT a Hub?")
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
                "sha256": self.sha256, "blob": self.blob}
        if held is None:
            note.update(sealed=True, mtime_ns=os.stat(self.local).st_mtime_ns)
        else:
            note["spans"] = merged(held)
        tmp = f"{self.note_path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as f:
            json.dump(note, f)
        os.replace(tmp, self.note_path)

    def _seal(self) -> None:
        """Every byte held: checked against the Hub's digest, then sealed (the note says it is complete)."""
        if self._digest_ok() is False:
            os.unlink(self.local)
            os.unlink(self.note_path)
            raise DiffuseError(f"{self.ref}: {self.path} arrived damaged (its digest is not the one the Hub lists); "
                               "it was removed: run again to fetch it anew")
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
        raise DiffuseError(f"fetching {what} needs {size_text(needed)} in {folder}, which has {size_text(free)} free: free "
                           "space there, or set HF_HOME to a disk with room")


def spans_of(header: tuple[int, dict], keys) -> list[list[int]]:
    """The byte ranges of the named tensors in a safetensors file (``header``: its length and JSON)."""
    n, meta = header
    out = []
    for k in keys:
        a, b = meta[k]["data_offsets"]
        out.append([8 + n + a, 8 + n + b])
    return merged(out)


def _wanted(needs: dict[str, list[str]]) -> list[tuple[RepoFile, list[list[int]]]]:
    """(file, byte ranges not held yet) of each partial file of a Hub model that ``needs`` (safetensors file ->
    tensor names) names tensors of not held here. A file with no note is complete, or not a Hub model's."""
    todo = []
    for local, keys in needs.items():
        f = RepoFile.at(local)
        if f is None:
            continue
        spans = f.to_fetch(spans_of(f.header(), keys))
        if spans:
            todo.append((f, spans))
    return todo


def room_for(needs: dict[str, list[str]], folder: str, what: str) -> int:
    """Refused where the disk holding ``folder`` lacks room for the tensors ``needs`` names not held here yet
    (``check_room``), before any of them is fetched; the bytes of those."""
    total = sum(b - a for _, spans in _wanted(needs) for a, b in spans)
    if total:
        check_room(folder, total, what)
    return total


def fetch_all(todo: list, progress: Progress) -> None:
    """Each (file, byte ranges) of ``todo`` held: a file of a megabyte or more wanted whole by ``huggingface_hub``
    (``diffuse.plan.libfetch``), the others, and what a killed fetch of the library left of one, by range here; a
    file fetched whole here is put in the library's layout too."""
    for f, spans in todo:
        progress.file = f.path
        whole = library_wanted() and f.whole_wanted(spans)
        if not (whole and f.size >= LIBRARY_MIN_BYTES and fetch_whole(f, progress, hub_cache())):
            f.fetch(spans, progress)
            if whole and f.complete():
                offer(f, hub_cache())


def hold(needs: dict[str, list[str]], say=None, watch=None) -> None:
    """Every tensor ``needs`` names (safetensors file -> tensor names) held on this disk: in a partial file of a
    Hub model, the byte ranges of those not held yet are fetched first (one progress line for them all). A file
    with no note is complete, or not a Hub model's: nothing to do. ``watch``: given the ``Progress`` before the
    first byte, for whoever reports it meanwhile (a node's status)."""
    todo = _wanted(needs)
    if not todo:
        return
    total = sum(b - a for _, spans in todo for a, b in spans)
    check_room(os.path.dirname(todo[0][0].local), total, f"{todo[0][0].ref}'s tensors")
    progress = Progress(str(todo[0][0].ref), total, say)
    if watch is not None:
        watch(progress)
    fetch_all(todo, progress)
    progress.end()
