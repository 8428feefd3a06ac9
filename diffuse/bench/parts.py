"""Where a split call's time goes, for ``python -m diffuse.bench``: the whole model and a split one stepped in turn,
and the per-call breakdown of client, wire and nodes.

The whole model (a second copy in the client process, never split) takes a step
after each split step, or before it on odd steps, so that the machine's load
hits both alike; each ratio is the mean of the per-step ratios, with its
standard error. The client's time is read from its stand-ins and channel
(``Splitter.stand_in_s``, ``ChannelStats.seconds``), each node's from its
per-call record (``diffuse.node.server.PARTS``), the CPU time of every process from
``/proc`` around each split step.
"""

from __future__ import annotations

import os
import time

from diffuse.bench.kit import mean_se

NODE_PARTS = ("idle", "open", "prepare", "blocks", "blocks_cpu", "finish", "seal", "faults")  # diffuse.node.server.PARTS
CLIENT_PARTS = ("hash", "seal", "send", "wait", "open")  # diffuse.client.channel.ChannelStats.seconds


def process_cpu(pids: list[int]) -> float:
    """CPU seconds (user and system, every thread) the processes ``pids`` have used so far; 0 for one that
    cannot be read (not Linux, or gone)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
    return total


class BlockClock:
    """CPU and wall seconds the blocks of a whole (unsplit) model spend, read by hooks on each block."""

    def __init__(self, blocks):
        self.cpu = self.wall = 0.0
        self._t0 = None
        self._hooks = [h for b in blocks for h in (b.register_forward_pre_hook(self._start),
                                                   b.register_forward_hook(self._stop))]

    def _start(self, *_):
        self._t0 = (time.thread_time(), time.perf_counter())

    def _stop(self, *_):
        c0, w0 = self._t0
        self.cpu += time.thread_time() - c0
        self.wall += time.perf_counter() - w0

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


def guided_step(transformer, latent, x: dict, s: int, steps: int, guidance: float):
    """One guided Euler step (a call with the prompt, one without); (seconds of its two calls, next latent)."""
    import torch

    t = torch.tensor([1000.0 * (1 - s / steps)])
    t0 = time.perf_counter()
    cond = transformer(hidden_states=latent, timestep=t, encoder_hidden_states=x["text"], return_dict=False)[0]
    uncond = transformer(hidden_states=latent, timestep=t, encoder_hidden_states=x["negative"], return_dict=False)[0]
    seconds = time.perf_counter() - t0
    return seconds, latent - (uncond + guidance * (cond - uncond)) / steps


def paired(split_tr, whole_tr, x: dict, steps: int, guidance: float, on_step, pids: list[int]) -> dict:
    """The split model and the whole one stepped in turn over ``steps`` steps (``on_step(s)`` before each): per
    step, each one's seconds, the CPU the client and the nodes used in the split step (``pids``: the nodes'
    processes), the whole model's block seconds; and both results."""
    import torch

    clock = BlockClock(whole_tr.blocks)
    lat = {"split": x["latent"].clone(), "whole": x["latent"].clone()}
    rec = {k: [] for k in ("split", "whole", "client_cpu", "nodes_cpu", "whole_blocks_cpu", "whole_blocks")}
    try:
        with torch.no_grad():
            for s in range(steps):
                on_step(s)
                for which in (("split", "whole") if s % 2 == 0 else ("whole", "split")):
                    c0, n0, b0, bw0 = time.process_time(), process_cpu(pids), clock.cpu, clock.wall
                    model = split_tr if which == "split" else whole_tr
                    seconds, lat[which] = guided_step(model, lat[which], x, s, steps, guidance)
                    rec[which].append(seconds)
                    if which == "split":
                        rec["client_cpu"].append(time.process_time() - c0)
                        rec["nodes_cpu"].append(process_cpu(pids) - n0)
                    else:
                        rec["whole_blocks_cpu"].append(clock.cpu - b0)
                        rec["whole_blocks"].append(clock.wall - bw0)
    finally:
        clock.remove()
    rec["out"], rec["whole_out"] = lat["split"], lat["whole"]
    return rec


def step_ratios(num: list[float], den: list[float]) -> tuple[float, float]:
    """Mean and standard error of num[s] / den[s] over the steps: each step's pair saw the same load."""
    return mean_se([a / b for a, b in zip(num, den)])


def snapshot(split) -> dict:
    """What the client's counters say now (taken when the timed steps begin, and again at the end)."""
    seconds = {k: 0.0 for k in CLIENT_PARTS}
    for r in split.rings:
        for k, v in r.channel_stats.seconds.items():
            seconds[k] = seconds.get(k, 0.0) + v
    seconds["stand_in"] = split.splitter.stand_in_s
    return seconds


def node_parts(reports: list[dict], marks: list[int], per_ring: int) -> list[dict]:
    """Per node, the mean per call it worked on in the timed steps of each part of its time (seconds; faults
    as a count; idle: the median), and the number of such calls."""
    out = []
    for n, rep in enumerate(reports):
        rows = [r[1:] for r in rep.get("parts_log", []) if r[0] > marks[min(n // per_ring, len(marks) - 1)]]
        calls = max(1, len(rows))
        means = {k: sum(r[i] for r in rows) / calls for i, k in enumerate(NODE_PARTS)}
        idle = sorted(r[0] for r in rows)
        means["idle"] = idle[len(idle) // 2] if idle else 0.0  # the median: a pause between runs is not a pass's
        out.append({"calls": len(rows), **means})
    return out


def merged(per_session: list[list[dict]]) -> list[dict]:
    """Several sessions' ``node_parts`` (one list per session, a dict per node) as one per node: means weighted by
    each session's passes (idle: the median of the sessions' medians)."""
    out = []
    for k in range(max((len(x) for x in per_session), default=0)):
        rows = [x[k] for x in per_session if len(x) > k and x[k]["calls"]]
        calls = sum(r["calls"] for r in rows)
        m = {key: sum(r[key] * r["calls"] for r in rows) / max(1, calls) for key in NODE_PARTS}
        idle = sorted(r["idle"] for r in rows)
        m["idle"] = idle[len(idle) // 2] if idle else 0.0
        out.append({"calls": calls, **m})
    return out


def client_parts(before: dict, after: dict, calls: int) -> dict:
    """The client's per-call seconds in each part over the timed steps."""
    return {k: (after[k] - before.get(k, 0.0)) / max(1, calls) for k in after}


def client_ring(c: dict) -> float:
    """The client's own part of a pass that is the ring's: hashing, sealing, handing on, waiting, opening."""
    return c["hash"] + c["seal"] + c["send"] + c["wait"] + c["open"]


def node_work(p: dict) -> float:
    """A node's work on a pass: opening, checking, its blocks, handing on, sealing and sending."""
    return p["open"] + p["prepare"] + p["blocks"] + p["finish"] + p["seal"]


def print_breakdown(name: str, r: dict, timed_from: int) -> None:
    """The per-call breakdown of one configuration (means over its timed steps)."""
    calls_per_step = 2
    call = sum(r["split"][timed_from:]) / max(1, len(r["split"][timed_from:])) / calls_per_step
    c = r["client"]
    own = call - c["stand_in"]
    ring = client_ring(c)
    print(f"  breakdown {name}, per call (ms; means over the timed steps): call {1000 * call:.1f} = client's own "
          f"model code {1000 * own:.1f} + stand-in {1000 * c['stand_in']:.1f} [hashing {1000 * c['hash']:.1f}, "
          f"sealing {1000 * c['seal']:.1f}, handing to the transport {1000 * c['send']:.1f}, waiting for the "
          f"answer {1000 * c['wait']:.1f}, opening it {1000 * c['open']:.2f}, the rest "
          f"(taking the call apart, putting the answer together) {1000 * (c['stand_in'] - ring):.1f}]")
    work = 0.0
    for k, p in enumerate(r["nodes"]):
        if not p["calls"]:
            continue
        each = p["calls"] / max(1, (len(r["split"]) - timed_from) * calls_per_step)
        work += node_work(p) * each
        print(f"    node {k + 1}: {p['calls']} passes; per pass: idle before it (median) {1000 * p['idle']:.1f}, opening "
              f"{1000 * p['open']:.2f}, checking {1000 * p['prepare']:.2f}, blocks {1000 * p['blocks']:.1f} "
              f"(CPU {1000 * p['blocks_cpu']:.1f}, {p['faults']:.0f} page faults), handing on "
              f"{1000 * p['finish']:.2f}, sealing and sending {1000 * p['seal']:.2f}")
    print(f"    wire and doors (waiting for the answer less the nodes' own work, per call; meaningful where one pass "
          f"is in flight at a time): {1000 * (c['wait'] - work):.1f} ms")


def print_cpu(name: str, r: dict, whole_step: float, timed_from: int) -> None:
    """CPU per timed step of the client and the nodes in the split run, and the bound two cores put on it."""
    client = mean_se(r["client_cpu"][timed_from:])[0]
    nodes = mean_se(r["nodes_cpu"][timed_from:])[0]
    cores = min(2, os.cpu_count() or 1)
    bound = (client + nodes) / cores
    step = mean_se(r["split"][timed_from:])[0]
    print(f"  CPU {name}: client {client:.2f} s + nodes {nodes:.2f} s per step (every thread); on {cores} cores a "
          f"step takes at least {bound:.2f} s, so at most {whole_step / bound:.2f}x over whole; measured "
          f"{whole_step / step:.2f}x = {100 * bound / step:.0f}% of that bound")
