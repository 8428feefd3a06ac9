"""Whole files of a Hub model fetched by ``huggingface_hub`` (``hf_hub_download``) into its own cache, then made
Diffuse's by a hard link.

Where a process needs a whole file of a megabyte or more (a tokenizer's data, a component it runs whole, a shard
every tensor of which is a node's own), the Hub's own library fetches it: into its cache (``HF_HUB_CACHE``, else
``HF_HOME/hub``), in its layout (``models--ORG--NAME/blobs/<etag>``, linked from ``snapshots/<commit>/<path>``),
where every other tool of the Hub's finds it, through ``hf_xet`` (or ``hf_transfer``) where installed, with the
endpoint and token Diffuse reads (``HF_ENDPOINT``, ``HF_TOKEN``). Diffuse then takes the file into its own folder
(``RepoFile._adopt``: a hard link, so no byte is stored twice), checks it against the Hub's digest and seals it.
A smaller whole file (a config: kilobytes, read by ``diffuse check`` and every node) comes by Diffuse's own read,
which costs no process start, and is put in the library's layout as well (``offer``), so that the snapshot there
is whole.

Part of a file (a node's tensors in a shard that holds others' too, the client's ends in the denoiser's file)
still comes by Diffuse's own HTTP range reads (``diffuse.plan.fetching``): the library fetches whole files only,
and through it every node would fetch every shard it touches whole.

The library runs in a process of its own (``python -m diffuse.plan.libfetch``), started at a process's first
whole file and kept for the next ones: Diffuse's commands keep the libraries offline (``HF_HUB_OFFLINE=1``, which
``huggingface_hub`` reads once, at import), and that process is online. It is handed one file at a time and
says the bytes as they come (the fetch's progress: bytes, rate, time left), retries a server error or a dropped
connection with Diffuse's backoff (``RETRIES``; the library resumes a cut transfer itself), and ends with the
process that started it (its input closes, or its parent is gone). A failure comes back as one line, as for
range reads (``hub_failure``).

Resume across runs: the library writes a file to ``blobs/<etag>.<random>.incomplete``, in order from its start
(a megabyte at a time here), and removes it on a failure it sees; killed, it leaves it behind and never reads it
again. Diffuse takes such a
leftover as the bytes its own partial file holds and fetches the rest by range (``leftover``), so a fetch killed
midway goes on where it stopped; the whole is checked against the Hub's digest, as every file is. A leftover with
holes in it (written by pieces, as ``hf_xet`` may) is not taken up: the library fetches that file anew.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import threading
import time

NO_SPACE = 28  # errno.ENOSPC
# the smallest file the library fetches: a smaller one (a config, kilobytes) comes by range here and is put in the
# library's layout all the same (``offer``); the library's process costs about half a second to start, and a HEAD and
# a GET a file, more than a config's bytes take, and would slow ``diffuse check`` and every node's start
LIBRARY_MIN_BYTES = 1 << 20
LEFT_S = 2.0  # seconds unwritten after which a partial file of the library's is taken for left behind


def blobs_dir(cache: str, repo: str) -> str:
    return os.path.join(cache, "models--" + repo.replace("/", "--"), "blobs")


def leftover(cache: str, repo: str, digest: str | None, size: int) -> str | None:
    """The largest file a killed ``huggingface_hub`` left of the blob ``digest`` (its etag: the sha256 of a file
    in LFS, else its git blob id) that no one has written for ``LEFT_S``, no larger than the file; None where
    none. (Diffuse's own processes take the file's lock before they look, so only another tool's download under
    way could be mistaken for one.)"""
    if not digest:
        return None
    found = [p for p in glob.glob(os.path.join(blobs_dir(cache, repo), f"{glob.escape(digest)}.*.incomplete"))
             if 0 < os.path.getsize(p) <= size and time.time() - os.path.getmtime(p) > LEFT_S and _dense(p)]
    return max(found, key=os.path.getsize) if found else None


def _dense(path: str) -> bool:
    """Whether a file has no holes: one written in order from its start (the library's plain HTTP download) has
    none; one written by pieces at their places (as a download by ``hf_xet`` may be) can, and is not taken up."""
    st = os.stat(path)
    return st.st_blocks * 512 >= st.st_size - 4096


def library_wanted() -> bool:
    """Whether whole files go through ``huggingface_hub`` (``DIFFUSE_HUB_LIBRARY=0``: Diffuse's range reads for
    every byte, as before). Never offline (``HF_HUB_OFFLINE`` as the user gave it): the library's process is
    online, and a range read refuses in one line what is not here."""
    from diffuse.plan.hub import offline

    return not offline() and \
        os.environ.get("DIFFUSE_HUB_LIBRARY", "1").strip().lower() not in ("0", "false", "no", "off")


def offer(f, cache: str) -> None:
    """The complete file ``f`` put in ``huggingface_hub``'s layout in ``cache`` too, where it lacks it: linked as
    the blob its digest names, and from the commit's snapshot (a relative link, as the library makes them)."""
    digest = f.sha256 or f.blob
    snap = os.path.join(os.path.dirname(blobs_dir(cache, f.ref.repo)), "snapshots", f.commit, f.path)
    if not digest or os.path.exists(snap):
        return
    blob = os.path.join(blobs_dir(cache, f.ref.repo), digest)
    try:
        os.makedirs(os.path.dirname(blob), exist_ok=True)
        if not os.path.exists(blob):
            os.link(f.local, blob)
        os.makedirs(os.path.dirname(snap), exist_ok=True)
        if os.path.lexists(snap):  # a link to a blob removed as damaged
            os.unlink(snap)
        os.symlink(os.path.relpath(blob, os.path.dirname(snap)), snap)
    except OSError:  # another disk, or no links there: the file stays Diffuse's only
        pass


def fetch_whole(f, progress, cache: str) -> bool:
    """The file ``f`` (a ``diffuse.plan.fetching.RepoFile``) fetched whole by ``huggingface_hub`` into its cache
    ``cache`` and taken from there (``RepoFile._adopt``, its digest checked), under the file's lock; its bytes added
    to ``progress``. False where a killed fetch of the library's left part of it: those bytes are now the file's
    (a partial file), for ``RepoFile.fetch`` to fetch the rest by range."""
    from diffuse.errors import DiffuseError
    from diffuse.plan.hub import RETRIES, endpoint, hub_failure, token

    with f.locked():
        if f.complete():
            return True
        left = leftover(cache, f.ref.repo, f.sha256 or f.blob, f.size)
        if left is not None and os.path.getsize(left) > sum(b - a for a, b in f.held()):
            n = os.path.getsize(left)
            f._write_note([])  # first: a file with no note beside it would be taken for one to check
            os.replace(left, f.local)
            os.truncate(f.local, f.size)
            f._write_note([[0, n]])
            if progress is not None:
                progress.add(n)  # as good as fetched: the range read brings the rest
            return False
        said = Worker.fetch({"repo": f.ref.repo, "commit": f.commit, "path": f.path, "cache": cache,
                             "endpoint": endpoint(), "token": token(), "retries": RETRIES,
                             "backoff": float(os.environ.get("DIFFUSE_FETCH_BACKOFF", "1"))}, progress,
                            sum(b - a for a, b in f.held()))  # its header, held and counted already
        if "failed" in said:
            if said["failed"].get("nospace"):
                raise DiffuseError(f"the disk holding {cache} is full: free space there (or set HF_HOME to a disk "
                                   "with room) and run again") from None
            raise hub_failure(failure(said["failed"]), f.ref) from None
        if not f._adopt(check=True):
            blob = os.path.realpath(f._snapshot())
            if os.path.isfile(blob):  # the library's copy is the damaged one: not to be handed back again
                os.unlink(blob)
            raise DiffuseError(f"{f.ref}: {f.path} arrived damaged (its digest is not the one the Hub lists); it "
                               "was removed: run again to fetch it anew")
        return True


class Worker:
    """The process running ``huggingface_hub`` for this one (see the module's docstring)."""

    _lock = threading.Lock()
    _proc: subprocess.Popen | None = None

    @classmethod
    def fetch(cls, ask: dict, progress, counted: int = 0) -> dict:
        """``ask`` (repo, commit, path, cache, endpoint, token; retries, backoff: the tries and the first wait
        between two) fetched whole into the library's cache; its bytes added to ``progress`` as they come, but
        the first ``counted`` (held here, and counted, already). The answer: ``{"done": path in the snapshot}`` or
        ``{"failed": ...}`` (``failure`` reads it). Left midway (an exception here), the process is ended: its next
        answer would be this file's."""
        with cls._lock:
            proc = cls._started()
            seen = told = 0  # the library's bytes so far (less where it starts again); those added to progress
            try:
                proc.stdin.write(json.dumps(ask) + "\n")
                proc.stdin.flush()
                for line in proc.stdout:
                    said = json.loads(line)
                    if "bytes" not in said:
                        return said
                    seen += said["bytes"]
                    if progress is not None and max(seen - counted, 0) != told:
                        progress.add(max(seen - counted, 0) - told)
                        told = max(seen - counted, 0)
            except OSError as exc:  # it ended between two files
                proc.kill()
                cls._proc = None
                return {"failed": {"unreachable": f"the process fetching with huggingface_hub ended ({exc})"}}
            except BaseException:
                proc.kill()
                cls._proc = None
                raise
            cls._proc = None
            return {"failed": {"unreachable": f"the process fetching with huggingface_hub ended ({proc.wait()})"}}

    @classmethod
    def _started(cls) -> subprocess.Popen:
        if cls._proc is None or cls._proc.poll() is not None:
            env = dict(os.environ, HF_HUB_OFFLINE="0", HF_HUB_DISABLE_PROGRESS_BARS="1", PYTHONUNBUFFERED="1")
            cls._proc = subprocess.Popen([sys.executable, "-m", "diffuse.plan.libfetch", str(os.getpid())],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                         text=True, env=env)
        return cls._proc


def failure(said: dict):
    """What the worker said of a failed fetch (not a full disk), as the exception ``diffuse.plan.hub.hub_failure``
    turns into one line: an ``HTTPError`` with the Hub's error code, or a ``URLError``."""
    import email.message
    import urllib.error

    if said.get("status"):
        headers = email.message.Message()
        for k, v in (said.get("headers") or {}).items():
            headers[k] = v
        return urllib.error.HTTPError(said.get("url") or "", said["status"], said.get("reason") or "", headers, None)
    return urllib.error.URLError(said.get("unreachable") or "unknown failure")


# -- the worker's side: python -m diffuse.plan.libfetch PARENT_PID ----------------------------------------------


class _Answers:
    """What the worker says to its parent: JSON lines on a copy of its standard output as it started; whatever a
    library prints goes where its logs go (standard error), never into the answers."""

    def __init__(self):
        self.out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)

    def say(self, what: dict) -> None:
        try:
            self.out.write(json.dumps(what) + "\n")
            self.out.flush()
        except OSError:  # the parent is gone: end here, before the library cleans up what it fetched so far
            os._exit(1)


def _told(answers: _Answers):
    """A ``tqdm`` that says each update (the library's bytes) to the parent."""
    from tqdm.auto import tqdm

    class Told(tqdm):
        def update(self, n=1):
            if n:
                answers.say({"bytes": int(n)})
            return super().update(n)

    return Told


def _described(exc: BaseException) -> dict:
    """A failure as the parent reads it (``failure``)."""
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if status:
        keep = ("X-Error-Code", "X-Error-Message")
        return {"status": int(status), "reason": getattr(response, "reason_phrase", "") or "",
                "url": str(getattr(getattr(response, "request", None), "url", "") or ""),
                "headers": {k: response.headers[k] for k in keep if k in response.headers}}
    for e in (exc, exc.__cause__, exc.__context__):
        if isinstance(e, OSError) and e.errno == NO_SPACE:
            return {"nospace": True}
    cause = exc.__cause__ or exc
    return {"unreachable": f"{type(cause).__name__}: {' '.join(str(cause).split())[:300]}"}


def _fetched(ask: dict, answers: _Answers) -> str:
    from huggingface_hub import hf_hub_download

    retries = ask["retries"]
    for attempt in range(retries):
        try:
            return hf_hub_download(ask["repo"], ask["path"], revision=ask["commit"], cache_dir=ask["cache"],
                                   endpoint=ask["endpoint"], token=ask["token"] or False, tqdm_class=_told(answers))
        except Exception as exc:  # noqa: BLE001 (said to the parent, which makes it one line)
            said = _described(exc)
            status = said.get("status") or 0
            if said.get("nospace") or (status and status < 500 and status != 429) or attempt == retries - 1:
                raise
            time.sleep(ask["backoff"] * 2 ** attempt)
    raise AssertionError("unreachable")


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)  # the library's partial file stays, for the next run to take up (``leftover``)


def main(argv: list[str]) -> int:
    from huggingface_hub import constants

    # a download is written (and its progress said) a piece at a time: 1 MiB, not the library's 10 MiB, so that a
    # fetch killed midway leaves all but its last megabyte for the next run to take up
    constants.DOWNLOAD_CHUNK_SIZE = 1 << 20
    answers = _Answers()
    threading.Thread(target=_watch, args=(int(argv[0]),), daemon=True).start()
    for line in sys.stdin:
        ask = json.loads(line)
        try:
            answers.say({"done": _fetched(ask, answers)})
        except Exception as exc:  # noqa: BLE001
            answers.say({"failed": _described(exc)})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
