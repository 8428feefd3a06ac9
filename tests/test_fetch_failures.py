"""What goes wrong while fetching a model named by its Hub id, against the loopback Hub (``tests/hubtest.py``):
a bad name, a missing token, no network, server errors, a damaged cached file, a disk without room (each one
line and exit 2, with a retry that works), and a fetch stopped while it checked what it had.
"""

from __future__ import annotations

import json
import os
import socket

from hubtest import (DENOISER, REPO, TOKEN, TOKENIZER, block_bytes, diffuse_cli, hub,  # noqa: F401 (hub: a fixture)
                     one_line, ranges_of, tensor_spans)


def test_bad_names_and_a_missing_token_end_in_one_line_each_with_a_retry_that_works(hub, tmp_path):
    assert "no model org/nope" in one_line(diffuse_cli(hub, "bad", tmp_path, "check", "org/nope"))
    assert "no revision 'v9'" in one_line(diffuse_cli(hub, "bad", tmp_path, "check", f"{REPO}@v9"))
    assert diffuse_cli(hub, "bad", tmp_path, "check", f"{REPO}@{hub.commit}").returncode == 0
    gated = one_line(diffuse_cli(hub, "bad", tmp_path, "check", "org/gated"))
    assert "gated" in gated and "HF_TOKEN" in gated, gated
    assert diffuse_cli(hub, "bad", tmp_path, "check", "org/gated", HF_TOKEN=TOKEN).returncode == 0


def test_offline_no_network_and_server_errors(hub, tmp_path):
    offline = one_line(diffuse_cli(hub, "off", tmp_path / "a", "check", REPO, DIFFUSE_HUB_OFFLINE="1"))
    assert "HF_HUB_OFFLINE" in offline, offline
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    unreachable = one_line(diffuse_cli(hub, "off", tmp_path / "a", "check", REPO, HF_ENDPOINT=closed))
    assert "cannot reach" in unreachable, unreachable
    from diffuse.bench.hubserver import Fault

    hub.faults.append(Fault("model_index.json"))  # answered 500 once: retried
    assert diffuse_cli(hub, "off", tmp_path / "a", "check", REPO).returncode == 0
    # fetched once, the model is checked offline from what this machine holds
    assert diffuse_cli(hub, "off", tmp_path / "a", "check", REPO, DIFFUSE_HUB_OFFLINE="1").returncode == 0


def test_a_damaged_cached_file_is_fetched_again(hub, tmp_path):
    assert diffuse_cli(hub, "damage", tmp_path, "check", REPO).returncode == 0
    folder = tmp_path / "hf" / "hub" / "diffuse" / "models--org--tiny-wan" / hub.commit
    config = folder / "transformer" / "config.json"
    size = config.stat().st_size
    config.write_bytes(b"x" * size)  # same size, other bytes
    before = hub.fetched("damage", "transformer/config.json")
    again = diffuse_cli(hub, "damage", tmp_path, "check", REPO)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "damaged" in again.stderr
    assert hub.fetched("damage", "transformer/config.json") == 2 * before
    assert json.loads(config.read_text())["_class_name"] == "WanTransformer3DModel"


def test_bytes_held_but_never_checked_are_checked_and_an_empty_file_is_made(hub, tmp_path, monkeypatch):
    """A process stopped while it checked a fetched file's digest leaves every byte held and nothing sealed: the
    next fetch checks and seals it, fetching nothing again. A file of no bytes is made and sealed too."""
    from diffuse.plan.fetching import RepoFile
    from diffuse.plan.hub import hub_ref, listing

    folder = tmp_path / "small"
    folder.mkdir()
    (folder / "config.json").write_text('{"a": 1}')
    (folder / "empty.txt").write_text("")
    (folder / "model.safetensors").write_bytes(open(os.path.join(hub.source, "text_encoder", "model.safetensors"),
                                                    "rb").read())
    hub.publish("org/small", str(folder))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint("small"))
    monkeypatch.setenv("DIFFUSE_HUB_OFFLINE", "0")
    ref = hub_ref("org/small")
    found = listing(ref)
    store = tmp_path / "store"
    files = {p: RepoFile(ref, found.commit, str(store), p, *found.files[p]) for p in found.files}
    weights = files["model.safetensors"]
    weights.fetch([[0, weights.size]])
    assert weights.complete() and found.files["model.safetensors"][1] and not found.files["config.json"][1]
    note = json.loads(open(weights.note_path).read())
    note.pop("sealed"), note.pop("mtime_ns")
    with open(weights.note_path, "w") as f:
        json.dump(dict(note, spans=[[0, weights.size]]), f)  # as a process killed while it hashed leaves it
    sent = hub.fetched("small")
    assert not weights.complete()
    weights.fetch([[0, weights.size]])
    assert weights.complete() and hub.fetched("small") == sent
    files["empty.txt"].fetch([[0, 0]])
    assert files["empty.txt"].complete() and os.path.getsize(files["empty.txt"].local) == 0
    files["config.json"].fetch([[0, files["config.json"].size]])  # kept in git: checked by its blob id
    assert files["config.json"].complete() and json.loads(open(files["config.json"].local).read()) == {"a": 1}


def test_a_disk_without_room_is_refused_before_a_byte_of_tensors(hub, tmp_path, monkeypatch, capsys):
    """The disk made to look nearly full (4 MB free past the 64 MB margin, the configs fit): a node given
    ``--blocks`` and a client each end in one line, status 2, naming the bytes they need and the folder, before a
    byte of any tensor was fetched: one check for the whole slice (not per block), one for all the client fetches."""
    import shutil

    from diffuse.cli.command import main as diffuse_main
    from diffuse.node import command as node_command
    from diffuse.plan.fetchprogress import size_text

    disk_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: disk_usage(path)._replace(free=68 << 20))
    monkeypatch.setattr(node_command, "keep_freed_memory", lambda: False)  # no malloc settings in this process
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as the commands set it: the libraries read local folders only
    monkeypatch.setenv("DIFFUSE_HUB_OFFLINE", "0")
    headers = {p: tensor_spans(os.path.join(hub.source, p)) for p in
               (DENOISER, "vae/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors")}
    n, spans = headers[DENOISER]
    client = sum(b - a for k, (a, b) in spans.items() if not k.startswith("blocks.")) + \
        sum(os.path.getsize(os.path.join(hub.source, p)) - 8 - headers[p][0] for p in headers if p != DENOISER) + \
        sum(os.path.getsize(os.path.join(hub.source, p)) for p in (TOKENIZER, "README.md"))  # and not configs
    runs = {"full-node": (lambda: node_command.main(["--model", REPO, "--blocks", "1/2", "--ephemeral-key"]),
                          block_bytes(spans, range(2))),
            "full-client": (lambda: diffuse_main(["query", "--model", REPO, "--nodes", "tcp://127.0.0.1:9",
                                                  "--prompt", "a red circle", "--quiet"]), client)}
    for who, (run, needed) in runs.items():
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint(who))
        monkeypatch.setenv("HF_HOME", str(tmp_path / who))
        folder = str(tmp_path / who / "hub" / "diffuse" / "models--org--tiny-wan" / hub.commit)
        assert run() == 2
        said = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and " node INFO " not in ln]
        assert len(said) == 1 and f"needs {size_text(needed)} in {folder}" in said[0], said
        for path, (n, _) in headers.items():
            assert all(b <= 8 + n for _, b in ranges_of(hub, who, path)), (who, path, ranges_of(hub, who, path))
        assert hub.fetched(who, ".safetensors") > 0  # the headers came
