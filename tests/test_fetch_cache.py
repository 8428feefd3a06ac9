"""A model ``huggingface_hub`` already holds is not fetched again: its own cache is where Diffuse looks first.

The loopback Hub of tests/hubtest.py; ``huggingface_hub.snapshot_download`` (the Hub's own library, in a process
of its own) fills a Hugging Face home from it, then Diffuse resolves the same Hub id for a whole run in another
process with that home: from the server's access log, it was sent no byte of any file, and its folder's files are
the cache's own blobs (hard links), not copies. And a node given another slice later (the whole stack after its
first half) is sent the second half's bytes only.
"""

from __future__ import annotations

import os
import subprocess
import sys

from hubtest import DENOISER, REPO, block_bytes, hub, hub_env, ranges_of, tensor_spans  # noqa: F401 (hub: a fixture)


def test_a_model_the_hubs_own_library_downloaded_is_taken_from_its_cache_not_fetched_again(hub, tmp_path):
    home = tmp_path / "home"
    code = "import sys; from huggingface_hub import snapshot_download; print(snapshot_download(sys.argv[1]))"
    got = subprocess.run([sys.executable, "-c", code, REPO], env=hub_env(hub, "hf", home, HF_HUB_OFFLINE="0"),
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr[-2000:]
    snapshot = got.stdout.strip().splitlines()[-1]
    assert ranges_of(hub, "hf", DENOISER), "the Hub's library fetched the model itself"
    code = ("import sys; from diffuse.plan.resolve import resolve_model; "
            "print(resolve_model(sys.argv[1], 'whole', lambda line: None))")
    run = subprocess.run([sys.executable, "-c", code, REPO], env=hub_env(hub, "diffuse", home), capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    folder = run.stdout.strip().splitlines()[-1]
    sent = [e for e in hub.log if e["who"] == "diffuse" and e["method"] == "GET" and e["file"] and e["sent"]]
    assert not sent, sent  # the listing was asked (to pin the commit), no file's byte
    for here, _, names in os.walk(snapshot):
        for name in names:
            path = os.path.relpath(os.path.join(here, name), snapshot)
            mine, theirs = os.stat(os.path.join(folder, path)), os.stat(os.path.realpath(os.path.join(here, name)))
            assert (mine.st_ino, mine.st_size) == (theirs.st_ino, theirs.st_size), path  # the cache's own blob


def test_a_node_given_more_blocks_later_fetches_only_what_it_lacks(hub, tmp_path):
    from test_fetch import start_node
    from test_hardening import _stop

    home = tmp_path / "home"
    n, spans = tensor_spans(os.path.join(hub.source, DENOISER))
    blocks = sorted({int(k.split(".")[1]) for k in spans if k.startswith("blocks.")})
    half = len(blocks) // 2
    with open(tmp_path / "node.log", "w+") as log:
        for who, given in (("first", "1/2"), ("later", "1/1")):  # the same machine, its slice grown
            proc, ready = start_node(hub, who, home, given, log)
            _stop(proc)
    first, later = ranges_of(hub, "first", DENOISER), ranges_of(hub, "later", DENOISER)
    assert first and sum(b - a for a, b in later) <= 1.05 * block_bytes(spans, blocks[half:]), later
    held = [span for k, span in spans.items() if k.startswith("blocks.") and int(k.split(".")[1]) < half]
    assert later and not [r for r in later for o in held if r[0] < o[1] and o[0] < r[1]], later  # none twice
