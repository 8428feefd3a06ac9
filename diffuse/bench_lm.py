"""``python -m diffuse.bench lm``: a language model whole and split, side by side in one run.

A Qwen2-shaped causal model with seeded random weights is built offline and
saved; the same greedy ``generate`` (a fixed prompt of token ids) runs whole in
this process, then split over 1 and over 2 local nodes (every process at one
torch thread). Printed: tokens per second after the first token, first-token
latency, the bytes one decoding step puts on each hop (sealed, as measured on
the wire), and whether the tokens are the same.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

FULL = dict(layers=8, hidden=512, heads=8, kv_heads=2, ffn=1536, vocab=8192, prompt=64, new=32)
QUICK = dict(layers=4, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=512, prompt=16, new=8)


def build(out_dir: str, cfg: dict) -> None:
    import torch
    import transformers
    from transformers import Qwen2Config, Qwen2ForCausalLM

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=cfg["hidden"], intermediate_size=cfg["ffn"], num_hidden_layers=cfg["layers"],
                         num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"],
                         vocab_size=cfg["vocab"], max_position_embeddings=4096, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model.save_pretrained(out_dir)


class Clock:
    """A streamer that notes when each token arrives (the first ``put`` is the prompt)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.times: list[float] = []
        self._prompt = True

    def put(self, value) -> None:
        if self._prompt:
            self._prompt = False
            return
        self.times.append(time.perf_counter() - self.start)

    def end(self) -> None:
        pass

    @property
    def first(self) -> float:
        return self.times[0]

    @property
    def per_second(self) -> float:
        """Tokens per second after the first (the steady decoding rate)."""
        return (len(self.times) - 1) / (self.times[-1] - self.times[0]) if len(self.times) > 1 else 0.0


def generate(model, ids, new: int):
    import torch

    clock = Clock()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, streamer=clock)
    return out[:, ids.shape[1]:], clock


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m diffuse.bench lm", description=__doc__.split("\n")[0].strip("`"))
    ap.add_argument("--quick", action="store_true", help="a tiny model, for a smoke test")
    ap.add_argument("--new-tokens", type=int, help="tokens to generate per run")
    a = ap.parse_args(argv)
    cfg = dict(QUICK if a.quick else FULL)
    if a.new_tokens:
        cfg["new"] = max(2, a.new_tokens)

    import torch

    import diffuse
    from diffuse.api import ModelInfo
    from diffuse.planner import load_model

    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="diffuse-bench-lm-")
    try:
        build(tmp, cfg)
        print(f"model: Qwen2ForCausalLM, {cfg['layers']} layers, hidden {cfg['hidden']} ({cfg['heads']} heads, "
              f"{cfg['kv_heads']} key/value heads), FFN {cfg['ffn']}, vocabulary {cfg['vocab']}, random weights; "
              f"prompt {cfg['prompt']} tokens, {cfg['new']} new tokens, greedy", flush=True)
        print(f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}; every process at 1 torch thread",
              flush=True)
        ids = torch.randint(0, cfg["vocab"], (1, cfg["prompt"]), generator=torch.Generator().manual_seed(0))
        info = ModelInfo.of(tmp)
        whole_model = load_model(tmp, info.subject)
        generate(whole_model, ids, 2)  # warm-up
        whole_tokens, whole = generate(whole_model, ids, cfg["new"])
        del whole_model
        rows = [("whole", whole, None, True)]
        for n in (1, 2):
            model = diffuse.from_pretrained(tmp)
            with diffuse.split(model, local_nodes=n) as ring:
                generate(model, ids, 2)  # warm-up: the session is open, the nodes' blocks are loaded
                tokens, clock = generate(model, ids, cfg["new"])
            rows.append((f"split, {n} node{'s' if n > 1 else ''}", clock, ring, bool(torch.equal(tokens, whole_tokens))))
        print("\nresults")
        for name, clock, ring, same in rows:
            ratio = clock.per_second / whole.per_second if whole.per_second else 0.0
            print(f"  {name:15s} {clock.per_second:7.1f} tokens/s ({ratio:.2f} of whole)   first token "
                  f"{1000 * clock.first:7.1f} ms   tokens equal whole: {same}")
        for name, clock, ring, _ in rows[1:]:
            hops = per_token_hops(ring, cfg["new"])
            print(f"  {name}: bytes per decoding step on each hop (sealed): "
                  + ", ".join(f"{h} {b:.0f} B" for h, b in hops))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def per_token_hops(ring, new: int) -> list[tuple[str, float]]:
    """Median bytes of one decoding step's message on each hop: client to node 1, node to node, last node
    back to the client (the prefill and the warm-up run are left out)."""
    stats = ring.ring.channel_stats
    sent = [m["bytes_out"] for m in stats.messages][-(new - 1):]
    back = [b for _, b in stats.returns][-(new - 1):]
    hops = [("client->1", statistics.median(sent))]
    for i, report in enumerate(ring.node_reports[1:], 2):
        into = [b for _, b in report.get("hop_bytes", [])][-(new - 1):]
        hops.append((f"{i - 1}->{i}", statistics.median(into)))
    hops.append((f"{len(ring.node_reports)}->client", statistics.median(back)))
    return hops
