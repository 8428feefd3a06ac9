"""``diffuse serve`` driven by the real ``openai`` client (and, for the page, a real headless Chromium: ``pagetest``).

One service process for the module, six tiny models (a chat model, a vision chat model, an image pipeline,
a video pipeline, a speech recogniser, a sound model), one local node each, every process at one torch
thread. Each answer is compared with what ``diffuse query`` gives for the same request: tokens and text,
file bytes.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import pagetest
from conftest import THREADS, run_client, subprocess_env
from diffuse.wire.transport import transport_for

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")  # the shape /v1/videos answers in
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

KEY = "test-key-7f3a"
PROMPT = "Describe the image."
ROLES = {  # model id in the service -> (builder module, name)
    "chat": ("lm_models", "qwen2"),
    "vision": ("lm_models", "smolvlm"),
    "image": ("families", "pixart_sigma"),
    "video": ("families", "wan"),
    "listen": ("encdec_models", "whisper"),
    "sound": ("encdec_models", "musicgen"),
}
# what the tiny pipelines need beyond the API's fields, declared in the folder as a shipped model would
DEFAULTS = {"image": {"use_resolution_binning": False, "clean_caption": False, "max_sequence_length": 16},
            "video": {"height": 32, "width": 32, "num_frames": 9, "max_sequence_length": 16}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    import importlib

    root = tmp_path_factory.mktemp("serve-models")
    out = {}
    for role, (module, name) in ROLES.items():
        out[role] = importlib.import_module(module).build(name, str(root / role))
        if role in DEFAULTS:
            with open(os.path.join(out[role], "diffuse_defaults.json"), "w") as f:
                json.dump(DEFAULTS[role], f)
    return out


class Served:
    def __init__(self, proc, url: str, log: str, folders: dict):
        self.proc, self.url, self.log, self.folders = proc, url, log, folders

    def client(self, key: str | None = KEY, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or "none", max_retries=0, **kw)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()

    def said(self) -> str:
        with open(self.log) as f:
            return f.read()


@pytest.fixture(scope="module")
def served(folders, tmp_path_factory):
    port = _free_port()
    log = str(tmp_path_factory.mktemp("serve-log") / "serve.log")
    cmd = [sys.executable, "-m", "diffuse.serve", "--threads", str(THREADS), "--local-nodes", "1",
           "--listen", f"127.0.0.1:{port}", "--api-key", KEY, "--max-body-mb", "1", "--max-waiting", "1", "--max-tokens", "16",
           "--node-metrics-port", "0"]
    for role in ROLES:
        cmd += ["--model", folders[role]]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=subprocess_env())
    s = Served(proc, f"http://127.0.0.1:{port}", log, folders)
    deadline = time.monotonic() + 240
    while "serving on" not in s.said():
        assert proc.poll() is None, s.said()[-3000:]
        assert time.monotonic() < deadline, "the service did not come up:\n" + s.said()[-3000:]
        time.sleep(0.3)
    yield s
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    for role in ROLES:  # every node the service started ended with it
        assert subprocess.run(["pgrep", "-f", f"diffuse.node --model {folders[role]} "]).returncode == 1


def query(tmp_path, *argv: str) -> dict:
    """``diffuse query ARGV`` (its client in this process), its report."""
    report = tmp_path / f"report-{time.monotonic_ns()}.json"
    run = run_client([*argv, "--threads", str(THREADS), "--local-nodes", "1", "--quiet", "--report", str(report)])
    assert run.returncode == 0, run.stderr[-3000:]
    with open(report) as f:
        return json.load(f)


def test_models_and_health(served):
    c = served.client()
    assert sorted(m.id for m in c.models.list()) == sorted(ROLES)
    h = served.health()
    assert h["ok"] is True
    for role in ROLES:
        (node,) = h["models"][role]["nodes"]
        assert node["alive"] and node["slices"], node  # it says what it holds
    kinds = {role: h["models"][role]["kind"] for role in ROLES}
    assert kinds == {"chat": "chat", "vision": "chat", "image": "image", "video": "video", "listen": "transcription",
                     "sound": "speech"}


def test_chat_equals_query(served, tmp_path):
    c = served.client()
    r = c.chat.completions.create(model="chat", messages=[{"role": "user", "content": PROMPT}], max_tokens=8)
    stream = c.chat.completions.create(model="chat", messages=[{"role": "user", "content": PROMPT}],
                                       max_completion_tokens=8, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    usage = [ch.usage for ch in chunks if ch.usage]
    ref = query(tmp_path, "--model", served.folders["chat"], "--prompt", PROMPT, "--max-new-tokens", "8")
    assert r.choices[0].message.content == ref["text"] == streamed
    assert r.usage.completion_tokens == ref["new_tokens"] == usage[0].completion_tokens == 8
    assert r.usage.prompt_tokens == ref["prompt_tokens"]
    assert r.choices[0].finish_reason == "length"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    # an answer that repeats itself: prompt lookup drafts (the default), an event may carry several tokens
    looping = "one two three four five one two three four five one two three"
    chunks = list(c.chat.completions.create(model="chat", messages=[{"role": "user", "content": looping}], stream=True,
                                            max_completion_tokens=16, stream_options={"include_usage": True},
                                            extra_body={"figures": True}))
    deltas = [ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content]
    ref = query(tmp_path, "--model", served.folders["chat"], "--prompt", looping, "--max-new-tokens", "16")
    assert "".join(deltas) == ref["text"] and [ch.usage.completion_tokens for ch in chunks if ch.usage] == [16]
    made = [ch.model_extra["figures"] for ch in chunks if (ch.model_extra or {}).get("figures")][0]
    # 16 tokens in fewer trips around the ring, so in fewer events (one a trip at most)
    assert made["tokens"] == 16 and 0 < made["accepted"] <= made["drafted"] and len(deltas) <= made["trips"] < 16


def test_vision_chat_equals_query(served, tmp_path):
    from PIL import Image

    picture = tmp_path / "picture.png"
    Image.fromarray((np.random.RandomState(3).rand(24, 24, 3) * 255).astype(np.uint8)).save(picture)
    url = "data:image/png;base64," + base64.b64encode(picture.read_bytes()).decode()
    r = served.client().chat.completions.create(model="vision", max_tokens=6, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": PROMPT}]}])
    ref = query(tmp_path, "--model", served.folders["vision"], "--prompt", PROMPT, "--image", str(picture),
                "--max-new-tokens", "6")
    assert r.choices[0].message.content == ref["text"]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ref["prompt_tokens"], ref["new_tokens"])


def test_completion_equals_query(served, tmp_path):
    r = served.client().completions.create(model="chat", prompt="The quick brown fox", max_tokens=6)
    ref = query(tmp_path, "--model", served.folders["chat"], "--prompt", "The quick brown fox", "--no-template",
                "--max-new-tokens", "6")
    assert r.choices[0].text == ref["text"]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ref["prompt_tokens"], ref["new_tokens"])


def test_image_equals_query(served, tmp_path):
    r = served.client().images.generate(model="image", prompt="a red cat", size="16x16",
                                        extra_body={"seed": 3, "steps": 2})
    png = base64.b64decode(r.data[0].b64_json)
    out = tmp_path / "query.png"
    query(tmp_path, "--model", served.folders["image"], "--prompt", "a red cat", "--seed", "3", "--steps", "2",
          "--height", "16", "--width", "16", "--out", str(out))
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png == out.read_bytes()


def test_image_stream_reports_steps(served):
    with httpx.stream("POST", served.url + "/v1/images/generations", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "image", "prompt": "a red cat", "size": "16x16", "steps": 3, "stream": True},
                      timeout=120) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    steps = [e["step"] for e in events if e["type"] == "image_generation.progress"]
    assert steps == [1, 2, 3] and events[-1]["type"] == "image_generation.completed"
    assert base64.b64decode(events[-1]["b64_json"])[:4] == b"\x89PNG"


def test_video_job_equals_query(served, tmp_path):
    c = served.client()
    job = c.videos.create(model="video", prompt="a red cat", extra_body={"seed": 1, "steps": 2})
    seen = {job.status}
    deadline = time.monotonic() + 180
    while job.status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
        job = c.videos.retrieve(job.id)
        seen.add(job.status)
    assert job.status == "completed" and job.progress == 100, job
    mp4 = c.videos.download_content(job.id).read()
    sheet = c.videos.download_content(job.id, variant="spritesheet").read()
    out = tmp_path / "query.mp4"
    query(tmp_path, "--model", served.folders["video"], "--prompt", "a red cat", "--seed", "1", "--steps", "2",
          "--out", str(out))
    assert mp4[4:8] == b"ftyp" and mp4 == out.read_bytes()
    from PIL import Image
    import io

    assert Image.open(io.BytesIO(sheet)).size == (32 * 9, 32)  # nine 32x32 frames side by side
    with pytest.raises(openai.NotFoundError):
        c.videos.retrieve("video_nosuchjob")


def test_transcription_equals_query(served, tmp_path):
    import encdec_reference

    clip = tmp_path / "clip.wav"
    encdec_reference.write_clip(str(clip))
    with open(clip, "rb") as f:
        r = served.client().audio.transcriptions.create(model="listen", file=f, extra_body={"max_tokens": 12})
    ref = query(tmp_path, "--model", served.folders["listen"], "--audio", str(clip), "--max-new-tokens", "12")
    assert r.text == ref["text"] and ref["new_tokens"] > 0


def test_speech_equals_query(served, tmp_path):
    wav = served.client().audio.speech.create(model="sound", input="happy drums", voice="alloy").read()
    out = tmp_path / "query.wav"
    query(tmp_path, "--model", served.folders["sound"], "--prompt", "happy drums", "--out", str(out))
    assert wav[:4] == b"RIFF" and wav == out.read_bytes()


def _error(resp) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"]), body
    assert "Traceback" not in resp.text
    return body["error"]


def test_errors_in_openai_shape_and_still_serving(served):
    auth = {"Authorization": f"Bearer {KEY}"}
    chat = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [
        (dict(json={**chat, "model": "nope"}, headers=auth), "/v1/chat/completions", 404, "model_not_found"),
        (dict(json={"model": "image", "prompt": "x", "size": "abc"}, headers=auth), "/v1/images/generations", 400,
         None),
        (dict(json={"model": "image", "prompt": "x", "size": "12x12", "steps": 1}, headers=auth),
         "/v1/images/generations", 400, None),  # the pipeline refuses sides not divisible by 8
        (dict(json={"model": "chat", "prompt": "x"}, headers=auth), "/v1/images/generations", 400, "wrong_model_kind"),
        (dict(json=chat), "/v1/chat/completions", 401, "invalid_api_key"),
        (dict(json=chat, headers={"Authorization": "Bearer wrong"}), "/v1/chat/completions", 401, "invalid_api_key"),
        (dict(content=b"{" + b" " * (2 << 20) + b"}", headers={**auth, "Content-Type": "application/json"}),
         "/v1/chat/completions", 413, "body_too_large"),
        (dict(content=b"not json", headers={**auth, "Content-Type": "application/json"}), "/v1/chat/completions",
         400, "invalid_json"),
        (dict(json={**chat, "temperature": 7}, headers=auth), "/v1/chat/completions", 400, None),
    ]
    for kw, path, status, code in cases:
        resp = httpx.post(served.url + path, timeout=60, **kw)
        assert resp.status_code == status, (path, kw.get("json"), resp.text)
        err = _error(resp)
        if code:
            assert err["code"] == code, err
    with pytest.raises(openai.AuthenticationError):
        served.client(key="wrong").models.list()
    r = served.client().chat.completions.create(**chat)  # still serving
    assert r.usage.completion_tokens == 2
    said = served.said()
    assert "Traceback" not in said
    assert "POST /v1/chat/completions 401" in said  # one line per request


def _sessions(served, role: str) -> int:
    return sum(n.get("sessions") or 0 for n in served.health()["models"][role]["nodes"])


def test_disconnect_closes_node_sessions(served):
    body = {"model": "chat", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", served.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json=body, timeout=60) as resp:
        lines = resp.iter_lines()  # kept open: a finished iterator would close the response
        got = 0
        while got < 3:
            line = next(lines)
            got += line.startswith("data: {") and '"content": "' in line and '"content": ""' not in line
        during = _sessions(served, "chat")
        lines.close()
    assert during >= 1  # the answer was still being generated, its session open on the node
    deadline = time.monotonic() + 20
    while _sessions(served, "chat") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _sessions(served, "chat") == 0
    r = served.client().chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=3)
    assert r.usage.completion_tokens == 3  # the next request is served


def test_busy_model_answers_429(served):
    """The image model answers one request at a time and lets one wait (--max-waiting 1): of three at once, one
    is refused with 429 and Retry-After, and the others are served."""
    results: list = []

    def ask():
        results.append(httpx.post(served.url + "/v1/images/generations", headers={"Authorization": f"Bearer {KEY}"},
                                  json={"model": "image", "prompt": "a cat", "size": "16x16", "steps": 100},
                                  timeout=300))

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for t in threads:
        t.start()
        time.sleep(0.05)  # all three in before the first is done (100 steps take ~0.3 s here)
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in results)
    assert codes == [200, 200, 429], [r.text[:200] for r in results]
    busy = next(r for r in results if r.status_code == 429)
    assert int(busy.headers["Retry-After"]) >= 1 and _error(busy)["type"] == "rate_limit_error"


def _scrape(url: str) -> dict:
    """A metrics page as prometheus_client's own parser reads it: {(sample, frozenset of labels): value}."""
    text = httpx.get(url, headers={"Authorization": f"Bearer {KEY}"}, timeout=10).raise_for_status().text
    return {(x.name, frozenset(x.labels.items())): x.value for f in text_string_to_metric_families(text)
            for x in f.samples}


def test_metrics_move_and_agree(served):
    """/metrics and the chat model's node's port (--node-metrics-port 0), scraped before, during and after two
    concurrent chats and a bad control request: the counts move by what the answers and the node's status say."""
    (node,) = served.health()["models"]["chat"]["nodes"]
    (s0, n0), ask = (_scrape(served.url + "/metrics"), _scrape(node["metrics"])), served.client().chat.completions
    with ThreadPoolExecutor(2) as pool:
        asked = [pool.submit(ask.create, model="chat", messages=[{"role": "user", "content": f"{PROMPT} {i}"}],
                             max_tokens=6) for i in range(2)]
        assert _scrape(served.url + "/metrics") and _scrape(node["metrics"])  # answered while the chats run
        usage = [f.result().usage for f in asked]
    control = functools.partial(transport_for(node["address"]).request, node["address"], timeout_s=10.0)
    assert control({"op": "no such op"})["ok"] is False  # refused: a malformed request
    s1, n1, status = _scrape(served.url + "/metrics"), _scrape(node["metrics"]), control({"op": "status"})

    def moved(a, b, name, **labels):  # how far one sample of model "chat" moved from a to b
        (key,) = [k for k in b if k[0] == name and {("model", "chat"), *labels.items()} <= k[1]]
        return b[key] - a.get(key, 0)
    assert moved(s0, s1, "diffuse_requests_total", kind="chat", outcome="ok") == 2
    assert moved(s0, s1, "diffuse_time_to_first_token_seconds_count") == 2
    assert moved(s0, s1, "diffuse_generated_tokens_total") == sum(u.completion_tokens for u in usage) == 12
    assert moved(s0, s1, "diffuse_prompt_tokens_total") == sum(u.prompt_tokens for u in usage)
    assert moved(n0, n1, "diffuse_node_passes_total", outcome="ok", node=node["address"]) == moved(
        s0, s1, "diffuse_ring_passes_total") >= 12
    assert moved({}, n1, "diffuse_node_passes_total", outcome="ok") == status["totals"]["passes"] - status["totals"]["pass_errors"]
    for hop, seen in (("in", "sent"), ("out", "received")):  # the node's hops are the service's two ends
        assert moved(n0, n1, "diffuse_node_bytes_total", direction=hop) == moved(
            s0, s1, "diffuse_ring_bytes_total", direction=seen) > 0
    assert moved(n0, n1, "diffuse_node_busy_seconds_total") > 0 and moved({}, n1, "diffuse_node_sessions") == 0
    assert moved(n0, n1, "diffuse_node_refusals_total", reason="request") == 1 <= status["totals"]["refusals"]["request"]
    assert moved({}, n1, "diffuse_node_memory_bytes", part="weights") > 0

def test_ring_view_says_each_node_and_the_chain(served):
    """/ring (behind the key): every node of every model with its key's start, device, memory and state; once a
    chat ran, the chat model's chain is its node, serving, with the time its passes took."""
    assert httpx.get(served.url + "/ring", timeout=10).status_code == 401
    served.client().chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    deadline = time.monotonic() + 10
    while True:
        ring = {m["name"]: m for m in httpx.get(served.url + "/ring", headers={"Authorization": f"Bearer {KEY}"},
                                                  timeout=10).json()["models"]}
        (node,) = ring["chat"]["nodes"]
        if node["pass_ms"] or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert set(ring) == set(ROLES)
    (address,) = [n["address"] for n in served.health()["models"]["chat"]["nodes"]]
    assert ring["chat"]["chain"] == [address] and node["state"] == "serving" and node["pass_ms"] > 0, node
    assert node["slices"] == ["model.layers[0:4]"] and node["device"] == "cpu" and len(node["key"]) == 16
    assert node["memory"]["weights"] > 0 and node["memory"]["held"] >= node["memory"]["weights"], node
    assert node["memory"]["free"] > 0 and len(ring["chat"]["links"]) == 2  # the service to it, and back


@pytest.mark.browser
@pagetest.needs_chromium
def test_page_chats_and_generates(served):
    pagetest.chats_and_generates(served, KEY)


@pytest.mark.browser
@pagetest.needs_chromium
def test_page_plays_video_and_sound(served):
    pagetest.plays_video_and_sound(served, KEY)
