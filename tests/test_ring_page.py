"""The ring on the page of ``diffuse serve``, live, in a real headless Chromium (``pagetest``).

A tiny chat model served over three nodes given with ``--nodes``: a1 and a2 both hold the first half of its
layers (replicas), b the second. The page draws the chain a pass travels from the service's own status stream;
a1 is killed (SIGKILL) and the same page, never reloaded, shows it dead, then, once the next request ran, a2
serving in its place and a1 replaced, and that request's answer is the one before the kill.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

import pagetest
from conftest import THREADS, node_process, subprocess_env

httpx = pytest.importorskip("httpx")

ASK = {"model": "chat", "messages": [{"role": "user", "content": "Describe the ring."}], "max_tokens": 8}


def _node(model: str, blocks: str):
    log = tempfile.TemporaryFile("w+")
    proc = node_process(["--model", model, "--threads", str(THREADS), "--blocks", blocks, "--ephemeral-key"],
                        stderr=log)
    return proc, log


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    """The service (its URL), and the nodes by name: (process, address, key)."""
    import lm_models

    root = tmp_path_factory.mktemp("ring-page")
    model = lm_models.build("qwen2", str(root / "chat"))
    started = {name: _node(model, blocks) for name, blocks in (("a1", "1/2"), ("a2", "1/2"), ("b", "2/2"))}
    nodes = {}
    try:
        for name, (proc, log) in started.items():
            line = proc.stdout.readline()
            log.seek(0)
            assert line, f"node {name} did not start: {log.read()[-2000:]}"
            ready = json.loads(line)
            nodes[name] = (proc, ready["address"], ready["key"])
        port = _free_port()
        log_path = root / "serve.log"
        spec = ",".join(f"{a}#{k}" for _, a, k in nodes.values())
        with open(log_path, "w") as out:
            serve = subprocess.Popen([sys.executable, "-m", "diffuse.serve", "--threads", str(THREADS), "--model", model,
                                      "--nodes", spec, "--listen", f"127.0.0.1:{port}", "--max-tokens", "16"],
                                     stdout=out, stderr=subprocess.STDOUT, env=subprocess_env())
        try:
            deadline = time.monotonic() + 120
            while "serving on" not in log_path.read_text():
                assert serve.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.2)
            yield f"http://127.0.0.1:{port}", nodes
        finally:
            serve.terminate()
            serve.wait(10)
    finally:
        for proc, log in started.values():
            if proc.poll() is None:
                proc.terminate()
                proc.wait(10)
            log.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _card(page, address: str) -> dict:
    return page.eval_on_selector(f".node-card[data-address='{address}']", """c => ({state: c.dataset.state,
        text: c.innerText, inChain: !!c.closest('ol.chain')})""")


def _wait_state(page, address: str, state: str, in_chain: bool, timeout_s: float = 20) -> None:
    page.wait_for_function("([a, s, chained]) => { const c = document.querySelector(`.node-card[data-address='${a}']`);"
                           " return c && c.dataset.state === s && !!c.closest('ol.chain') === chained; }",
                           arg=[address, state, in_chain], timeout=timeout_s * 1000)


@pytest.mark.browser
@pagetest.needs_chromium
def test_a_killed_node_shows_dead_then_its_replica_serving_without_a_reload(ring):
    url, nodes = ring
    (a1, a1_address, a1_key), (_, a2_address, _), (_, b_address, _) = nodes["a1"], nodes["a2"], nodes["b"]
    before = httpx.post(url + "/v1/chat/completions", json=ASK, timeout=60).json()["choices"][0]["message"]["content"]
    with pagetest.opened(url) as page:
        page.evaluate("window.sameDocument = true")  # gone if the page reloads
        _wait_state(page, a1_address, "serving", True)
        _wait_state(page, b_address, "serving", True)
        _wait_state(page, a2_address, "spare", False)
        chain = page.eval_on_selector_all("ol.chain .node-card", "cs => cs.map(c => c.dataset.address)")
        assert chain == [a1_address, b_address]  # one holder of each half, the first listed
        # the passes' time and the link a1 measured to b come with the polls after the request's end
        page.wait_for_function("a => [...document.querySelectorAll('ol.chain li.hop')].every(h => / ms$/.test("
                               "h.textContent)) && document.querySelector(`.node-card[data-address='${a}'] .pass`)",
                               arg=a1_address, timeout=10000)
        a1_card = _card(page, a1_address)["text"]
        for said in (f"key {a1_key[:16]}…", "model.layers[0:2]", "cpu · float32", "held ", "free ", "pass "):
            assert said in a1_card, a1_card
        pagetest.shot(page, "page-ring.png")

        a1.send_signal(signal.SIGKILL)
        a1.wait(10)
        _wait_state(page, a1_address, "dead", True)  # the chain still runs through it: no request has run since
        assert page.eval_on_selector_all("ol.chain li.hop.broken", "hs => hs.length") == 2
        assert page.inner_text("#health") == "2 of 3 nodes answering"
        pagetest.shot(page, "page-ring-dead.png")

        t0 = time.monotonic()
        after = httpx.post(url + "/v1/chat/completions", json=ASK, timeout=60).json()["choices"][0]["message"]["content"]
        took = time.monotonic() - t0
        assert after == before  # the replica answers as a1 did
        assert took < 5, took  # the route left the dead node out rather than wait for its hello to time out
        _wait_state(page, a2_address, "serving", True)
        _wait_state(page, a1_address, "replaced", False)
        assert f"replaced by {a2_address}" in _card(page, a1_address)["text"]
        chain = page.eval_on_selector_all("ol.chain .node-card", "cs => cs.map(c => c.dataset.address)")
        assert chain == [a2_address, b_address]
        assert page.evaluate("window.sameDocument") is True  # all of it without a reload
        pagetest.shot(page, "page-ring-replaced.png")
