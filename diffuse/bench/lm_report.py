"""What ``python -m diffuse.bench lm`` prints: the rates, CPU and per-token breakdown of its rounds whole and
split, and the table of its ``--sessions`` run (``diffuse.bench.lm`` measures them)."""

from __future__ import annotations

import os

from diffuse.bench import parts
from diffuse.bench.kit import mean_se

BARE = {"bare ring, 1 process": 1, "bare ring, 2 processes": 2}  # diffuse.bench.bare: the floor of a ring


def print_rates(rows: dict) -> None:
    """Each configuration's tokens/s against whole, first token and whether its tokens are whole's; then each
    split's rate as a fraction of the bare ring's of as many processes (``diffuse.bench.bare``)."""
    goals = {"split, 2 nodes": "   goal >= 0.95"}
    names = [n for n in ("whole", "split, 1 node", "split, 2 nodes", *BARE) if n in rows]
    for name in names:
        r = rows[name]
        ratio, spread = mean_se([c.per_second / w.per_second for c, w in zip(r["clocks"], rows["whole"]["clocks"])])
        rate = mean_se([c.per_second for c in r["clocks"]])[0]
        first = mean_se([c.first for c in r["clocks"]])[0]
        print(f"  {name:22s} {rate:7.1f} tokens/s ({ratio:.2f} of whole) +- {spread:.2f}   first token "
              f"{1000 * first:7.1f} ms   tokens equal whole: {r['same']}{goals.get(name, '')}")
    if not any(name in rows for name in BARE):
        print("  bare ring: not run (it runs on the CPU in the default dtype only, and --device or --dtype was given)")
    for split, bare in (("split, 1 node", "bare ring, 1 process"), ("split, 2 nodes", "bare ring, 2 processes")):
        if bare in rows:
            ratio, spread = mean_se([c.per_second / b.per_second
                                     for c, b in zip(rows[split]["clocks"], rows[bare]["clocks"])])
            print(f"  {split} / {bare}: {ratio:.2f} +- {spread:.2f} (the bare ring: ZeroMQ over loopback, pickled "
                  "tensors, no sealing, no checks: what a plain ring of processes reaches on this machine at this size)")


def print_cpu(rows: dict, new: int) -> None:
    """CPU per token of every process (this one, and the local nodes), the best round of each configuration: what
    a split adds in work, which load inflates far less than wall time; and the ceiling that work alone puts on
    the split's rate against whole (hops that cost nothing, every core free)."""
    whole = min(c + n for c, n in rows["whole"]["cpu"]) / new
    print(f"  CPU per token, all processes (best round): whole {1000 * whole:.2f} ms", end="")
    for name in [n for n in ("split, 1 node", "split, 2 nodes", *BARE) if n in rows]:
        client, nodes = (x / new for x in min(rows[name]["cpu"], key=sum))
        added = client + nodes - whole
        held = "workers" if name in BARE else "nodes"
        print(f"; {name}: client {1000 * client:.2f} + {held} {1000 * nodes:.2f} ms, {1000 * added:+.2f} ms over whole "
              f"(alone it caps the split at {whole / (whole + max(0.0, added)):.2f} of whole)", end="")
    print()


def print_token_breakdown(name: str, row: dict, whole: dict) -> None:
    """Where one token's time went (ms, means over every pass of the timed rounds, the prompt's included; a pass
    is one token's trip round the ring)."""
    per = 1000 / max(1, row["passes"])
    token = per * sum(c.times[-1] for c in row["clocks"])  # the prompt's pass included, as in the parts below
    whole_token = per * sum(c.times[-1] for c in whole["clocks"])
    c = {k: v * per for k, v in row["client"].items()}
    ring = parts.client_ring(c)
    print(f"  breakdown {name}, per token (ms): {token:.2f} (whole {whole_token:.2f}) = client's generate loop and "
          f"model code outside the layers' pass {token - c['stand_in']:.2f} + the pass {c['stand_in']:.2f} "
          f"[hashing {c['hash']:.3f}, sealing {c['seal']:.3f}, handing to the transport {c['send']:.3f}, waiting "
          f"{c['wait']:.2f}, opening {c['open']:.3f}, taking the call apart and the answer together "
          f"{c['stand_in'] - ring:.3f}]")
    work = 0.0
    for k, p in enumerate(row["nodes"]):
        work += parts.node_work(p)
        print(f"    node {k + 1} per pass (ms): idle before it (median) {1000 * p['idle']:.2f}, opening {1000 * p['open']:.3f}, "
              f"checking and assembling {1000 * p['prepare']:.3f}, layers {1000 * p['blocks']:.2f} (CPU "
              f"{1000 * p['blocks_cpu']:.2f}), handing on {1000 * p['finish']:.3f}, sealing and sending "
              f"{1000 * p['seal']:.3f}")
    print(f"    hops and doors (waiting less the nodes' work): {c['wait'] - 1000 * work:.2f} ms per token")


def print_sessions(rows: dict, n: int) -> None:
    """``--sessions``' table: each mode's rate, latency and batches, the single streams, the CPU bound, the ratios."""
    print("\nresults (tokens/s: all sessions together; latency: median time between two tokens of a session)")
    for mode in ("off", "on"):
        rate, latency, equal, batches, batched, joint = rows[("sessions", mode)]
        formed = f"   batches formed {batches} ({batched / batches:.1f} sessions each on average; {joint} tails run " \
            "with their batch's)" if batches else "   batches formed 0"
        print(f"  {n} sessions, batching {mode:3s} {rate:7.1f} tokens/s   median latency {1000 * latency:7.1f} ms   "
              f"tokens equal solo: {equal}{formed}   (load {rows[('load', mode)][0]:.2f} -> "
              f"{rows[('load', mode)][1]:.2f})")
    for mode in ("off", "on"):
        rate, latency, equal = rows[("single", mode)]
        print(f"  single stream, batching {mode:3s} {rate:7.1f} tokens/s   median latency {1000 * latency:7.1f} ms   "
              f"tokens equal solo: {equal}")
    print_cpu_bound(rows, n)
    for mode in ("off", "on"):
        for k, p in enumerate(rows[("nodes", mode)]):
            print(f"    batching {mode:3s}, node {k + 1} per pass (ms): idle before it (median) {1000 * p['idle']:.2f}, "
                  f"opening {1000 * p['open']:.3f}, checking and batch assembly {1000 * p['prepare']:.3f}, layers "
                  f"(a batch's shared) {1000 * p['blocks']:.2f} (CPU {1000 * p['blocks_cpu']:.2f}), handing on "
                  f"{1000 * p['finish']:.3f}, sealing and sending {1000 * p['seal']:.3f}")
    on, off = rows[("sessions", "on")], rows[("sessions", "off")]
    single_on, single_off = rows[("single", "on")], rows[("single", "off")]
    print(f"  batching on / off: {n} sessions {on[0] / off[0]:.2f}x tokens/s (goal >= 1.9x at 8), latency "
          f"{on[1] / off[1]:.2f}x; "
          f"single stream {single_on[0] / single_off[0]:.2f}x tokens/s")


def print_cpu_bound(rows: dict, n: int) -> None:
    """Per batching mode, the CPU one token took in the client process and on the nodes, and the bound that puts on
    tokens/s on this machine's cores."""
    cores = min(2, os.cpu_count() or 1)
    for mode in ("off", "on"):
        client, node_cpu = rows[("cpu", mode)]
        bound = min(1 / client, cores / (client + node_cpu))  # the client's Python holds one lock: one core at most
        rate = rows[("sessions", mode)][0]
        print(f"  CPU per token, batching {mode:3s}: client {1000 * client:.2f} ms (all {n} sessions' threads, "
              f"one process) + nodes {1000 * node_cpu:.2f} ms; bound on {cores} cores {bound:.1f} tokens/s "
              f"(the client's threads share one interpreter lock: at most one core), measured "
              f"{100 * rate / bound:.0f}% of it")
