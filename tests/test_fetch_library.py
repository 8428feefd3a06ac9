"""Whole files come through ``huggingface_hub`` (``diffuse.plan.libfetch``), parts of files by Diffuse's own range
reads, against the loopback Hub of tests/hubtest.py; what each fetched is read from the server's access log, by
the client each request came from (its ``User-Agent``).

A client's fetch: every file of a megabyte or more it holds whole was sent once, whole, to the Hub's library
(smaller ones, configs, to Diffuse), and each is the library's blob in its snapshot layout (the same inode in
Diffuse's folder); the denoiser's file, of which it holds the ends,
came by range to Diffuse and is not in that layout; the progress counted every byte. A node gets a shard every
tensor of which is its own through the library, one it shares by range; a client with its encoders on the ring
no layer of theirs, the first included. A fetch killed while the
library fetched a file goes on, in the next run, from the bytes the library left: that file's bytes over both runs
are its size, its last unwritten megabyte and a second's worth at most, and it ends in the library's layout too.
Server errors past the library's retries end in one line, as range reads' do; offline, the library is never
asked. And
``diffuse.from_pretrained(..., local_nodes=True)`` checks the room for all of a Hub model once, before its
first tensor byte.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from hubtest import DENOISER, REPO, TOKENIZER, hub, hub_env, tensor_spans  # noqa: F401 (hub: a fixture)


def sent(hub, who: str, file: str, by: str) -> list[tuple]:
    """(range asked, bytes sent) of each GET of ``file`` that ``who`` made through ``by`` (a User-Agent's part)."""
    return [(e["range"], e["sent"]) for e in hub.log if e["who"] == who and e["file"] == file
            and e["method"] == "GET" and by in e["agent"] and e["sent"]]


def snapshot(home, commit: str) -> str:
    return os.path.join(home, "hf", "hub", "models--org--tiny-wan", "snapshots", commit)


def test_a_client_gets_whole_files_through_the_hubs_library_and_parts_by_range(hub, tmp_path, monkeypatch):
    from diffuse.plan.hub import hub_ref
    from diffuse.plan.hubmodel import fetch_model, stored_listing
    from diffuse.plan.libfetch import LIBRARY_MIN_BYTES
    from diffuse.plan.repofiles import loaded_files

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint("lib-client"))
    monkeypatch.setenv("DIFFUSE_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as Diffuse's commands keep the libraries: the worker is online
    lines: list[str] = []
    folder = fetch_model(hub_ref(REPO), "client", say=lines.append)
    snap = snapshot(tmp_path, hub.commit)
    whole = [p for p in loaded_files(stored_listing(folder), folder) if p != DENOISER]
    big = [p for p in whole if os.path.getsize(os.path.join(hub.source, p)) >= LIBRARY_MIN_BYTES]
    assert TOKENIZER in big and "vae/diffusion_pytorch_model.safetensors" in big and len(big) < len(whole)
    for path in whole:
        size = os.path.getsize(os.path.join(hub.source, path))
        if size >= LIBRARY_MIN_BYTES:
            assert sent(hub, "lib-client", path, "hf_hub") == [(None, size)], path  # once, whole, by the library
        else:  # a config: read here, no process started for it
            assert sum(k for _, k in sent(hub, "lib-client", path, "diffuse")) == size, path
        mine, theirs = os.stat(os.path.join(folder, path)), os.stat(os.path.join(snap, path))
        assert (mine.st_ino, mine.st_size) == (theirs.st_ino, size), path  # one blob, in the library's layout
    n, _ = tensor_spans(os.path.join(hub.source, DENOISER))
    ranges = sent(hub, "lib-client", DENOISER, "diffuse")
    assert ranges and all(r is not None for r, _ in ranges) and not sent(hub, "lib-client", DENOISER, "hf_hub")
    assert sum(k for _, k in ranges) < os.path.getsize(os.path.join(hub.source, DENOISER)) - 8 - n  # no block
    assert not os.path.exists(os.path.join(snap, DENOISER))  # a partial file is Diffuse's alone
    done = re.search(r": (.*) of (.*) \(100%\)", lines[-1]) if lines else None
    assert done and done[1] == done[2], lines  # the library's bytes counted as they came, none twice


def test_a_node_gets_a_shard_all_its_own_through_the_library_and_a_shared_one_by_range(hub, tmp_path, monkeypatch):
    """The shipped model's denoiser cut into 4 shards: node 1 of 2 (blocks 0 and 1) holds every tensor of the first
    shard, which the library fetches whole, and part of the second (blocks 1 and 2), which comes by range."""
    from diffuse.bench.fetch import _fetch_as, _sharded

    for name in ("HF_HOME", "HF_ENDPOINT", "DIFFUSE_HUB_OFFLINE"):  # set by _fetch_as, put back after the test
        monkeypatch.setenv(name, os.environ.get(name, ""))
    source = _sharded(hub.source, str(tmp_path / "sharded"), 4)
    commit = hub.publish("org/lib-sharded", source)
    _fetch_as(hub, "lib-node", str(tmp_path), (1, 2), "org/lib-sharded")
    shard = "transformer/diffusion_pytorch_model-0000{}-of-00004.safetensors"
    own, shared = shard.format(1), shard.format(2)
    assert sent(hub, "lib-node", own, "hf_hub") == [(None, os.path.getsize(os.path.join(source, own)))]
    snap = os.path.join(tmp_path, "lib-node", "hub", "models--org--lib-sharded", "snapshots", commit, own)
    folder = os.path.join(tmp_path, "lib-node", "hub", "diffuse", "models--org--lib-sharded", commit, own)
    assert os.stat(snap).st_ino == os.stat(folder).st_ino
    ranges = sent(hub, "lib-node", shared, "diffuse")
    assert ranges and not sent(hub, "lib-node", shared, "hf_hub") and all(r is not None for r, _ in ranges)
    assert sum(k for _, k in ranges) < os.path.getsize(os.path.join(source, shared))


def test_a_whole_file_fetch_killed_midway_goes_on_from_what_the_library_left(hub, tmp_path):
    home = tmp_path / "home"
    with open(os.path.join(hub.source, DENOISER), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    size = os.path.getsize(os.path.join(hub.source, DENOISER))
    blobs = os.path.join(home, "hf", "hub", "models--org--tiny-wan", "blobs")
    code = "import sys; from diffuse.plan.resolve import resolve_model; resolve_model(sys.argv[1], 'whole')"
    rate = 1_000_000
    hub.rates["lib-killed"] = rate
    try:
        proc = subprocess.Popen([sys.executable, "-c", code, REPO], env=hub_env(hub, "lib-killed", home),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline, part = time.monotonic() + 90, []
        while proc.poll() is None and time.monotonic() < deadline and not part:
            time.sleep(0.1)
            part = [p for p in (os.listdir(blobs) if os.path.isdir(blobs) else ()) if p.startswith(digest)
                    and p.endswith(".incomplete") and os.path.getsize(os.path.join(blobs, p)) > 1_500_000]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        time.sleep(2.5)  # LEFT_S: the worker ends with its parent; the file it left is not written since
    finally:
        hub.rates.pop("lib-killed", None)  # (only now: the server sends no faster while the worker reads on)
    assert part, "the library never got far into the denoiser's file"
    deadline = time.monotonic() + 10  # the server logs a transfer once its end is seen
    while not sent(hub, "lib-killed", DENOISER, "hf_hub") and time.monotonic() < deadline:
        time.sleep(0.1)
    first = sum(k for _, k in sent(hub, "lib-killed", DENOISER, "hf_hub"))
    assert 1_500_000 < first < size, first
    run = subprocess.run([sys.executable, "-c", code, REPO], env=hub_env(hub, "lib-again", home),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    again = sent(hub, "lib-again", DENOISER, "")
    assert again and all(r is not None and r[0] > 1_000_000 for r, _ in again), again  # by range, past the start
    # twice at most: the megabyte the library had not written yet, and what a second brought meanwhile
    assert first + sum(k for _, k in again) <= size + (1 << 20) + rate, (first, again, size)
    kept = os.path.join(snapshot(home, hub.commit), DENOISER)
    with open(kept, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == digest  # whole and right, in the library's layout too


def test_from_pretrained_for_local_nodes_checks_the_room_for_all_of_a_hub_model_once(hub, tmp_path, monkeypatch):
    """``diffuse.from_pretrained(ORG/NAME, local_nodes=True)``: the model is fetched whole at once, its room checked
    once, before its first tensor byte: on a disk with room for the client's part but not for all of it, refused in
    one line before any tensor byte (the client's part alone is let through); with room, all of it comes, and the
    local nodes' start (``complete_model``) fetches nothing more."""
    import shutil

    import diffuse
    from diffuse.errors import DiffuseError
    from diffuse.plan.hubmodel import complete_model

    monkeypatch.setenv("DIFFUSE_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    disk_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: disk_usage(path)._replace(free=(64 << 20) + 12_000_000))
    for who, local in (("api-short", True), ("api-client", False)):
        monkeypatch.setenv("HF_HOME", str(tmp_path / who))
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint(who))
        if local:
            with pytest.raises(DiffuseError, match="needs .* in ") as refused:
                diffuse.from_pretrained(REPO, local_nodes=True)
            assert "\n" not in str(refused.value)
            for path in (DENOISER, "vae/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors"):
                n, _ = tensor_spans(os.path.join(hub.source, path))
                assert hub.fetched(who, path) <= 8 + n, (path, hub.fetched(who, path))  # its header, no tensor
        else:
            diffuse.from_pretrained(REPO)  # the client's part fits
    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "api-whole"))
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint("api-whole"))
    pipe = diffuse.from_pretrained(REPO, local_nodes=True)
    assert hub.fetched("api-whole", DENOISER) >= os.path.getsize(os.path.join(hub.source, DENOISER))
    before = hub.fetched("api-whole")
    complete_model(pipe._diffuse.path)  # what starting local nodes fetches
    assert hub.fetched("api-whole") == before


def test_a_client_with_its_encoders_on_the_ring_fetches_no_layer_of_theirs(hub, tmp_path, monkeypatch):
    """``--encoders ring``: of the text encoder the client fetches its ends (the token table, the final norm), no
    byte of any of its layers, the first included (what a stack returns is learned with zero weights), and of the
    denoiser no block."""
    from diffuse.plan.hub import hub_ref
    from diffuse.plan.hubmodel import fetch_model

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint("lib-ring"))
    monkeypatch.setenv("DIFFUSE_HUB_OFFLINE", "0")
    fetch_model(hub_ref(REPO), "client-ring", say=lambda line: None)
    for file, layer in (("text_encoder/model.safetensors", "encoder.block."), (DENOISER, "blocks.")):
        _, spans = tensor_spans(os.path.join(hub.source, file))
        layers = [span for key, span in spans.items() if key.startswith(layer)]
        got = [(r[0], r[0] + k) if r else (0, k) for r, k in sent(hub, "lib-ring", file, "")]
        assert layers and got and not [g for g in got for a, b in layers if g[0] < b and a < g[1]], (file, got)
        if layer == "encoder.block.":  # its token table came
            a, b = spans["shared.weight"]
            assert any(s <= a and b <= e for s, e in got), got


def test_server_errors_past_the_librarys_retries_end_in_one_line_and_a_retry_works(hub, tmp_path, monkeypatch):
    """The tokenizer's data (2 MB: fetched by the library) answered 500 five times: retried with the backoff, then
    one line naming the answer and what to do; run again, it comes."""
    from diffuse.bench.hubserver import Fault
    from diffuse.errors import DiffuseError
    from diffuse.plan.hub import RETRIES, hub_ref
    from diffuse.plan.hubmodel import fetch_model

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint("lib-500"))
    monkeypatch.setenv("DIFFUSE_HUB_OFFLINE", "0")
    monkeypatch.setenv("DIFFUSE_FETCH_BACKOFF", "0.05")
    hub.faults.extend(Fault(TOKENIZER) for _ in range(RETRIES))
    with pytest.raises(DiffuseError, match=f"answered 500 .* after {RETRIES} tries; try again later") as failed:
        fetch_model(hub_ref(REPO), "client", say=lambda line: None)
    assert "\n" not in str(failed.value)
    assert len([e for e in hub.log if e["who"] == "lib-500" and e["file"] == TOKENIZER and e["status"] == 500]) \
        == RETRIES
    folder = fetch_model(hub_ref(REPO), "client", say=lambda line: None)
    with open(os.path.join(folder, TOKENIZER), "rb") as mine, open(os.path.join(hub.source, TOKENIZER), "rb") as ours:
        assert mine.read() == ours.read()


def test_offline_the_library_is_not_asked_and_what_is_missing_is_refused_in_one_line(hub, tmp_path, monkeypatch):
    """``HF_HUB_OFFLINE`` as the user gave it (``DIFFUSE_HUB_OFFLINE=1``): a model whose config and weights' header
    are here but not its weights (a file the library would fetch) is refused in one line, and nothing at all is
    asked of the Hub, by the library least of all."""
    import shutil

    from diffuse.errors import DiffuseError
    from diffuse.plan.hub import hub_ref
    from diffuse.plan.hubmodel import fetch_model

    folder = tmp_path / "big"
    folder.mkdir()
    (folder / "config.json").write_text('{"a": 1}')
    shutil.copy(os.path.join(hub.source, "vae", "diffusion_pytorch_model.safetensors"), folder / "model.safetensors")
    hub.publish("org/lib-big", str(folder))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint("lib-offline"))
    monkeypatch.setenv("DIFFUSE_HUB_OFFLINE", "0")
    fetch_model(hub_ref("org/lib-big"), "headers", say=lambda line: None)
    asked = len([e for e in hub.log if e["who"] == "lib-offline"])
    monkeypatch.setenv("DIFFUSE_HUB_OFFLINE", "1")
    with pytest.raises(DiffuseError, match="HF_HUB_OFFLINE is set") as refused:
        fetch_model(hub_ref("org/lib-big"), "whole", say=lambda line: None)
    assert "\n" not in str(refused.value)
    assert len([e for e in hub.log if e["who"] == "lib-offline"]) == asked


def test_the_library_fetches_a_gated_repos_files_with_the_token_diffuse_reads(hub, tmp_path, monkeypatch):
    """``HF_TOKEN`` as Diffuse reads it is the library's too: a gated repo's large files (the loopback Hub answers
    401 to a request without its token) come through it."""
    from hubtest import TOKEN

    from diffuse.plan.hub import hub_ref
    from diffuse.plan.hubmodel import fetch_model

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint("lib-gated"))
    monkeypatch.setenv("DIFFUSE_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    fetch_model(hub_ref("org/gated"), "client", say=lambda line: None)
    size = os.path.getsize(os.path.join(hub.source, TOKENIZER))
    assert [(e["status"], e["sent"]) for e in hub.log if e["who"] == "lib-gated" and e["file"] == TOKENIZER
            and e["method"] == "GET" and "hf_hub" in e["agent"]] == [(200, size)]
