"""Talking to the Hugging Face Hub: a model named ``ORG/NAME[@REVISION]``, its commit and file list, and byte
ranges of its files, over the Hub's plain file API.

Diffuse speaks HTTP itself here (``urllib``; a file wanted whole is fetched by ``huggingface_hub`` in a process of
its own, ``diffuse.plan.libfetch``), so that the libraries it loads models with can stay offline
(``HF_HUB_OFFLINE=1``, set by Diffuse's commands) while it fetches: offline for Diffuse is what the user asked
(``DIFFUSE_HUB_OFFLINE``, which the commands set from ``HF_HUB_OFFLINE`` as it was before they ran, see
``diffuse.home.libraries_offline``). ``HF_ENDPOINT`` and ``HF_TOKEN`` (or the token ``hf auth login`` saved) are
read at each call, as ``huggingface_hub`` reads them.

Every failure is a ``DiffuseError`` of one line that says what to do: an unknown repo, a gated repo without a
token, a revision the repo lacks, no network, a server error that outlived its retries.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

from diffuse.errors import DiffuseError

_REF = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?:@(?P<revision>[\w./-]+))?$")
RETRIES = 5  # tries of one request that meets a server error or a dropped connection


def backoff_s(tries: int) -> float:
    """The wait before try ``tries + 1``: ``DIFFUSE_FETCH_BACKOFF`` seconds (default 1) after the first, doubled
    after each further one."""
    return float(os.environ.get("DIFFUSE_FETCH_BACKOFF", "1")) * 2 ** (tries - 1)


@dataclass(frozen=True)
class HubRef:
    """A model on the Hub: ``repo`` (``ORG/NAME``) at ``revision`` (a branch, tag or commit; None: ``main``)."""

    repo: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo + (f"@{self.revision}" if self.revision else "")


def hub_ref(text: str) -> HubRef | None:
    """``text`` read as ``ORG/NAME[@REVISION]``; None where it is not one, or names something on this disk."""
    if not isinstance(text, str) or os.path.exists(text) or text.startswith((".", "/", "~")):
        return None
    m = _REF.match(text)
    return HubRef(m["repo"], m["revision"]) if m else None


def offline() -> bool:
    """Whether Diffuse may not reach the Hub: the user's ``HF_HUB_OFFLINE`` (see the module's docstring)."""
    value = os.environ.get("DIFFUSE_HUB_OFFLINE", os.environ.get("HF_HUB_OFFLINE", ""))
    return value.strip().lower() in ("1", "true", "yes", "on")


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def token() -> str | None:
    found = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if found:
        return found
    try:
        from huggingface_hub import get_token

        return get_token()
    except Exception:
        return None


@dataclass
class Listing:
    """What the Hub says of a repo at one commit: each file's size, sha256 (None for a file kept in git) and, for
    a file kept in git, its blob id."""

    repo: str
    commit: str
    files: dict[str, tuple] = field(default_factory=dict)  # path -> (size, sha256 | None, blob id | None)
    gated: bool = False
    card: dict = field(default_factory=dict)  # pipeline_tag, downloads, likes, tags

    def as_json(self) -> dict:
        return {"repo": self.repo, "commit": self.commit, "files": self.files, "gated": self.gated, "card": self.card}

    @classmethod
    def from_json(cls, data: dict) -> "Listing":
        return cls(data["repo"], data["commit"], {k: tuple(v) for k, v in data["files"].items()},
                   data.get("gated", False), data.get("card", {}))


class _SameHostAuth(urllib.request.HTTPRedirectHandler):
    """Redirects followed, the token kept only while the host stays the Hub's (a CDN gets no token)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urllib.parse.urlsplit(newurl).netloc != urllib.parse.urlsplit(req.full_url).netloc:
            new.headers.pop("Authorization", None)
            new.unredirected_hdrs.pop("Authorization", None)
        return new


_OPENER = urllib.request.build_opener(_SameHostAuth)  # holds no state of a run: handlers only


def request(url: str, ref: HubRef | str, method: str = "GET", headers: dict | None = None, timeout: float = 30):
    """``url`` opened (the response, to read), with the token where there is one; failures as one line."""
    if offline():
        raise DiffuseError(f"{ref} is not fetched here and the Hub may not be reached (HF_HUB_OFFLINE is set): "
                           "run once without HF_HUB_OFFLINE to fetch it")
    sent = {"User-Agent": "diffuse", "Accept-Encoding": "identity", **(headers or {})}
    if (t := token()):
        sent["Authorization"] = f"Bearer {t}"
    last = None
    for attempt in range(RETRIES):
        if attempt:
            time.sleep(backoff_s(attempt))
        try:
            return _OPENER.open(urllib.request.Request(url, headers=sent, method=method), timeout=timeout)
        except urllib.error.HTTPError as exc:
            if exc.code < 500 and exc.code != 429:
                raise hub_failure(exc, ref) from None
            last = exc
        except (urllib.error.URLError, OSError) as exc:
            last = exc
            if isinstance(exc, urllib.error.URLError) and attempt >= 1 and _refused(exc):
                break  # nothing listens there: no use waiting longer
    raise hub_failure(last, ref) from None


def _refused(exc) -> bool:
    reason = getattr(exc, "reason", None)
    return isinstance(reason, (ConnectionRefusedError, OSError)) and "refused" in str(reason).lower() or \
        "Name or service not known" in str(reason) or "nodename nor servname" in str(reason)


def hub_failure(exc, ref) -> DiffuseError:
    """``exc`` (a request's failure) as one line that says what to do about it."""
    where = endpoint()
    if isinstance(exc, urllib.error.HTTPError):
        code = exc.headers.get("X-Error-Code", "") if exc.headers else ""
        if code == "GatedRepo" or (exc.code in (401, 403) and "restricted" in (exc.headers.get("X-Error-Message") or "")):
            how = ("the token given (HF_TOKEN) has no access to it: accept its terms on its page with that account"
                   if token() else "give a token with access to it: HF_TOKEN=hf_... or `hf auth login`, after "
                   "accepting its terms on its page")
            return DiffuseError(f"{ref} is gated on {where}: {how}")
        if code == "RevisionNotFound":
            return DiffuseError(f"{ref}: the repo has no revision {getattr(ref, 'revision', '') or 'main'!r}; give a "
                                "branch, tag or commit it has (ORG/NAME@main, or a commit sha from its page)")
        if code == "EntryNotFound" or (exc.code == 404 and code != "RepoNotFound" and "/resolve/" in exc.url):
            return DiffuseError(f"{ref}: the Hub lists a file it does not serve ({exc.url.rsplit('/', 1)[-1]}); "
                                "try again, or name a commit (ORG/NAME@SHA)")
        if code == "RepoNotFound" or exc.code in (401, 404):
            hint = "" if token() else "; if it is private, give a token (HF_TOKEN=hf_... or `hf auth login`)"
            return DiffuseError(f"no model {getattr(ref, 'repo', ref)} on {where}: check the name "
                                f"(ORG/NAME, as its page on the Hub spells it){hint}")
        tried = f" after {RETRIES} tries" if exc.code >= 500 or exc.code == 429 else ""
        return DiffuseError(f"{ref}: {where} answered {exc.code} {exc.reason}{tried}; try again later (what was "
                            "fetched is kept, and the fetch resumes where it stopped)")
    reason = getattr(exc, "reason", exc)
    return DiffuseError(f"{ref}: cannot reach {where} ({type(reason).__name__}: {reason}); check the network "
                        "(or HF_ENDPOINT), then run again: what was fetched is kept")


def listing(ref: HubRef) -> Listing:
    """The commit ``ref`` names now and its files (the Hub's model info, with sizes and sha256s)."""
    revision = urllib.parse.quote(ref.revision or "main", safe="")
    url = f"{endpoint()}/api/models/{ref.repo}/revision/{revision}?blobs=true"
    with request(url, ref) as r:
        try:
            info = json.loads(r.read())
            files = {}
            for s in info.get("siblings") or ():
                lfs = s.get("lfs") or {}
                files[s["rfilename"]] = (int(s.get("size") or lfs.get("size") or 0), lfs.get("sha256"),
                                         None if lfs else s.get("blobId"))
            commit = info["sha"]
        except (ValueError, KeyError, TypeError) as exc:
            raise DiffuseError(f"{ref}: {endpoint()} answered model info Diffuse cannot read ({exc}); is "
                               "HF_ENDPOINT a Hugging Face Hub?") from None
    card = {k: info.get(k) for k in ("pipeline_tag", "downloads", "likes", "tags", "library_name") if k in info}
    return Listing(ref.repo, commit, files, bool(info.get("gated")), card)


def file_url(repo: str, commit: str, path: str) -> str:
    return f"{endpoint()}/{repo}/resolve/{commit}/{urllib.parse.quote(path)}"


SORTS = {"downloads": "downloads", "trending": "trendingScore", "likes": "likes"}  # what `diffuse host` offers


def search(words: str = "", sort: str = "downloads", task: str | None = None, limit: int = 40) -> list[dict]:
    """The Hub's model search, best first by ``sort`` (a key of ``SORTS``): rows with id, downloads, likes,
    pipeline_tag, tags."""
    query = {"search": words, "sort": SORTS.get(sort, sort), "direction": "-1", "limit": str(limit)}
    if task:
        query["pipeline_tag"] = task
    with request(f"{endpoint()}/api/models?{urllib.parse.urlencode(query)}", "the Hub's search") as r:
        try:
            rows = json.loads(r.read())
        except ValueError:
            rows = None
    if not isinstance(rows, list):
        raise DiffuseError(f"{endpoint()} answered a search Diffuse cannot read; is HF_ENDPOINT a Hugging Face Hub?")
    return [row for row in rows if isinstance(row, dict) and isinstance(row.get("id"), str)]
