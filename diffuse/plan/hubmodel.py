"""A model named by its Hub id, made a folder on this disk holding what one process runs of it.

``fetch_model(ref, role)`` gives the folder of ``ref`` at the commit the Hub names for it now (offline: the
commit fetched last for that name), holding:

- ``"headers"``: the files the analysis reads (``diffuse.plan.repofiles.analysis_reads``: configs, indexes,
  shipped code; no tokenizer's data, no card) and each safetensors file's header (kilobytes). What ``diffuse
  check`` and ``diffuse plan`` read: the analysis, the verdict and each block's bytes come from these.
- ``"node"``: the same; a node's slice is fetched as it loads it (``diffuse.plan.fetching.hold``, called by
  ``load_into``), or all at once before it loads (with ``--blocks``), by range where the file holds other
  tensors too. A node never fetches an encoder, a VAE or a
  block it does not hold.
- ``"client"``: every file but the weights (tokenizer and processor files too), every component whole but the
  split ones (the denoiser; a language model itself), and of those
  only the tensors the client keeps: all but the stacks' blocks. No block a node holds, the first included:
  what a stack returns is learned from its first block run weightless or with zero weights
  (``analyzers/calls.py``), never from its weights.
- ``"client-ring"``: as ``"client"``, with the pipeline's encoders split too (``--encoders ring``,
  ``diffuse.plan.encoders``): of an encoder, the client fetches its ends and none of its layers.
- ``"client-decoder"``, ``"client-ring-decoder"``: as ``"client"`` and ``"client-ring"``, with the VAE on a node
  (``--decoder``, ``diffuse.plan.decoders``): none of its weights, only its config and its files' headers.
- ``"whole"``: everything (the reference a split run is compared with).

Only what loaders read is fetched (``diffuse.plan.repofiles``): safetensors weights (never ``.bin`` and the like,
nor a ``.fp16.``-style variant beside the plain file, nor a file a folder's weight index does not name), the
components a diffusers ``model_index.json`` names, and no media of the model card. ``.diffuse/hub.json`` in the
folder says which repo and commit it is. A file wanted whole comes through ``huggingface_hub`` into its cache and
is linked here (``diffuse.plan.libfetch``); parts of files by Diffuse's own range reads.
"""

from __future__ import annotations

import json
import os
import re
import threading

from diffuse.errors import DiffuseError
from diffuse.plan.fetching import MARKER, RepoFile, check_room, fetch_all, hub_folder, repo_root, spans_of
from diffuse.plan.fetchprogress import Progress
from diffuse.plan.hub import HubRef, Listing, listing, offline
from diffuse.plan.repofiles import analysis_reads, loaded_files, weight_indexes

ROLES = ("headers", "node", "client", "client-ring", "client-decoder", "client-ring-decoder", "whole")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def fetch_model(ref: HubRef, role: str = "whole", say=None) -> str:
    """The folder of ``ref`` holding what ``role`` needs (see the module's docstring); fetched where it lacks it."""
    if role not in ROLES:
        raise ValueError(f"role {role!r}: one of {ROLES}")
    found = _listing(ref)
    folder = os.path.join(repo_root(ref.repo), found.commit)
    if "model_index.json" in found.files:  # a pipeline: its components are the folders it names
        _fetch_whole(ref, [RepoFile(ref, found.commit, folder, "model_index.json", *found.files["model_index.json"])],
                     "its model index", say, folder)
    indexes = weight_indexes(loaded_files(found, folder))  # first: the weights are the files they name
    _fetch_whole(ref, [RepoFile(ref, found.commit, folder, p, *found.files[p]) for p in indexes], "its weight indexes",
                 say, folder)
    files = {p: RepoFile(ref, found.commit, folder, p, *found.files[p]) for p in loaded_files(found, folder)}
    weights = {p: f for p, f in files.items() if p.endswith(".safetensors")}
    configs = [f for p, f in files.items() if p not in weights and analysis_reads(p, f.size)]
    rest = [f for p, f in files.items() if p not in weights and not analysis_reads(p, f.size)]  # tokenizers, card
    _fetch_whole(ref, configs, "its configs", say, folder)
    for f in weights.values():
        f.header()
    if role == "whole":  # one room check and one progress line for all of it, before any comes
        _fetch_whole(ref, rest + list(weights.values()), "its weights and tokenizer", say, folder)
    elif role.startswith("client"):
        _fetch_for_client(ref, folder, weights, rest, say, "-ring" in role, role.endswith("-decoder"))
    _mark(folder, found, ref)
    return folder


def complete_model(folder: str, say=None) -> None:
    """Every file of a folder ``fetch_model`` made fetched (a whole run from a client's folder)."""
    mark = hub_folder(folder)
    if mark is not None:
        fetch_model(HubRef(mark["repo"], mark["commit"]), "whole", say)


def fetch_card(folder: str) -> str | None:
    """Where the model card (``README.md``) of a folder ``fetch_model`` made is, fetched if it is not here yet
    (``diffuse host`` shows it; no role fetches it but the client's); None where there is none to be had."""
    listed, mark = stored_listing(folder), hub_folder(folder)
    if listed is None or mark is None or "README.md" not in listed.files:
        return None
    card = RepoFile(HubRef(mark["repo"], mark["commit"]), listed.commit, folder, "README.md",
                    *listed.files["README.md"])
    try:
        _fetch_whole(card.ref, [card], "its card", lambda line: None, folder)
    except DiffuseError:  # offline, or the Hub gone meanwhile: no card
        return None
    return card.local


def _listing(ref: HubRef) -> Listing:
    """The Hub's listing of ``ref`` (kept with the folder, and the name's commit kept, for offline runs); offline,
    the one kept."""
    root = repo_root(ref.repo)
    revision = ref.revision or "main"
    if offline():
        commit = revision if _COMMIT.match(revision) else _read(os.path.join(root, "refs", revision))
        kept = commit and os.path.join(root, commit, ".diffuse", "listing.json")
        if kept and os.path.isfile(kept):
            with open(kept) as f:
                return Listing.from_json(json.load(f))
        raise DiffuseError(f"{ref} is not fetched here and the Hub may not be reached (HF_HUB_OFFLINE is set): run "
                           "once without HF_HUB_OFFLINE to fetch it")
    found = listing(ref)
    keep = os.path.join(root, found.commit, ".diffuse")
    os.makedirs(keep, exist_ok=True)
    _write(os.path.join(keep, "listing.json"), json.dumps(found.as_json()))
    os.makedirs(os.path.join(root, "refs"), exist_ok=True)
    if not _COMMIT.match(revision) and "/" not in revision:
        _write(os.path.join(root, "refs", revision), found.commit)
    return found


def _fetch_whole(ref: HubRef, files: list, what: str, say, where: str) -> None:
    """``files`` fetched whole where they are not complete here: one room check and one progress line for them
    all."""
    _fetch_spans(ref, [(f, [[0, f.size]]) for f in files if not f.complete()], what, say, where)


def _fetch_spans(ref: HubRef, todo: list, what: str, say, where: str) -> None:
    """Each (file, byte ranges) of ``todo`` held: the room for every byte not held yet checked on the disk of
    ``where`` before the first one comes, then one progress line for them all."""
    if not todo:
        return
    total = sum(b - a for f, spans in todo for a, b in f.to_fetch(spans))
    check_room(where, total, f"{ref}'s {what}")
    progress = Progress(f"{ref} ({what})", total, say)
    fetch_all(todo, progress)
    progress.end()


def _fetch_for_client(ref: HubRef, folder: str, weights: dict, rest: list, say, encoders: bool = False,
                      decoders: bool = False) -> None:
    """The files ``rest`` (tokenizers and the like) and the components whole but the split ones (``encoders``: a
    pipeline's encoders split too; ``decoders``: its VAE, all of it a stack a node holds); of those, every tensor
    but the stacks' blocks. The room for all of it is
    checked before its first byte."""
    from diffuse.plan.planner import analyze

    subject, draft = analyze(folder, encoders, decoders)  # a model Diffuse refuses is refused here, before any weights come
    split_dirs = {os.path.normpath(d) for d in subject.component_dirs().values()}
    split = {p: f for p, f in weights.items() if os.path.normpath(os.path.dirname(f.local)) in split_dirs}
    todo = [(f, [[0, f.size]]) for f in rest + [f for p, f in weights.items() if p not in split] if not f.complete()]
    far = remote_keys(subject, draft["stacks"])
    for f in split.values():
        header = f.header()
        spans = spans_of(header, [k for k in header[1] if k != "__metadata__" and (f.local, k) not in far])
        if f.to_fetch(spans):
            todo.append((f, spans))
    _fetch_spans(ref, todo, "the client's weights and tokenizer", say, folder)


def _slice_needs(subject, stacks, slices) -> tuple[dict[str, list[str]], str] | None:
    """A Hub model's tensors of ``slices`` (``Slice``s of ``stacks``), safetensors file -> tensor names, and their
    name in words; None for a folder of one's own."""
    mark = hub_folder(subject.path)
    if mark is None:
        return None
    blocks = block_keys(subject, stacks)
    needs: dict[str, list[str]] = {}
    for sl in slices:
        for i in range(sl.start, sl.stop):
            for file, key in blocks.get((sl.stack, i), ()):  # a block the model lacks: refused as it loads
                needs.setdefault(file, []).append(key)
    return needs, f"{mark['repo']}'s blocks {', '.join(str(s) for s in slices if not s.empty)}"


def check_slice_room(subject, stacks, slices) -> dict[str, list[str]] | None:
    """Refused before a node's first byte of tensors where the disk lacks room for every tensor of ``slices``
    (``Slice``s of ``stacks``) not held here yet: one check for the whole slice, which ``hold`` then fetches
    (a ``--blocks`` node's all at once before it loads, with one progress; else block by block as it loads).
    The slice's tensors (safetensors file -> tensor names) where some are still to fetch; None where none are
    (all held, or a folder of one's own)."""
    from diffuse.plan.fetching import room_for

    found = _slice_needs(subject, stacks, slices)
    if found is None:
        return None
    return found[0] if room_for(found[0], subject.path, found[1]) else None


def block_keys(subject, stacks) -> dict[tuple[str, int], set[tuple[str, str]]]:
    """(stack path, block index) -> the (file, tensor name in it) that block is read from."""
    from diffuse.plan.modelfiles import located, renamed_for

    skeleton = subject.meta_denoiser()
    paths = [s["path"] if isinstance(s, dict) else s.path for s in stacks]
    wmap = located(renamed_for(subject.weight_map(), skeleton), skeleton, paths)
    out: dict[tuple[str, int], set[tuple[str, str]]] = {}
    for path in paths:
        for i, block in enumerate(skeleton.get_submodule(path)):
            keys = out.setdefault((path, i), set())
            for name in block.state_dict():
                full = f"{path}.{i}.{name}"
                if full in wmap.converted:
                    keys.update((file, key) for key, _, file in wmap.converted[full].sources)
                elif full in wmap:
                    keys.add((wmap[full], wmap.source(full)))
    return out


def remote_keys(subject, stacks) -> set[tuple[str, str]]:
    """(file, tensor name in it) of every block of each stack: what only nodes hold."""
    return {k for keys in block_keys(subject, stacks).values() for k in keys}


def downloads(subject, stacks, rows) -> tuple[list[int], int] | None:
    """What each node of a placement fetches of a Hub model's folder (its blocks' tensors, as stored; ``rows``:
    each node's slices) and what the client fetches (see the module's docstring); None for a folder of one's own."""
    folder = subject.path
    listed = stored_listing(folder)
    if listed is None:
        return None
    sizes: dict[tuple[str, str], int] = {}

    def size(file: str, key: str) -> int:
        if (file, key) not in sizes:
            header = _local_header(file)
            for k, v in header[1].items():
                if k != "__metadata__":
                    sizes[(file, k)] = v["data_offsets"][1] - v["data_offsets"][0]
        return sizes[(file, key)]

    blocks = block_keys(subject, stacks)
    nodes = [sum(size(*k) for sl in row if not sl.empty for i in range(sl.start, sl.stop)
                 for k in blocks[(sl.stack, i)]) for row in rows]
    split_dirs = {os.path.normpath(d) for d in subject.component_dirs().values()}
    far = {k for keys in blocks.values() for k in keys}
    client = 0
    for p in loaded_files(listed, folder):
        local = os.path.join(folder, p)
        if p.endswith(".safetensors") and os.path.normpath(os.path.dirname(local)) in split_dirs:
            n = _local_header(local)[0]
            client += 8 + n + sum(size(local, k) for k in _local_header(local)[1] if k != "__metadata__"
                                  and (local, k) not in far)
        else:
            client += listed.files[p][0]
    return nodes, client


def stored_listing(folder: str) -> Listing | None:
    """The Hub's listing kept with a folder ``fetch_model`` made (sizes and sha256s of the repo's files)."""
    found = _read(os.path.join(folder, ".diffuse", "listing.json"))
    return Listing.from_json(json.loads(found)) if hub_folder(folder) is not None and found else None


def _local_header(path: str) -> tuple[int, dict]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return n, json.loads(f.read(n))


def _mark(folder: str, found: Listing, ref: HubRef) -> None:
    os.makedirs(os.path.join(folder, ".diffuse"), exist_ok=True)
    _write(os.path.join(folder, MARKER), json.dumps({"repo": found.repo, "commit": found.commit,
                                                      "revision": ref.revision or "main"}))


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _write(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
