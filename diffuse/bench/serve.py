"""``python -m diffuse.bench serve``: what a warm service gives over a cold command, and what concurrent streams
give over one, measured side by side in one run.

A Llama-shaped model (the geometry of ``bench lm``: 8 layers, hidden 512, vocabulary 8192, random weights,
with a word-level tokenizer over its vocabulary so the service can take text) is served by ``diffuse serve``
over 2 local nodes, every process at one torch thread. Measured through the HTTP API (streamed
``/v1/completions``, greedy, a fixed number of new tokens): one stream's tokens/s and time to first token;
N streams at once (tokens/s in all, p50/p99 time to first token); and ``diffuse query`` started cold for the
same answer (time from starting the command to its first token, and whether the text is the same).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

FULL = dict(layers=8, hidden=512, heads=8, kv_heads=2, ffn=1536, vocab=8192, prompt=64, new=32)
QUICK = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=512, prompt=16, new=8)


def build(out_dir: str, cfg: dict) -> None:
    """A Llama-shaped model at ``bench lm``'s geometry, and a tokenizer whose words are its ids (``w0`` ...), so
    prompts are text. (Llama, not Qwen2: transformers loads every qwen2 folder with Qwen2's own byte-level
    tokenizer, whatever the folder's tokenizer says.)"""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from diffuse.bench.lm import build as build_model

    build_model(out_dir, cfg, family="Llama")
    vocab = {f"w{i}": i for i in range(cfg["vocab"] - 1)}
    vocab["<unk>"] = cfg["vocab"] - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(out_dir)


def prompt_text(k: int, length: int, vocab: int) -> str:
    import random

    rng = random.Random(k)
    return " ".join(f"w{rng.randrange(vocab - 1)}" for _ in range(length))


def stream(port: int, model: str, prompt: str, new: int) -> dict:
    """One streamed completion: seconds to its first text, to its end, its tokens and text."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": new, "stream": True,
                       "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"the service answered {resp.status}: {resp.read()[:300]!r}")
    first = None
    text, tokens = [], 0
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("error"):
            raise RuntimeError(f"the stream failed: {chunk['error']['message']}")
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk.get("choices") or []:
            if choice.get("text"):
                first = first if first is not None else time.perf_counter() - t0
                text.append(choice["text"])
    end = time.perf_counter() - t0
    conn.close()
    return {"first": first, "end": end, "tokens": tokens, "text": "".join(text)}


def cold_query(model: str, prompt: str, new: int) -> dict:
    """``python -m diffuse.run`` started now: seconds to its first printed token and to its exit, its text."""
    cmd = [sys.executable, "-u", "-m", "diffuse.run", "--model", model, "--prompt", prompt, "--no-template",
           "--max-new-tokens", str(new), "--threads", "1", "--quiet"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=dict(os.environ))
    first = None
    out = b""
    while True:
        ch = proc.stdout.read(1)
        if not ch:
            break
        if first is None and ch.strip():
            first = time.perf_counter() - t0
        out += ch
    proc.wait()
    return {"first": first, "end": time.perf_counter() - t0, "text": out.decode().rstrip("\n"),
            "code": proc.returncode}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def start_service(model_dir: str, streams: int, log: str) -> tuple[subprocess.Popen, int]:
    """``diffuse serve`` on the model over 2 local nodes, every process at one torch thread; returns once it says
    it is serving (or raises with the end of its log)."""
    port = _free_port()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "diffuse.serve", "--model", model_dir, "--threads", "1",
                                 "--local-nodes", "2", "--listen", f"127.0.0.1:{port}", "--parallel",
                                 str(max(8, streams)), "--quiet"], stdout=f, stderr=subprocess.STDOUT)
    t0 = time.perf_counter()
    while "serving on" not in open(log).read():
        if proc.poll() is not None:
            raise RuntimeError("the service did not start:\n" + open(log).read()[-3000:])
        time.sleep(0.2)
    print(f"service up in {time.perf_counter() - t0:.1f} s", flush=True)
    return proc, port


def one_stream(port: int, name: str, cfg: dict) -> dict:
    """The best of three single streams of the same prompt (after a warm-up request)."""
    stream(port, name, prompt_text(99, cfg["prompt"], cfg["vocab"]), 4)  # warm-up
    prompt = prompt_text(0, cfg["prompt"], cfg["vocab"])
    solo = min((stream(port, name, prompt, cfg["new"]) for _ in range(3)), key=lambda r: r["end"])
    solo["prompt"] = prompt
    solo["rate"] = solo["tokens"] / solo["end"]
    print(f"one stream: {solo['rate']:.1f} tokens/s (whole request), first token {1000 * solo['first']:.0f} ms "
          f"(best of 3)", flush=True)
    return solo


def many_streams(port: int, name: str, cfg: dict, n: int) -> float:
    """``n`` streams at once, each its own prompt, after one round that makes every worker's copy; tokens/s in
    all."""
    results: list = [None] * n

    def run(k):
        results[k] = stream(port, name, prompt_text(k, cfg["prompt"], cfg["vocab"]), cfg["new"])

    def round_of_all() -> float:
        threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0

    round_of_all()  # every worker's copy made
    wall = round_of_all()
    rate = sum(r["tokens"] for r in results) / wall
    firsts = sorted(r["first"] for r in results)
    p50 = statistics.median(firsts)
    p99 = firsts[min(len(firsts) - 1, int(round(0.99 * (len(firsts) - 1))))]
    print(f"{n} streams at once: {rate:.1f} tokens/s in all, first token p50 {1000 * p50:.0f} ms, "
          f"p99 {1000 * p99:.0f} ms", flush=True)
    return rate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m diffuse.bench serve", description="A warm service against a cold "
                                 "command, and N concurrent streams against one.")
    ap.add_argument("--quick", action="store_true", help="a small model, for a smoke test")
    ap.add_argument("--streams", type=int, default=8, help="concurrent streams (default 8)")
    a = ap.parse_args(argv)
    if a.streams < 1:
        ap.error("--streams must be at least 1")
    cfg = dict(QUICK if a.quick else FULL)
    tmp = tempfile.mkdtemp(prefix="diffuse-bench-serve-")
    model_dir = os.path.join(tmp, "bench-llama")
    proc = None
    try:
        build(model_dir, cfg)
        print(f"model: LlamaForCausalLM, {cfg['layers']} layers, hidden {cfg['hidden']}, vocabulary {cfg['vocab']}, "
              f"random weights; prompts of {cfg['prompt']} words, {cfg['new']} new tokens, greedy; 2 local nodes; "
              f"every process at 1 torch thread; {os.cpu_count()} CPU cores; load average {_load()} before",
              flush=True)
        try:
            proc, port = start_service(model_dir, a.streams, os.path.join(tmp, "serve.log"))
        except RuntimeError as exc:
            print(exc, file=sys.stderr)
            return 1
        solo = one_stream(port, "bench-llama", cfg)
        many_rate = many_streams(port, "bench-llama", cfg, a.streams)
        cold = cold_query(model_dir, solo["prompt"], cfg["new"])
        same = cold["code"] == 0 and cold["text"] == solo["text"]
        print(f"cold diffuse query: first token {cold['first']:.2f} s after the command started, done in "
              f"{cold['end']:.2f} s; same text as the service's: {'yes' if same else 'NO'}", flush=True)
        ratio_first = cold["first"] / solo["first"] if cold["first"] and solo["first"] else float("nan")
        print("\nresults")
        print(f"  first token, service against a cold query: {ratio_first:.0f}x sooner   (goal >= 10x)")
        print(f"  {a.streams} streams against one, tokens/s: {many_rate / solo['rate']:.2f}x   (goal >= 1.9x)")
        print(f"  load average after: {_load()}")
        return 0 if same else 1
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)

if __name__ == "__main__":
    sys.exit(main())
