"""Models named by their Hub id, fetched from a Hub on loopback that the tests start (``tests/hubtest.py``:
model info with its file list, ``resolve`` with HEAD headers and Range GETs, a gated repo), ``HF_ENDPOINT``
pointing at it. What each process fetched is read from the server's own access log, and what a split run
makes is compared with plain diffusers run whole on the same repo, downloaded by ``huggingface_hub``. What goes
wrong: ``tests/test_fetch_failures.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from conftest import TESTS, THREADS, node_process, subprocess_env
from hubtest import (DENOISER, REPO, TOKENIZER, block_bytes, diffuse_cli, hub, hub_env,  # noqa: F401 (hub: a fixture)
                     ranges_of, tensor_spans)

KWARGS = {"prompt": "a red circle moving right", "height": 32, "width": 32, "num_frames": 9,
          "num_inference_steps": 3, "guidance_scale": 5.0}


def start_node(hub, who: str, home, blocks: str, log):
    proc = node_process(["--model", REPO, "--blocks", blocks, "--ephemeral-key", "--threads", str(THREADS)],
                        stderr=log, env=hub_env(hub, who, home))
    line = proc.stdout.readline()
    assert line, f"node {who} ended: {open(log.name).read()[-3000:]}"
    return proc, json.loads(line)


def start_watched(hub, who: str, home, blocks: str, log, rate: float = 2_000_000):
    """``start_node`` with the Hub sending to this node at ``rate`` bytes a second: while it fetches its slice, its
    status and hello (at the address its log names) and the service's view of it (``NodeSet.health``) are read
    every 0.2 s, and once a sealed open is tried. The node, its ready line, and what each said while it fetched."""
    import re
    import threading

    from diffuse.plan.contracts import WIRE_VERSIONS
    from diffuse.serve.engines import NodeSet
    from diffuse.wire import sealing
    from diffuse.wire.transport import transport_for

    hub.rates[who] = rate
    try:
        proc = node_process(["--model", REPO, "--blocks", blocks, "--ephemeral-key", "--threads", str(THREADS),
                             "--metrics-port", "0"], stderr=log, env=hub_env(hub, who, home))
        ready: list[str] = []
        reader = threading.Thread(target=lambda: ready.append(proc.stdout.readline()), daemon=True)
        reader.start()
        said: dict[str, list] = {"status": [], "hello": [], "health": [], "metrics": []}
        address, deadline = None, time.monotonic() + 120
        while reader.is_alive() and time.monotonic() < deadline:
            if address is None:
                found = re.search(r"hello and status are answered at (\S+) ", open(log.name).read())
                address = found and found.group(1)
            else:
                asked = transport_for(address)
                for name, st in (("status", asked.request(address, {"op": "status"}, 5.0)),
                                 ("hello", asked.request(address, {"op": "hello", "wire": list(WIRE_VERSIONS)}, 5.0)),
                                 ("health", NodeSet([address]).health(5.0)[0])):
                    if "fetch" in st:
                        said[name].append(st)
                scraped = re.search(r"metrics at (\S+)", open(log.name).read())
                with urllib.request.urlopen(scraped.group(1), timeout=5) as r:  # its Prometheus port, as it fetches
                    fetched = dict(re.findall(r'^diffuse_node_fetch_bytes\{.*part="(\w+)".*\} (\S+)$',
                                              r.read().decode(), re.M))
                if fetched:
                    said["metrics"].append({k: float(v) for k, v in fetched.items()})
                if said["hello"] and "open" not in said:  # an open meanwhile: refused, saying how far it got
                    me = sealing.load_identity(None)
                    sealed = dict(sealing.seal_control({"op": "open", "session": os.urandom(16)},
                                                       said["hello"][0]["key"], me), op="open")
                    said["open"] = sealing.open_control(asked.request(address, sealed, 5.0), me)[0]
            time.sleep(0.2)
        reader.join(1)
        assert ready and ready[0], f"node {who} ended: {open(log.name).read()[-3000:]}"
        return proc, json.loads(ready[0]), said
    finally:
        hub.rates.pop(who, None)


def client_run(hub, who: str, home, pinned: str, out) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "diffuse.run", "--model", REPO, "--seed", "0", "--threads", str(THREADS),
           "--nodes", pinned, "--save-array", str(out), "--quiet", "--timeout", "120"]
    for k, v in KWARGS.items():
        cmd += ["--arg", f"{k}={json.dumps(v)}"]
    return subprocess.run(cmd, env=hub_env(hub, who, home), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def split_run(hub, tmp_path_factory):
    """Two nodes (blocks 1/2 and 2/2) and a client, each with a Hugging Face home of its own, all naming the model
    by its Hub id; the first read of over 1 MB of the denoiser's file is cut after 300 kB (a dropped connection)."""
    from diffuse.bench.hubserver import Fault

    root = tmp_path_factory.mktemp("fetch-split")
    hub.faults.append(Fault(DENOISER, after=300_000, longer=1_000_000))
    logs = {w: open(root / f"{w}.log", "w+") for w in ("node-a", "node-b")}
    nodes = []
    try:
        proc, ready, said = start_watched(hub, "node-a", root / "node-a", "1/2", logs["node-a"])  # fetched slowly
        nodes.append((proc, ready))
        nodes.append(start_node(hub, "node-b", root / "node-b", "2/2", logs["node-b"]))
        pinned = ",".join(f"{r['address']}#{r['key']}" for _, r in nodes)
        from diffuse.wire.transport import transport_for

        served = transport_for(ready["address"]).request(ready["address"], {"op": "status"}, 5.0)
        out = root / "split.npy"
        run = client_run(hub, "client", root / "client", pinned, out)
        logs_text = {w: (f.seek(0), f.read())[1] for w, f in logs.items()}
        yield {"run": run, "out": out, "root": root, "logs": logs_text, "pinned": pinned, "said": said,
               "served": served}
    finally:
        for proc, _ in nodes:
            proc.kill()
            proc.wait(10)
        for f in logs.values():
            f.close()


def test_a_split_run_from_a_hub_id_is_identical_to_the_whole_model_downloaded_from_the_same_repo(hub, split_run):
    run = split_run["run"]
    assert run.returncode == 0, run.stderr[-3000:]
    root = split_run["root"]
    env = hub_env(hub, "reference", root / "reference", HF_HUB_OFFLINE="0")
    got = subprocess.run([sys.executable, "-c", f"from huggingface_hub import snapshot_download as s; print(s({REPO!r}))"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr[-2000:]
    folder = got.stdout.strip().splitlines()[-1]
    ref = subprocess.run([sys.executable, os.path.join(TESTS, "reference.py"), "--model", folder, "--kwargs",
                          json.dumps(KWARGS), "--seed", "0", "--threads", str(THREADS), "--out", str(root / "ref.npy")],
                         env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-2000:]
    assert np.load(split_run["out"]).tobytes() == np.load(root / "ref.npy").tobytes()


def test_each_node_fetches_its_slice_and_the_client_none_of_the_nodes_blocks(hub, split_run):
    assert split_run["run"].returncode == 0, split_run["run"].stderr[-3000:]
    n, spans = tensor_spans(os.path.join(hub.source, DENOISER))
    blocks = sorted({int(k.split(".")[1]) for k in spans if k.startswith("blocks.")})
    half = len(blocks) // 2
    for who, mine in (("node-a", blocks[:half]), ("node-b", blocks[half:])):
        got = ranges_of(hub, who, DENOISER)
        slice_bytes = block_bytes(spans, mine)
        assert sum(b - a for a, b in got) <= 1.05 * slice_bytes, (who, got, slice_bytes)
        others = [span for k, span in spans.items() if k.startswith("blocks.") and int(k.split(".")[1]) not in mine]
        assert not [r for r in got for o in others if r[0] < o[1] and o[0] < r[1]], f"{who} fetched others' blocks"
        for other in ("vae/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors"):
            header = tensor_spans(os.path.join(hub.source, other))[0]
            assert sum(b - a for a, b in ranges_of(hub, who, other)) <= 16 + header, (who, other)
        assert "fetching org/tiny-wan" in split_run["logs"][who]  # progress on the node's console
        assert not ranges_of(hub, who, TOKENIZER), who  # configs only, no tokenizer
    assert hub.fetched("client", TOKENIZER) == os.path.getsize(os.path.join(hub.source, TOKENIZER))
    held = [span for k, span in spans.items() if k.startswith("blocks.")]  # every block, the first included
    client = ranges_of(hub, "client", DENOISER)
    assert client and not [r for r in client for o in held if r[0] < o[1] and o[0] < r[1]], client
    ends = sum(b - a for k, (a, b) in spans.items() if not k.startswith("blocks."))
    assert sum(b - a for a, b in client) <= 8 + n + ends, (client, ends)  # its header and its ends, each once
    # the first long read of the denoiser was cut: it was taken up again where it stopped, not from its start
    cut = next(e for e in hub.log if e["file"] == DENOISER and e["sent"] == 300_000 and e["range"] and
               e["range"][1] - e["range"][0] > 1_000_000)
    assert any(e["who"] == cut["who"] and e["file"] == DENOISER and e["range"] and e["status"] == 206 and
               e["range"][0] == cut["range"][0] + 300_000 for e in hub.log), cut


def test_a_node_fetching_its_slice_answers_status_and_hello_with_how_far_it_got_then_serves(hub, split_run):
    """node-a (blocks 1/2) was sent its slice at 2 MB/s: while it came, the node's status and hello and the
    service's view of it (``/health``'s rows) said a fetch that moved, and an open was refused saying how far it got;
    once ready, no fetch (and it served the run)."""
    assert split_run["run"].returncode == 0, split_run["run"].stderr[-3000:]
    said = split_run["said"]
    assert len(said["status"]) >= 2 and said["hello"] and said["health"], said
    n, spans = tensor_spans(os.path.join(hub.source, DENOISER))
    first, last = said["status"][0]["fetch"], said["status"][-1]["fetch"]
    assert 0 < first["bytes_total"] <= 1.05 * block_bytes(spans, range(2)) and first["what"] == REPO, first
    assert first["file"] == DENOISER and last["bytes_done"] > first["bytes_done"], (first, last)
    assert last["bytes_done"] <= last["bytes_total"] and last["rate_bps"] > 0 and last["eta_s"] >= 0, last
    assert said["hello"][0]["ok"] and said["hello"][0]["fetch"]["bytes_total"] == first["bytes_total"]
    row = said["health"][0]
    assert row["alive"] and row["fetch"]["bytes_total"] == first["bytes_total"] and " of " in row["fetching"], row
    scraped = said["metrics"]  # the node's metrics port said it too
    assert scraped and {m["total"] for m in scraped} == {first["bytes_total"]}, scraped
    assert scraped[-1]["done"] >= scraped[0]["done"] and all(m["done"] <= m["total"] for m in scraped), scraped
    assert split_run["served"]["ok"] and "fetch" not in split_run["served"], split_run["served"]
    refused = said["open"]
    assert not refused["ok"] and refused["error"].startswith("still fetching its slice: ") and " left" in \
        refused["error"], refused


def test_a_client_waits_for_a_node_still_fetching_within_its_timeout():
    """The client's side of it (``diffuse.client.fetchwait``), on a clock of its own: a line naming the node and
    how far its fetch got, hellos again until one says no fetch (a node loading what it fetched answers nothing
    for a while: waited for too); past the timeout, the node named with where its fetch stood."""
    from diffuse.client.fetchwait import until_fetched
    from diffuse.errors import NodeError

    now = [0.0]

    def clock():
        return now[0]

    def sleep(s):
        now[0] += s

    def fetching(done):
        return {"ok": True, "fetch": {"bytes_done": done, "bytes_total": 4_000_000_000, "rate_bps": 50_000_000,
                                      "eta_s": (4e9 - done) / 5e7, "what": REPO, "file": DENOISER}}

    answers = [fetching(2e9), NodeError("tcp://n:1", "did not answer"), {"ok": True, "key": b"k"}]

    def ask(timeout_s):
        got = answers.pop(0)
        if isinstance(got, Exception):
            raise got
        return got

    lines: list[str] = []
    hello, _ = until_fetched("tcp://n:1", fetching(1e9), ask, 300, lines.append, clock, sleep)
    assert hello == {"ok": True, "key": b"k"} and not answers
    assert lines == ["node tcp://n:1 is still fetching its slice: 1.0 GB of 4.0 GB (25%), 50.0 MB/s, about 60 s "
                     "left; waiting"], lines
    with pytest.raises(NodeError, match=r"not ready after 5 s \(the client's --timeout\): it was fetching its slice "
                       r"\(1.0 GB of 4.0 GB"):
        until_fetched("tcp://n:1", fetching(1e9), lambda t: fetching(1e9), 5, lines.append, clock, sleep)


def test_check_reads_configs_and_headers_only(hub, tmp_path):
    check = diffuse_cli(hub, "check", tmp_path, "check", REPO)
    assert check.returncode == 0, check.stderr[-2000:]
    assert check.stdout.startswith("splittable"), check.stdout
    for path in (DENOISER, "vae/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors"):
        header = tensor_spans(os.path.join(hub.source, path))[0]
        assert hub.fetched("check", path) <= 16 + header, path
    assert hub.fetched("check", TOKENIZER) == 0 and hub.fetched("check") < 100_000
    # diffuse plan says what each node and the client will fetch, from the same headers
    plan = diffuse_cli(hub, "check", tmp_path, "plan", REPO, "--memory", "1,1")
    assert plan.returncode == 0, plan.stderr[-2000:]
    n, spans = tensor_spans(os.path.join(hub.source, DENOISER))
    node1, node2 = (block_bytes(spans, r) / 1e6 for r in (range(2), range(2, 4)))
    assert f"node1 {node1:.1f} MB, node2 {node2:.1f} MB (their blocks)" in plan.stdout, plan.stdout
    assert f"{REPO}@{hub.commit[:12]}: 4 blocks" in plan.stdout
    assert hub.fetched("check") < 100_000


def test_an_interrupted_fetch_resumes_where_it_stopped(tmp_path):
    """A node's slice fetched at 1.5 MB/s, the node killed midway, started again: the second start fetches what
    the first did not (at most a second's worth twice), and nothing more."""
    from diffuse.bench.hubserver import HubServer
    from diffuse.plan.shipped import shipped_models

    source = shipped_models()["tiny-wan-shapes"]
    rate = 1_500_000
    with HubServer(rate=rate) as slow:
        slow.publish(REPO, source)
        log = open(tmp_path / "node.log", "w+")
        proc = node_process(["--model", REPO, "--blocks", "1/2", "--ephemeral-key"], stderr=log,
                            env=hub_env(slow, "first", tmp_path / "home"))
        deadline = time.monotonic() + 60
        while slow.fetched("first", DENOISER) < 2_000_000:
            assert proc.poll() is None and time.monotonic() < deadline, log.read()
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        first = slow.fetched("first", DENOISER)
        again = start_node(slow, "second", tmp_path / "home", "1/2", log)[0]
        again.kill()
        again.wait(10)
        second = slow.fetched("second", DENOISER)
        n, spans = tensor_spans(os.path.join(source, DENOISER))
        slice_bytes = block_bytes(spans, range(2))
        assert second < slice_bytes - 1_000_000, (first, second, slice_bytes)
        assert first + second <= 1.05 * slice_bytes + rate, (first, second, slice_bytes)


def test_a_node_holding_another_commit_is_refused_at_open_naming_both(hub, split_run, tmp_path):
    """The repo moves on (a new commit on main); a client of the new commit meets the nodes of the old one."""
    import shutil

    assert split_run["run"].returncode == 0, split_run["run"].stderr[-3000:]
    newer = tmp_path / "newer"
    shutil.copytree(hub.source, newer)
    (newer / "README.md").write_text("the card, edited\n")
    commit = hub.publish(REPO, str(newer))
    try:
        run = client_run(hub, "newer", tmp_path, split_run["pinned"], tmp_path / "o.npy")
        said = [ln for ln in run.stderr.splitlines() if ln.strip()]
        assert run.returncode != 0 and len(said) == 1, run.stderr[-3000:]
        assert hub.commit[:12] in said[0] and commit[:12] in said[0] and f"{REPO}@{commit}" in said[0], said
    finally:
        hub.publish(REPO, hub.source)  # main back where it was for any test after this one


def sharded_with_decoy(source: str, folder) -> str:
    """A copy of a one-file transformers model cut in two shards with their ``model.safetensors.index.json``, and
    beside them ``consolidated.safetensors`` (the whole model again, as Mistral's repos ship it: no loader reads
    it)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = load_file(os.path.join(source, "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, os.path.join(folder, shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in part})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    shutil.copy(os.path.join(source, "model.safetensors"), os.path.join(folder, "consolidated.safetensors"))
    return str(folder)


def test_a_language_model_by_hub_id_answers_token_for_token_and_its_client_leaves_the_layers(hub, tmp_path,
                                                                                             monkeypatch):
    """The shipped chat model published as ``org/tiny-chat``: a client's fetch leaves every decoder layer, the
    first too (its return map is learned with its weights zero). Published sharded, with a
    ``consolidated.safetensors`` beside the shards (``org/tiny-chat-shards``):
    ``diffuse query`` on 2 local nodes answers as plain transformers does run whole on the same weights, and no
    role (check's, a node's, a client's, the whole model's) fetches a byte of the file the index does not name."""
    from diffuse.plan.shipped import shipped_models

    chat = shipped_models()["tiny-qwen-chat"]
    hub.publish("org/tiny-chat", chat)
    hub.publish("org/tiny-chat-shards", sharded_with_decoy(chat, tmp_path / "shards"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "in-process"))
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint("lm-client"))
    monkeypatch.setenv("DIFFUSE_HUB_OFFLINE", "0")
    from diffuse.plan.hub import hub_ref
    from diffuse.plan.hubmodel import fetch_model

    fetch_model(hub_ref("org/tiny-chat"), "client", say=lambda line: None)
    n, spans = tensor_spans(os.path.join(chat, "model.safetensors"))
    far = [s for k, s in spans.items() if k.startswith("model.layers.")]
    got = ranges_of(hub, "lm-client", "model.safetensors")
    assert got and not [r for r in got for o in far if r[0] < o[1] and o[0] < r[1]], got
    assert sum(b - a for a, b in got) <= os.path.getsize(os.path.join(chat, "model.safetensors")) - \
        sum(b - a for a, b in far)
    from diffuse.plan.hubmodel import loaded_files, stored_listing

    for role in ("headers", "node", "client"):
        folder = fetch_model(hub_ref("org/tiny-chat-shards"), role, say=lambda line: None)
    assert "consolidated.safetensors" not in loaded_files(stored_listing(folder), folder)  # nor in plan's figures

    prompt, out = "Compute 12 + 30", tmp_path / "ref.json"
    ref = subprocess.run([sys.executable, os.path.join(TESTS, "lm_reference.py"), "--model", chat, "--prompt", prompt,
                          "--max-new-tokens", "12", "--threads", str(THREADS), "--out", str(out)],
                         env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-2000:]
    tokens = tmp_path / "tokens.json"
    run = diffuse_cli(hub, "lm", tmp_path, "query", "--model", "org/tiny-chat-shards", "--prompt", prompt, "--max-new-tokens",
                      "12", "--threads", str(THREADS), "--local-nodes", "2", "--save-tokens", str(tokens), "--quiet",
                      "--timeout", "120", timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(tokens.read_text())["new_tokens"] == json.loads(out.read_text())["new_tokens"]
    assert hub.fetched("lm", "model-00002-of-00002.safetensors")  # the whole model came from the shards
    assert not [e for e in hub.log if e["file"] == "consolidated.safetensors" and e["method"] == "GET"]


def test_a_model_given_by_its_hub_id_is_served_by_that_id(tmp_path):
    """``diffuse serve --model ORG/NAME`` lists the model as ``ORG/NAME`` (not the commit its folder is named by),
    and ``/v1/models/ORG/NAME`` finds it; a folder or a shipped model goes by its folder's name as before."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from diffuse.plan.resolve import model_name
    from diffuse.serve.info import _info_routes

    folder = str(tmp_path / "models--org--tiny-wan" / ("7" * 40))
    assert model_name(REPO, folder) == REPO and model_name(f"{REPO}@v2", folder) == f"{REPO}@v2"
    assert model_name("tiny-wan-shapes", "/site/diffuse/trained/tiny-wan-shapes") == "tiny-wan-shapes"
    assert model_name(str(tmp_path / "mine"), str(tmp_path / "mine")) == "mine"
    app = FastAPI()
    _info_routes(app, SimpleNamespace(engines={REPO: SimpleNamespace(describe=lambda: {"id": REPO})}))
    with TestClient(app) as client:
        assert client.get(f"/v1/models/{REPO}").json() == {"id": REPO}
        assert client.get("/v1/models").json()["data"] == [{"id": REPO}]
