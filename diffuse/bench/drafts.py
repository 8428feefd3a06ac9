"""``python -m diffuse.bench lm --link-ms MS``: drafts verified by the ring, off and on, over slow links.

The shipped chat model (tiny-qwen-chat) is served by two local nodes holding half its layers each, every
process at one torch thread. Every hop of the ring crosses a relay (``diffuse.bench.relays``) that holds what it
carries ``MS`` one way: client to node 1, node 1 to node 2, node 2 back to the client, and the client's requests;
so a trip around the ring costs three link delays. Three ways of decoding, greedy, side by side in each round:

- off: one token a trip;
- lookup: prompt lookup (``--speculate lookup``): drafts copied from the context;
- assistant: the chat model's first layer and its head, saved as a one-layer model of the same tokenizer and run
  whole on the client (``--speculate FOLDER``), drafting for the four-layer model.

Two tasks. Repetitive: a chat whose last question was asked before, so its answer is already in the context (as
when editing or quoting a text: the answer copies what is there). Free: each question alone in a new chat. Printed
per task and way: tokens per second (the mean of the per-round figures, with its spread), trips per token,
acceptance (drafted tokens kept), and whether the tokens equal the undrafted ones; the ratio of each way's
tokens per second to off's. On loopback (no relays, the same nodes' own addresses), the same tasks whole in this
process and split, off and lookup: split ÷ whole for each. Goals at 25 ms: lookup at least 2x off on the
repetitive task, never slower than off on free chat.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time

from diffuse.bench.kit import Clock, mean_se

FREE = ["what is 2 plus 3?", "hello", "what is the capital of France?", "what can you do?", "what is 9 minus 4?",
        "thank you"]
REPEATED = ["what is the capital of Japan?", "what is 7 plus 6?", "what is the capital of Italy?"]


def assistant_of(model_dir: str, out_dir: str) -> str:
    """A one-layer model of ``model_dir``'s tokenizer: its embedding, first layer, final norm and head."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:1]
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out_dir)
    return out_dir


def tasks(model_dir: str) -> dict[str, list[list[dict]]]:
    """Each task's chats (lists of messages ending with a user turn). The repetitive chats hold earlier turns
    answered by the model itself (greedy, whole), then ask their first question again."""
    import torch
    from transformers import AutoModelForCausalLM

    from diffuse.lm.client_media import chat_inputs

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    answers = {}
    for q in REPEATED + FREE:
        inputs, _ = chat_inputs(model_dir, [{"role": "user", "content": q}])
        with torch.no_grad():
            out = model.generate(**inputs, do_sample=False)
        answers[q] = _decode(model_dir, out[0, inputs["input_ids"].shape[1]:])
    repeated = []
    for k, q in enumerate(REPEATED):
        history = []
        for asked in [q, *FREE[k:k + 2]]:
            history += [{"role": "user", "content": asked}, {"role": "assistant", "content": answers[asked]}]
        repeated.append(history + [{"role": "user", "content": q}])
    return {"repetitive": repeated, "free": [[{"role": "user", "content": q}] for q in FREE]}


def _decode(model_dir: str, ids) -> str:
    from diffuse.lm.client_media import load_tokenizer

    return load_tokenizer(model_dir).decode(ids, skip_special_tokens=True)


def one(model, model_dir: str, chats: list[list[dict]], split=None) -> dict:
    """Every chat of a task answered greedily: the seconds after each answer's first token, its tokens, and on a
    split its trips and drafts."""
    import torch

    from diffuse.lm.client_media import chat_inputs

    seconds = tokens = passes = drafted = accepted = 0
    answers = []
    for messages in chats:
        inputs, _ = chat_inputs(model_dir, messages)
        clock = Clock()
        p0 = split.ring.channel_stats.passes if split is not None else 0
        with torch.no_grad():
            out = model.generate(**inputs, do_sample=False, streamer=clock)
        new = out[0, inputs["input_ids"].shape[1]:].tolist()
        answers.append(new)
        seconds += clock.times[-1] if clock.times else 0.0  # the whole answer, its prompt's pass included
        tokens += len(new)
        if split is not None:
            passes += split.ring.channel_stats.passes - p0
            d = split.splitter.drafting.last if split.splitter.drafting is not None else None
            drafted, accepted = drafted + (d.drafted if d else 0), accepted + (d.accepted if d else 0)
    return dict(rate=tokens / seconds if seconds else 0.0, tokens=tokens, passes=passes, drafted=drafted,
                accepted=accepted, answers=answers)


def rounds_of(ways: dict, chats: dict, model_dir: str, rounds: int) -> dict:
    """``rounds`` rounds, each running every (task, way) once, the order of the ways turning each round."""
    rows: dict = {}
    names = list(ways)
    for k in range(rounds):
        for name in names[k % len(names):] + names[:k % len(names)]:
            model, split = ways[name]
            for task, task_chats in chats.items():
                rows.setdefault((task, name), []).append(one(model, model_dir, task_chats, split))
    return rows


def summary(runs: list[dict]) -> dict:
    rates = [r["rate"] for r in runs]
    last = runs[-1]
    rate, spread = mean_se(rates)
    return dict(rate=rate, spread=spread, rates=rates, trips=last["passes"] / last["tokens"] if last["tokens"] else 0.0,
                acceptance=last["accepted"] / last["drafted"] if last["drafted"] else None, answers=last["answers"],
                tokens=last["tokens"])


def print_rows(rows: dict, base: str, title: str) -> None:
    print(f"\n{title}")
    print(f"  {'task':11s} {'way':22s} {'tokens/s':>16s} {'x ' + base:>9s} {'trips/token':>11s} {'accepted':>9s} "
          f"{'same tokens':>11s}")
    for task in ("repetitive", "free"):
        ref = summary(rows[(task, base)])
        for (t, name), runs in rows.items():
            if t != task:
                continue
            s = summary(runs)
            ratios = [a / b for a, b in zip(s["rates"], ref["rates"])]
            ratio, err = mean_se(ratios)
            acc = f"{100 * s['acceptance']:.0f}%" if s["acceptance"] is not None else "-"
            trips = f"{s['trips']:.2f}" if s["trips"] else "-"
            print(f"  {task:11s} {name:22s} {s['rate']:8.1f} +- {s['spread']:4.1f} {ratio:5.2f}+-{err:.2f} "
                  f"{trips:>11s} {acc:>9s} {str(s['answers'] == ref['answers']):>11s}")


def main(link_ms: float, rounds: int, quick: bool) -> int:
    import torch

    import diffuse
    from diffuse.bench.relays import Relay, inbox_through
    from diffuse.local.nodes import start_local_nodes
    from diffuse.plan.shipped import default_chat_model_dir

    torch.set_num_threads(1)
    model_dir = default_chat_model_dir()
    tmp = tempfile.mkdtemp(prefix="diffuse-bench-drafts-")
    relays = {name: Relay() for name in ("control1", "control2", "data1", "data2", "inbox")}
    nodes = None
    try:
        assistant = assistant_of(model_dir, os.path.join(tmp, "assistant"))
        chats = tasks(model_dir)
        if quick:
            chats = {k: v[:1] for k, v in chats.items()}
        print(f"model: {model_dir} (4 layers), 2 local nodes, half the layers each; every process at 1 torch thread; "
              f"assistant: its first layer and head; greedy; {sum(map(len, chats.values()))} chats a round", flush=True)
        print(f"machine: {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.2f}", flush=True)
        nodes = start_local_nodes(model_dir, 2, threads=1, extra=["--log-level", "WARNING"],
                                  each=[["--advertise-data", relays["data1"].address],
                                        ["--advertise-data", relays["data2"].address]])
        for name, upstream in (("control1", nodes[0].address), ("control2", nodes[1].address),
                               ("data1", nodes[0].data), ("data2", nodes[1].data)):
            relays[name].start(upstream)
        for r in relays.values():
            r.set(link_ms / 1000, None)
        spec = [f"{relays['control1'].address}#{nodes[0].key}", f"{relays['control2'].address}#{nodes[1].key}"]
        with contextlib.ExitStack() as held:
            held.enter_context(inbox_through(relays["inbox"]))
            ways = {}
            for name, speculate in (("off", "off"), ("lookup", "lookup"), ("assistant", assistant)):
                model = diffuse.from_pretrained(model_dir)
                split = held.enter_context(diffuse.split(model, nodes=spec, timeout=600, speculate=speculate))
                one(model, model_dir, chats["free"][:1], split)  # warm-up: the session open, its plans learnt
                ways[name] = (model, split)
            t0 = time.perf_counter()
            slow = rounds_of(ways, chats, model_dir, rounds)
            took = time.perf_counter() - t0
        print_rows(slow, "off", f"every hop {link_ms:g} ms one way ({rounds} rounds, {took:.0f} s; each figure the "
                   "mean of the rounds +- one standard error)")
        for r in relays.values():
            r.set(0.0, None)
        loopback(model_dir, chats, rounds)
        print(f"load average after: {os.getloadavg()[0]:.2f}")
    finally:
        if nodes is not None:
            nodes.stop()
        for r in relays.values():
            r.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def loopback(model_dir: str, chats: dict, rounds: int) -> None:
    """Whole in this process against split over two local nodes on loopback, off and lookup."""
    from transformers import AutoModelForCausalLM

    import diffuse
    from diffuse.local.nodes import start_local_nodes

    nodes = start_local_nodes(model_dir, 2, threads=1, extra=["--log-level", "WARNING"])
    try:
        spec = [f"{n.address}#{n.key}" for n in nodes]
        with contextlib.ExitStack() as held:
            ways = {"whole": (AutoModelForCausalLM.from_pretrained(model_dir), None)}
            for name, speculate in (("split, off", "off"), ("split, lookup", "lookup")):
                model = diffuse.from_pretrained(model_dir)
                split = held.enter_context(diffuse.split(model, nodes=spec, timeout=600, speculate=speculate))
                one(model, model_dir, chats["free"][:1], split)
                ways[name] = (model, split)
            rows = rounds_of(ways, chats, model_dir, rounds)
        print_rows(rows, "whole", f"loopback, split ÷ whole ({rounds} rounds)")
    finally:
        nodes.stop()
