"""``python -m diffuse.bench links``: a language model over two nodes with the client's link slowed.

The language-model bench model (``diffuse.bench.lm``) is served by two local nodes holding half of its
layers each; every process at one torch thread and, where cgroups can be made, in a group of one core
weighted ``cpu.shares`` 8192 (as ``bench placement`` makes them), so that other work on a busy machine does
not decide the compute the floor is made of. The client reaches them through relays that this bench
runs (``Relay``): each holds every chunk it carries for a one-way delay, then sends it on no faster than a
rate. Everything between the client and the nodes crosses a relay: its requests to both nodes, its data
to the first node (which advertises the relay as its data address) and the last node's answers to the
client (the client's inbox is announced through a relay); the hop from node to node does not. Runs: no
relay delay, 25 ms and 100 ms one way, and 100 Mbit/s each way with no delay.

Printed per run: tokens per second after the first token, first-token time, and the time of the first
12 tokens; against each, the arithmetic floor: the undelayed run's own time (its compute) plus one round
trip of the client's link per token (a token's pass leaves the client once and comes home once; the
nodes hand it on between them) and the client's bytes of a token at the link's rate; the floor divided by
the measured time (goal: at least 0.90). The design notes' reference: two nodes, a 25 ms client link, 12
tokens took 4,059 ms when every hop returned through the client and 2,707 ms handed node to node.
``--quick``: a tiny model, short delays, for a smoke test.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from diffuse.bench.relays import Relay, inbox_through

RUNS = (("no delay", 0.0, None), ("25 ms each way", 0.025, None), ("100 ms each way", 0.100, None),
        ("100 Mbit/s", 0.0, 100e6 / 8))
QUICK_RUNS = (("no delay", 0.0, None), ("5 ms, 100 Mbit/s", 0.005, 100e6 / 8))
REFERENCE_TOKENS = 12


def _nodes(path: str, relays: dict):
    """Two nodes holding half the layers each; the first advertises its data relay."""
    from diffuse.local.nodes import start_local_nodes

    return start_local_nodes(path, 2, threads=1, extra=["--log-level", "WARNING"],
                             each=[["--advertise-data", relays["data1"].address], []])


def run_one(path: str, cfg: dict, spec: list[str], relays: dict, name: str, delay: float,
            rate: float | None) -> dict:
    """One session over the relays set to ``delay`` and ``rate``: a warm-up, then the timed generate."""
    import torch

    import diffuse
    from diffuse.bench import lm

    for r in relays.values():
        r.set(delay, rate)
    ids = torch.randint(0, cfg["vocab"], (1, cfg["prompt"]), generator=torch.Generator().manual_seed(0))
    model = diffuse.from_pretrained(path)
    with inbox_through(relays["inbox"]):
        with diffuse.split(model, nodes=spec, timeout=600, speculate="off") as split:
            lm.generate(model, ids, 2)  # warm-up: the session open, its call plans learnt
            new, clock = lm.generate(model, ids, cfg["new"])
    hops = lm.per_token_hops(split, cfg["new"])
    stats = split.ring.channel_stats
    prefill = stats.messages[-cfg["new"]]["bytes_out"] + stats.returns[-cfg["new"]][1]
    return dict(name=name, delay=delay, rate=rate, clock=clock, tokens=new, prefill_bytes=prefill,
                token_bytes=hops[0][1] + hops[-1][1], route=[str(s.slices[0]) for s in split.plan.route])


def report(rows: list[dict], cfg: dict) -> None:
    """Each run against its floor (see the module's docstring)."""
    import torch

    base = rows[0]
    per0, first0 = 1 / base["clock"].per_second, base["clock"].first
    print(f"\nresults (route: {', '.join(base['route'])}; the client's bytes a token: {base['token_bytes']:.0f} B "
          f"sealed, out and back; of the prompt's pass: {base['prefill_bytes']:.0f} B)")
    print(f"  {'client link':18s} {'tokens/s':>9s} {'floor':>7s} {'ratio':>6s}   {'first token':>11s} {'floor':>9s} "
          f"{'ratio':>6s}   {REFERENCE_TOKENS} tokens  floor")
    for r in rows:
        wire = (lambda n: n / r["rate"]) if r["rate"] else (lambda n: 0.0)
        per_floor = per0 + 2 * r["delay"] + wire(r["token_bytes"])
        first_floor = first0 + 2 * r["delay"] + wire(r["prefill_bytes"])
        per, first = 1 / r["clock"].per_second, r["clock"].first
        twelve = r["clock"].times[REFERENCE_TOKENS - 1] if len(r["clock"].times) >= REFERENCE_TOKENS else None
        twelve_floor = first_floor + (REFERENCE_TOKENS - 1) * per_floor
        shown = f"{1000 * twelve:7.0f} ms {1000 * twelve_floor:5.0f} ms" if twelve is not None else "      -"
        print(f"  {r['name']:18s} {1 / per:9.2f} {1 / per_floor:7.2f} {per_floor / per:6.2f}   "
              f"{1000 * first:8.1f} ms {1000 * first_floor:6.1f} ms {first_floor / first:6.2f}   {shown}")
    same = all(torch.equal(r["tokens"], base["tokens"]) for r in rows)
    print(f"  ratio: the floor's time over the measured time (goal >= 0.90); tokens equal in every run: {same}")
    print(f"  design notes, 2 nodes, 25 ms client link, {REFERENCE_TOKENS} tokens: 4,059 ms when every hop returned "
          "through the client, 2,707 ms handed node to node")


def main(argv: list[str] | None = None) -> int:
    from diffuse.flags import Parser
    from diffuse.text import plain

    ap = Parser(prog="diffuse bench links", description=plain(__doc__.split("\n")[0]))
    ap.add_argument("--quick", action="store_true", help="a tiny model and short delays, for a smoke test")
    a = ap.parse_args(argv)

    import torch

    from diffuse.bench import lm
    from diffuse.bench.placement import SHARES, CgroupLimits

    torch.set_num_threads(1)
    cfg = dict(lm.QUICK if a.quick else lm.FULL)
    runs = QUICK_RUNS if a.quick else RUNS
    limits = CgroupLimits(100_000, SHARES)
    tmp = tempfile.mkdtemp(prefix="diffuse-bench-links-")
    relays = {name: Relay() for name in ("control1", "control2", "data1", "inbox")}
    nodes = None
    try:
        lm.build(tmp, cfg)
        print(f"model: Qwen2ForCausalLM, {cfg['layers']} layers, hidden {cfg['hidden']}, FFN {cfg['ffn']}, "
              f"vocabulary {cfg['vocab']}, random weights; prompt {cfg['prompt']} tokens, {cfg['new']} new, greedy; "
              f"2 local nodes, half the layers each; every process at 1 torch thread", flush=True)
        print(f"machine: {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.2f}", flush=True)
        if limits.why:
            print(f"cgroups cannot be made here ({limits.why}): the processes compete with the machine's other work",
                  flush=True)
        else:
            print(f"the client and each node in a cgroup of one core, cpu.shares {SHARES} (other work on a busy "
                  "machine does not decide their speed)", flush=True)
        nodes = _nodes(tmp, relays)
        limits.nodes(nodes, (("node1", 1.0), ("node2", 1.0)))
        relays["control1"].start(nodes[0].address)
        relays["control2"].start(nodes[1].address)
        relays["data1"].start(nodes[0].data)
        spec = [f"{relays['control1'].address}#{nodes[0].key}", f"{relays['control2'].address}#{nodes[1].key}"]
        rows = [run_one(tmp, cfg, spec, relays, name, delay, rate) for name, delay, rate in runs]
        report(rows, cfg)
        print(f"load average after: {os.getloadavg()[0]:.2f}")
    finally:
        if nodes is not None:
            nodes.stop()
        for r in relays.values():
            r.close()
        limits.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0
