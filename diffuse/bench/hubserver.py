"""A Hugging Face Hub on loopback: the file API that ``huggingface_hub`` and Diffuse's fetching speak, serving
model folders published to it, for the tests and ``python -m diffuse.bench fetch`` (the real Hub is never
reached from here).

What it answers, as the Hub does: model search (``/api/models``), model info with the file list and each file's
size and sha256 (``/api/models/ORG/NAME[/revision/REV]``), and ``resolve`` (``HEAD`` with ``X-Repo-Commit``,
``ETag`` and ``Content-Length``; ``GET`` whole or by ``Range``). A gated repo answers 401 with
``X-Error-Code: GatedRepo`` to a request without the token it was published with; an unknown repo, revision or
file answers 404 with the Hub's error codes. Each publish of a folder to a repo is a new commit (its sha is
that of the file list), and ``main`` moves to it; older commits stay reachable by sha.

Every request is logged (``HubServer.log``: who, method, repo, file, the byte range asked, the bytes sent and the
client's ``User-Agent``).
Who is the first path segment when it starts with ``~``: a process given ``HF_ENDPOINT=<url>/~node0`` is logged
as ``node0``. ``rate`` (bytes a second, for every transfer together) slows transfers, so that one can be cut
midway; ``rates`` (who -> bytes a second) slows those to one process only, on a clock of its own; ``faults``
makes chosen transfers fail once (a 500 answer, or a connection dropped after some bytes).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Repo:
    commits: dict[str, str] = field(default_factory=dict)  # sha -> folder
    files: dict[str, dict[str, tuple[int, str]]] = field(default_factory=dict)  # sha -> {path: (size, sha256)}
    main: str = ""
    token: str | None = None  # gated: the token a request must carry
    card: dict = field(default_factory=dict)  # pipeline_tag, downloads, likes, tags


@dataclass
class Fault:
    """One transfer to spoil once: of a file whose path ends with ``suffix``, asking more than ``longer`` bytes;
    ``after`` bytes sent before the connection is dropped (None: answered 500 at once)."""

    suffix: str
    after: int | None = None
    longer: int = 0
    used: bool = False


LFS = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".ckpt", ".onnx", ".png", ".jpg", ".gif", ".mp4", ".wav")


def _listing(folder: str) -> dict[str, tuple[int, str, str | None]]:
    """path -> (size, its git blob id, its sha256 where the Hub keeps it in LFS: weights and media, as repos'
    .gitattributes have them; None for a file kept in git, which the Hub lists by blob id alone)."""
    out = {}
    for here, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(here, name)
            size = os.path.getsize(full)
            sha, blob = hashlib.sha256(), hashlib.sha1(f"blob {size}\0".encode())
            with open(full, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    sha.update(chunk)
                    blob.update(chunk)
            lfs = name.endswith(LFS) or size > 10 << 20
            out[os.path.relpath(full, folder).replace(os.sep, "/")] = (size, blob.hexdigest(),
                                                                       sha.hexdigest() if lfs else None)
    return out


class HubServer:
    """The loopback Hub: ``publish`` folders, point ``HF_ENDPOINT`` at ``url`` (or ``endpoint(who)``), read
    ``log``. A context manager: serving on a thread from enter to exit."""

    def __init__(self, rate: float | None = None):
        self.repos: dict[str, Repo] = {}
        self.log: list[dict] = []
        self.rate = rate
        self.rates: dict[str, float] = {}  # who -> bytes a second to that process alone (in place of ``rate``)
        self.faults: list[Fault] = []
        self._lock = threading.Lock()
        self._sent_at: dict = {}  # None (``rate``) or who -> the rate's clock: when it started, bytes sent since
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._thread: threading.Thread | None = None

    def endpoint(self, who: str) -> str:
        return f"{self.url}/~{who}"

    def publish(self, repo_id: str, folder: str, token: str | None = None, **card) -> str:
        """A new commit of ``repo_id`` holding ``folder``'s files (read in place, not copied); its sha."""
        files = _listing(folder)
        sha = hashlib.sha1(json.dumps(sorted(files.items())).encode()).hexdigest()
        repo = self.repos.setdefault(repo_id, Repo())
        repo.commits[sha], repo.files[sha], repo.main = os.path.abspath(folder), files, sha
        repo.token = token
        repo.card.update(card)
        return sha

    def fetched(self, who: str, suffix: str = "") -> int:
        """Bytes sent to ``who`` (of files whose path ends with ``suffix``)."""
        return sum(e["sent"] for e in self.log if e["who"] == who and e["file"].endswith(suffix))

    def __enter__(self) -> "HubServer":
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True, name="hub")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._http.shutdown()
        self._http.server_close()

    def _throttle(self, n: int, who: str = "") -> None:
        clock, rate = (who, self.rates[who]) if who in self.rates else (None, self.rate)
        if not rate:
            return
        with self._lock:
            now = time.monotonic()
            start, sent = self._sent_at.get(clock, (now, 0))
            if start + sent / rate < now - 0.05:  # idle a while: no credit saved up for a burst
                start, sent = now, 0
            self._sent_at[clock] = (start, sent + n)
            due = start + (sent + n) / rate
        wait = due - time.monotonic()
        if wait > 0:
            time.sleep(wait)

    def _fault(self, path: str, length: int) -> Fault | None:
        with self._lock:
            for f in self.faults:
                if not f.used and path.endswith(f.suffix) and length > f.longer:
                    f.used = True
                    return f
        return None


class _Handler(BaseHTTPRequestHandler):
    """The Hub's file API, answered from ``hub`` (set on the class ``_handler`` makes)."""

    hub: "HubServer"
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # the log is hub.log
        pass

    def do_HEAD(self):
        self._serve(body=False)

    def do_GET(self):
        self._serve(body=True)

    def _answer(self, status: int, payload=None, headers: dict | None = None, body: bool = True):
        data = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _error(self, status: int, code: str, message: str, body: bool):
        self._answer(status, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message}, body)

    def _serve(self, body: bool):
        url = urllib.parse.urlsplit(self.path)
        parts = [urllib.parse.unquote(p) for p in url.path.split("/") if p]
        who = parts.pop(0)[1:] if parts and parts[0].startswith("~") else ""
        entry = {"who": who, "method": self.command, "repo": "", "file": "", "range": None, "sent": 0,
                 "status": 0, "agent": self.headers.get("User-Agent", "")}
        try:
            self._route(parts, urllib.parse.parse_qs(url.query), entry, body)
        except (BrokenPipeError, ConnectionResetError):
            entry["status"] = entry["status"] or -1
        finally:
            with self.hub._lock:
                self.hub.log.append(entry)

    def _route(self, parts: list[str], query: dict, entry: dict, body: bool):
        if parts[:2] == ["api", "models"]:
            if len(parts) == 2:
                entry["status"] = 200
                return self._answer(200, _search(self.hub, query), body=body)
            rest = parts[2:]
            if "tree" in rest[:-1]:  # the file list (snapshot_download's): every file, one page
                at = rest.index("tree")
                found = self._repo("/".join(rest[:at]), rest[at + 1], entry, body)
                if found:
                    entry["status"] = 200
                    return self._answer(200, _tree(*found), body=body)
                return None
            revision = rest[rest.index("revision") + 1] if "revision" in rest[:-1] else "main"
            repo_id = "/".join(rest[:rest.index("revision")] if "revision" in rest[:-1] else rest)
            found = self._repo(repo_id, revision, entry, body)
            if found:
                repo, sha = found
                entry["status"] = 200
                return self._answer(200, _info(repo_id, repo, sha, "blobs" in query), body=body)
            return None
        if len(parts) >= 5 and parts[2] == "resolve":
            repo_id, revision, path = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            entry.update(repo=repo_id, file=path)
            found = self._repo(repo_id, revision, entry, body)
            if found:
                self._file(*found, path, entry, body)
            return None
        entry["status"] = 404
        return self._error(404, "EntryNotFound", f"no route {'/'.join(parts)}", body)

    def _repo(self, repo_id: str, revision: str, entry: dict, body: bool):
        entry["repo"] = repo_id
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            entry["status"] = 401
            return self._error(401, "RepoNotFound", f"Repository {repo_id} not found", body)
        if repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}":
            entry["status"] = 401
            return self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted: you must have "
                               "access to it and be authenticated to access it", body)
        sha = repo.main if revision == "main" else revision
        if sha not in repo.commits:
            entry["status"] = 404
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", body)
        return repo, sha

    def _file(self, repo: Repo, sha: str, path: str, entry: dict, body: bool):
        listed = repo.files[sha].get(path)
        if listed is None:
            entry["status"] = 404
            return self._error(404, "EntryNotFound", f"{path} does not exist at {sha}", body)
        size, blob, lfs_sha = listed
        digest = lfs_sha or blob
        start, stop = 0, size
        asked = self.headers.get("Range")
        if asked:
            try:
                a, b = asked.removeprefix("bytes=").split("-")
                start, stop = (int(a), min(int(b) + 1, size)) if a else (max(size - int(b), 0), size)
            except ValueError:
                entry["status"] = 416
                return self._answer(416, {"error": f"bad range {asked}"}, body=body)
            entry["range"] = (start, stop)
        fault = self.hub._fault(path, stop - start) if body else None
        if fault is not None and fault.after is None:
            entry["status"] = 500
            return self._answer(500, {"error": "internal error (a planted fault)"}, body=body)
        status = 206 if asked else 200
        entry["status"] = status
        self.send_response(status)
        self.send_header("X-Repo-Commit", sha)
        self.send_header("ETag", f'"{digest}"')
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(stop - start))
        if asked:
            self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{size}")
        self.end_headers()
        if not body:
            return None
        limit = stop - start if fault is None else min(fault.after, stop - start)
        with open(os.path.join(repo.commits[sha], path), "rb") as f:
            f.seek(start)
            while entry["sent"] < limit:
                chunk = f.read(min(64 << 10, limit - entry["sent"]))
                self.hub._throttle(len(chunk), entry["who"])
                self.wfile.write(chunk)
                entry["sent"] += len(chunk)
        if fault is not None:
            self.close_connection = True
            self.connection.shutdown(2)
        return None



def _handler(hub: HubServer):
    return type("Handler", (_Handler,), {"hub": hub})


def _info(repo_id: str, repo: Repo, sha: str, blobs: bool) -> dict:
    siblings = []
    for path, (size, blob, digest) in repo.files[sha].items():
        s = {"rfilename": path}
        if blobs:
            s.update(size=size, blobId=blob)
            if digest:
                s["lfs"] = {"sha256": digest, "size": size, "pointerSize": 134}
        siblings.append(s)
    card = repo.card
    return {"id": repo_id, "modelId": repo_id, "sha": sha, "private": False, "gated": "auto" if repo.token else False,
            "siblings": siblings, "downloads": card.get("downloads", 0), "likes": card.get("likes", 0),
            "pipeline_tag": card.get("pipeline_tag"), "tags": card.get("tags", []),
            "lastModified": "2026-01-01T00:00:00.000Z", "createdAt": "2026-01-01T00:00:00.000Z"}


def _tree(repo: Repo, sha: str) -> list[dict]:
    return [{"type": "file", "oid": blob, "size": size, "path": path,
             **({"lfs": {"oid": digest, "size": size, "pointerSize": 134}} if digest else {})}
            for path, (size, blob, digest) in repo.files[sha].items()]


def _search(hub: HubServer, query: dict) -> list[dict]:
    words = (query.get("search") or [""])[0].lower()
    task = (query.get("pipeline_tag") or query.get("filter") or [None])[0]
    rows = [_info(rid, r, r.main, False) for rid, r in hub.repos.items()
            if words in rid.lower() and (task is None or r.card.get("pipeline_tag") == task)]
    for row in rows:
        row.pop("siblings")
    key = (query.get("sort") or ["downloads"])[0]
    trending = {rid: r.card.get("trending", r.card.get("downloads", 0)) for rid, r in hub.repos.items()}
    if key == "likes":
        rows.sort(key=lambda r: -r.get("likes", 0))
    elif key in ("trending_score", "trendingScore"):
        rows.sort(key=lambda r: -trending[r["id"]])
    else:
        rows.sort(key=lambda r: -r.get("downloads", 0))
    limit = int((query.get("limit") or [len(rows)])[0])
    return rows[:limit]
