"""Logs an operator can use: ``--log-format json`` on the service and on the nodes, and one request's lines tied
together by its request id (``diffuse.plan.logs``).

Two nodes of the shipped chat model started with ``--log-format json``, a ``diffuse serve`` over them (``--nodes``)
with ``--log-format json``; one chat sent with an ``X-Request-Id``: the response says the id back, the service's
line of the request carries it, and each node's session open and close carry it too. Every line of the
three logs is one JSON object.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx

from conftest import THREADS, node_process, subprocess_env

MODEL = "tiny-qwen-chat"
RID = "test-req.42_a"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lines(path, only_json: bool = False) -> list[dict]:
    """Each line of the log at ``path`` as JSON (it fails unless every line parses); ``only_json``: the lines that
    start as an object (the service's console lines, "serving on ...", are for a person)."""
    with open(path) as f:
        return [json.loads(line) for line in f.read().splitlines() if line.strip()
                and (not only_json or line.startswith("{"))]


def _wait_for(what, path, proc, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not what(open(path).read()):
        assert proc.poll() is None and time.monotonic() < deadline, open(path).read()[-3000:]
        time.sleep(0.1)


def test_one_request_is_found_by_its_id_in_the_json_logs_of_the_service_and_every_node(tmp_path):
    procs, nodes, logs, addresses = [], [], [], []
    try:
        for k, share in enumerate(("1/2", "2/2")):
            logs.append(tmp_path / f"node{k}.log")
            with open(logs[-1], "w") as err:
                procs.append(node_process(["--model", MODEL, "--blocks", share, "--ephemeral-key", "--threads",
                                           str(THREADS), "--log-format", "json"], stderr=err))
            ready = json.loads(procs[-1].stdout.readline())
            nodes.append(f"{ready['address']}#{ready['key']}")
            addresses.append(ready["address"])
        port, served = _free_port(), tmp_path / "serve.log"
        with open(served, "w") as out:
            procs.append(subprocess.Popen([sys.executable, "-m", "diffuse.serve", "--model", MODEL, "--nodes",
                                           ",".join(nodes), "--listen", f"127.0.0.1:{port}", "--threads", str(THREADS),
                                           "--log-format", "json"], stdout=out, stderr=subprocess.STDOUT,
                                          env=subprocess_env()))
        _wait_for(lambda text: "serving on" in text, served, procs[-1])
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", headers={"X-Request-Id": RID}, timeout=60,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-request-id"] == RID, r.text
        bad = httpx.get(f"http://127.0.0.1:{port}/health", headers={"X-Request-Id": "no spaces; or this"}, timeout=10)
        made = bad.headers["x-request-id"]
        assert made != RID and len(made) == 32, made  # a header that is not short and plain: a fresh id instead
        _wait_for(lambda text: f'"{RID}"' in text, served, procs[-1], 10)
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
    service = _lines(served, only_json=True)
    asked = [line for line in service if line.get("request_id") == RID]
    assert [(a["event"], a["status"], a["path"]) for a in asked] == [("request", 200, "/v1/chat/completions")], service
    for log, share, address in zip(logs, ("1/2", "2/2"), addresses):
        lines = _lines(log)
        assert all({"time", "level", "logger", "message"} <= set(line) for line in lines), lines
        mine = [line for line in lines if line.get("request_id") == RID]
        assert [m["event"] for m in mine] == ["session_opened", "session_closed"], (share, lines)
        assert mine[0]["session"] == mine[1]["session"] and len(mine[0]["session"]) == 8, mine
        assert all(m["node"] == address and m["logger"] == "diffuse.node" for m in mine), mine
