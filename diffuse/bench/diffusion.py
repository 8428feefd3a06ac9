"""``python -m diffuse.bench``: what splitting and PipeFusion cost and gain, measured side by side.

A Wan-shaped transformer of real block width (WanTransformer3DModel, hidden
1536 = 12 heads x 128, FFN 8960, 4 blocks, random weights) is saved to a temp
folder. Two local nodes hold half of its blocks each (one ring of 2), and two
more hold all of them (two groups of one node); one torch thread per node and
one for the client. The transformer is driven directly with fixed inputs (no
VAE, no text encoder) as a guided pipeline drives it: two calls per step, with
and without the prompt, through the real Splitter, Ring and nodes. Only the
transformer's forward calls are timed, and only steps after the first two (a
branch's first step runs whole; the second checks the quick attention path).

Printed, each as the mean over the timed steps with its spread (one standard
error): the overhead of splitting at one patch (split / whole), the speedup at
P = 2 and 4 over the whole model on one thread against the ideal for two
stages: 2P/(P+1) for calls sent one at a time, 4P/(2P+1) where the second call
of each step is sent ahead and follows the first through the ring back to back;
the speedup of the two branches run side by side on two groups against 2; the
nodes' own busy time per timed step (each node's clock over the calls it ran);
the bytes on the wire per step against sending the whole latent on every pass,
and the time per patch of the quick and plain attention paths; with the
machine's core count and load. ``--quick`` runs a small model for a smoke test.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

from diffuse.bench import parts
from diffuse.bench.parts import step_ratios
from diffuse.bench.kit import GUIDANCE, inputs, mean_se

from diffuse.home import libraries_offline  # noqa: E402

libraries_offline()

FULL = dict(heads=12, head_dim=128, ffn=8960, layers=4, text_dim=4096, text_len=512, frames=3, size=32, steps=10)
QUICK = dict(heads=4, head_dim=32, ffn=512, layers=4, text_dim=64, text_len=32, frames=3, size=16, steps=4)
TIMED_FROM = 2  # steps (0-based) timed: the first runs whole, the second also checks quick against plain once


def build_model(out_dir: str, cfg: dict, seed: int = 0) -> str:
    """A diffusers folder holding only a random-weight WanTransformer3DModel (what nodes and client load)."""
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=cfg["heads"], attention_head_dim=cfg["head_dim"],
        in_channels=16, out_channels=16, text_dim=cfg["text_dim"], freq_dim=256, ffn_dim=cfg["ffn"],
        num_layers=cfg["layers"], cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=1024,
    )
    model.save_pretrained(os.path.join(out_dir, "transformer"))
    with open(os.path.join(out_dir, "model_index.json"), "w") as f:
        json.dump({"_class_name": "WanPipeline", "_diffusers_version": "0.42.1",
                   "transformer": ["diffusers", "WanTransformer3DModel"]}, f)
    return out_dir


def load_transformer(path: str):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel.from_pretrained(os.path.join(path, "transformer"), use_safetensors=True).eval()


def denoise(transformer, x: dict, steps: int, on_step=None) -> tuple[list[float], "torch.Tensor"]:
    """A guided Euler loop over ``steps`` steps (a call with the prompt, then one without, combined as a
    pipeline combines them); the seconds of each step's two transformer calls, and the result. ``on_step(s)``
    is called before step ``s`` (from 0)."""
    import torch

    latent = x["latent"].clone()
    times = []
    with torch.no_grad():
        for s in range(steps):
            if on_step is not None:
                on_step(s)
            t = torch.tensor([1000.0 * (1 - s / steps)])
            t0 = time.perf_counter()
            cond = transformer(hidden_states=latent, timestep=t, encoder_hidden_states=x["text"],
                               return_dict=False)[0]
            uncond = transformer(hidden_states=latent, timestep=t, encoder_hidden_states=x["negative"],
                                 return_dict=False)[0]
            times.append(time.perf_counter() - t0)
            latent = latent - (uncond + GUIDANCE * (cond - uncond)) / steps
    return times, latent


def split_run(path: str, nodes, x: dict, steps: int, patches: int, whole_tr, groups: int = 1,
              ahead: bool = True) -> dict:
    """One split configuration stepped in turn with the whole model (``diffuse.bench.parts.paired``): per step
    both one's seconds, the processes' CPU, and what the client and each node spent per call in the timed steps."""
    import diffuse

    transformer = load_transformer(path)
    addresses = [f"{n.address}#{n.key}" for n in nodes]
    per = len(addresses) // groups
    spec = ";".join(",".join(addresses[k * per:(k + 1) * per]) for k in range(groups))
    marks: list[int] = []  # per ring, the last pass number sent before the first timed step
    before: dict = {}

    def mark(step: int) -> None:
        if step == TIMED_FROM:
            marks.extend(max((m["seq"] for m in r.channel_stats.messages), default=0) for r in split.rings)
            before.update(parts.snapshot(split))

    pids = [p for p in (getattr(n.proc, "pid", None) for n in nodes) if p]
    with diffuse.split(transformer, nodes=spec, patches=patches, attention="auto", timeout=600,
                       model=path, ahead=ahead) as split:
        r = parts.paired(transformer, whole_tr, x, steps, GUIDANCE, mark, pids)
        timed_calls = 2 * max(1, steps - TIMED_FROM)
        r["client"] = parts.client_parts(before, parts.snapshot(split), timed_calls)
    r["times"] = r["split"]
    reports = split.node_reports
    r["nodes"] = parts.node_parts(reports, marks, per)
    # what each node worked on during the timed steps (its own clock, per call it ran)
    r["busy"] = [sum(b for seq, b in rep.get("busy_log", []) if seq > marks[k // per]) / max(1, steps - TIMED_FROM)
                 for k, rep in enumerate(reports)]
    r["reused"] = split.splitter.reused
    if groups > 1:
        r["ahead_used"] = split.ring.ahead_used
        return r
    st = split.ring.channel_stats
    later = [m for m in st.messages if m.get("step", 2) > 1]
    seqs = {m["seq"] for m in later} if patches > 1 else {m["seq"] for m in st.messages[1:]}
    sent = sum(m["bytes_out"] for m in st.messages if m["seq"] in seqs)
    back = sum(n for seq, n in st.returns if seq in seqs)
    hops = [sum(n for seq, n in rep.get("hop_bytes", []) if seq in seqs) for rep in reports[1:]]
    r.update(bytes_per_step=(sent + back + sum(hops)) / max(1, steps - 1), hops=2 + len(hops),
             paths=split.attention_paths(), ahead=split.patch_ahead)
    return r


def patch_times(path: str, cfg: dict, x: dict, patches: int, repeat: int = 3) -> dict:
    """Seconds per patch of one block on the quick and on the plain path (node code, in this process)."""
    import torch

    from diffuse.plan.calltree import flatten
    from diffuse.pipefusion.node import StaleStack
    from diffuse.plan.contracts import ReturnMap
    from diffuse.plan.messages import Patch

    transformer = load_transformer(path)
    block = transformer.blocks[0]
    seen = {}

    def grab(module, args, kwargs):
        seen.setdefault("call", (args, kwargs))  # returns None: a pre-hook that returns replaces the inputs

    hook = block.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        transformer(hidden_states=x["latent"], timestep=torch.tensor([900.0]), encoder_hidden_states=x["text"],
                    return_dict=False)
    hook.remove()
    tree, values = flatten(*seen["call"])
    rmap = ReturnMap(single=True, outputs=[0], names=["args[0]"])
    tokens = values[0].shape[1]
    count = tokens // patches
    uncut = Patch(branch=0, step=1, axis=1, tokens=tokens, uncut=True)
    rows = Patch(branch=0, step=2, axis=1, tokens=tokens).cut(0, 0, count)
    result = {}
    for path_name in ("quick", "plain"):
        stale = StaleStack("blocks", "plain" if path_name == "plain" else "auto")
        with torch.no_grad():
            stale.run([(0, block)], tree, list(values), rmap, uncut)
            patch = values[0].narrow(1, 0, count).clone()
            stale.run([(0, block)], tree, [patch] + values[1:], rmap, rows)  # chooses
            assert stale.paths[0]["path"] == path_name, stale.paths[0]
            t0 = time.perf_counter()
            for _ in range(repeat):
                stale.run([(0, block)], tree, [patch] + values[1:], rmap, rows)
            result[path_name] = (time.perf_counter() - t0) / repeat
        result[f"{path_name}_agreement"] = stale.paths[0]["agreement"]
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m diffuse.bench`` with no benchmark named: the diffusion bench."""
    from diffuse.text import plain

    from diffuse.flags import Parser

    ap = Parser(prog="diffuse bench", description=plain(__doc__.split("\n")[0]),
                                 epilog="python -m diffuse.bench quality [--help]: what patches cost in pixels and in "
                                        "the prompt's colour and motion, on the shipped trained model. "
                                        "python -m diffuse.bench cache [--help]: the same for --cache-threshold, "
                                        "with speed. "
                                        "python -m diffuse.bench lm [--help]: a language model whole and split "
                                        "(tokens/s, first token, bytes per hop). "
                                        "python -m diffuse.bench serve [--help]: the service warm against a cold "
                                        "query, and 8 concurrent streams against one. "
                                        "python -m diffuse.bench device [--help]: a Wan2.1-1.3B-shaped model on "
                                        "one device (--device cuda), whole against 2 nodes sharing it, P=1 and P=2. "
                                        "python -m diffuse.bench placement|links|memory [--help]: even slices "
                                        "against planned ones on unequal nodes; a slowed client link against its "
                                        "floor; peak memory per process at a real model's geometry")
    ap.add_argument("--quick", action="store_true", help="a small model, for a smoke test (well under a minute)")
    ap.add_argument("--steps", type=int, help="denoising steps per configuration (the first two are not timed)")
    ap.add_argument("--only", metavar="NAME[,NAME]", help="run these configurations only (of: " +
                    ", ".join(c[0] for c in CONFIGS) + "); P=1 always runs")
    ap.add_argument("--compile", action="store_true", help="also P=1 on two nodes started with --compile "
                    "(torch.compile, inductor), against the eager P=1; not exact, so its difference from whole is shown")
    ap.add_argument("--keep", metavar="DIR", help="build (or reuse) the model in DIR instead of a temp folder")
    a = ap.parse_args(argv)
    cfg = dict(QUICK if a.quick else FULL)
    if a.steps:
        cfg["steps"] = max(TIMED_FROM + 2, a.steps)
    configs = [c for c in CONFIGS if c[0] == "P=1" or not a.only or c[0] in a.only.split(",")]
    if a.compile:
        configs.append(("P=1 compiled", 1, 1, True))
    return run_bench(cfg, configs, a.keep)


CONFIGS = (("P=1", 1, 1, True), ("P=2", 2, 1, True), ("P=4 one by one", 4, 1, False), ("P=4", 4, 1, True),
           ("P=8", 8, 1, True), ("2 groups", 1, 2, True))
IDEALS = {"P=2": (4 / 3, "2P/(P+1), one call at a time", None),
          "P=4 one by one": (8 / 5, "2P/(P+1), one call at a time", 95),
          "P=4": (16 / 9, "4P/(2P+1), both calls of a step back to back", 90),
          "P=8": (32 / 17, "4P/(2P+1), both calls of a step back to back", None)}


def run_bench(cfg: dict, configs: list, keep: str | None) -> int:
    import torch

    from diffuse.local.nodes import start_local_nodes, stop_local_nodes

    torch.set_num_threads(1)
    tmp = keep or tempfile.mkdtemp(prefix="diffuse-bench-")
    nodes, group_nodes, compiled_nodes = [], [], []
    try:
        print_setup(cfg)
        if not os.path.isfile(os.path.join(tmp, "model_index.json")):
            build_model(tmp, cfg)
        nodes = start_local_nodes(tmp, 2, threads=1, extra=["--log-level", "WARNING"])
        if any(c[2] > 1 for c in configs):
            group_nodes = start_local_nodes(tmp, 2, threads=1, extra=["--log-level", "WARNING"], groups=2)
        if any(c[0] == "P=1 compiled" for c in configs):
            compiled_nodes = start_local_nodes(tmp, 2, threads=1, extra=["--log-level", "WARNING", "--compile"])
        x = inputs(cfg)
        whole_tr = load_transformer(tmp)
        load0 = os.getloadavg()
        runs = {}
        for name, p, g, ahead in configs:
            before = os.getloadavg()[0]
            on = compiled_nodes if name == "P=1 compiled" else group_nodes if g > 1 else nodes
            r = split_run(tmp, on, x, cfg["steps"], p, whole_tr, g, ahead)
            r["load"] = (before, os.getloadavg()[0])
            runs[name] = r
            print_run(name, r)
        report(cfg, runs, load0, os.getloadavg())
        pt = patch_times(tmp, cfg, x, 4)
        tokens = cfg["frames"] * (cfg["size"] // 2) ** 2
        print(f"  one block, one patch of {tokens // 4} tokens (P=4): quick {1000 * pt['quick']:.1f} ms, "
              f"plain {1000 * pt['plain']:.1f} ms ({pt['plain'] / pt['quick']:.2f}x); "
              f"quick vs plain agreement {pt['quick_agreement']:.1e}")
    finally:
        if nodes:
            stop_local_nodes(nodes)
        for started in (group_nodes, compiled_nodes):
            if started:
                stop_local_nodes(started)
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


def print_setup(cfg: dict) -> None:
    import torch

    hidden = cfg["heads"] * cfg["head_dim"]
    tokens = cfg["frames"] * (cfg["size"] // 2) ** 2
    print(f"model: WanTransformer3DModel, {cfg['layers']} blocks, hidden {hidden} ({cfg['heads']} heads x "
          f"{cfg['head_dim']}), FFN {cfg['ffn']}, random weights; {tokens} tokens "
          f"(latent {cfg['frames']}x{cfg['size']}x{cfg['size']}, patch 1x2x2), text {cfg['text_len']} tokens",
          flush=True)
    print(f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}; client and each local node at 1 "
          f"torch thread; {cfg['steps']} guided steps per run (two transformer calls each), the first "
          f"{TIMED_FROM} not timed; each split step is paired with a step of the whole model in the same process "
          f"(the whole one first on odd steps), so that load hits both alike", flush=True)


def print_run(name: str, r: dict) -> None:
    busy = ", ".join(f"{b:.2f}" for b in r["busy"])
    print(f"  {name:14s} {mean_se(r['split'][TIMED_FROM:])[0]:.3f} s per step (whole, paired: "
          f"{mean_se(r['whole'][TIMED_FROM:])[0]:.3f} s); steps: {' '.join(f'{t:.2f}' for t in r['split'])} s; "
          f"whole: {' '.join(f'{t:.2f}' for t in r['whole'])} s; node busy per timed step: {busy} s; "
          f"load {r['load'][0]:.2f} -> {r['load'][1]:.2f}", flush=True)


def report(cfg: dict, runs: dict, load0, load1) -> None:
    """Every row of the table: each ratio with its spread, the goal beside it, the load around it."""
    import torch

    steps, T = cfg["steps"], TIMED_FROM
    p1 = runs["P=1"]
    print(f"\nresults on {os.cpu_count()} cores (seconds are a step's two transformer calls, mean of steps "
          f"{T + 1}..{steps} +- one standard error; each ratio is the mean of per-step ratios against the whole "
          f"model's paired step; load average {load0[0]:.2f} before, {load1[0]:.2f} after)")
    mw, sw = mean_se(p1["whole"][T:])
    print(f"  whole, one process:       {mw:.3f} +- {sw:.3f} s/step")
    o, so = step_ratios(p1["split"][T:], p1["whole"][T:])
    print(f"  overhead (split P=1 / whole): {o:.3f} +- {so:.3f}   goal <= 1.05   (load {p1['load'][0]:.2f} -> "
          f"{p1['load'][1]:.2f}; P=1 output equals whole: {bool(torch.equal(p1['out'], p1['whole_out']))}; the "
          f"client reused {p1['reused']} projections of repeated inputs)")
    exact = p1["out"]
    for name, (ideal, what, goal) in IDEALS.items():
        if name not in runs:
            continue
        r = runs[name]
        sp, ss = step_ratios(r["whole"][T:], r["split"][T:])
        ahead = r["ahead"] or {}
        print(f"  speedup {name}: {sp:.2f}x +- {ss:.2f}   ideal {ideal:.2f}x ({what})   "
              f"{100 * sp / ideal:.0f}% of ideal" + (f"   goal >= {goal}%" if goal else "")
              + f"   calls sent ahead and used: {ahead.get('used', 0)}"
              + f"   max |out - exact| {float((r['out'] - exact).abs().max()):.2e}"
              + f"   (load {r['load'][0]:.2f} -> {r['load'][1]:.2f})")
        grown = sum(r["busy"]) / max(1e-9, sum(p1["busy"]))  # the nodes' CPU per step against P=1's
        print(f"    ... the nodes' CPU per step is {grown:.2f}x P=1's (both computing at once on {os.cpu_count()} "
              f"cores slow each other): the ideal with that work is {ideal / grown:.2f}x, reached "
              f"{100 * sp * grown / ideal:.0f}%")
    if "P=4" in runs and "P=4 one by one" in runs:
        same = bool(torch.equal(runs["P=4"]["out"], runs["P=4 one by one"]["out"]))
        print(f"  P=4 output with calls sent ahead equals P=4 one by one: {same}")
    if "2 groups" in runs:
        rg = runs["2 groups"]
        sg, sgs = step_ratios(rg["whole"][T:], rg["split"][T:])
        print(f"  speedup, branches side by side on 2 groups of 1 node: {sg:.2f}x +- {sgs:.2f}   ideal 2.00x   "
              f"{50 * sg:.0f}% of ideal   goal >= 1.80x   (load {rg['load'][0]:.2f} -> {rg['load'][1]:.2f}; calls "
              f"answered by a pass sent ahead: {rg['ahead_used']}; output equals whole: "
              f"{bool(torch.equal(rg['out'], rg['whole_out']))})")
    if "P=1 compiled" in runs:
        rc = runs["P=1 compiled"]
        c, sc = step_ratios(rc["split"][T:], rc["whole"][T:])
        print(f"  compiled nodes (--compile, inductor), P=1 / whole: {c:.3f} +- {sc:.3f}, against eager's {o:.3f}: "
              f"{o / c:.2f}x eager's speed   (load {rc['load'][0]:.2f} -> {rc['load'][1]:.2f}; not exact: max "
              f"|out - whole| {float((rc['out'] - rc['whole_out']).abs().max()):.2e})")
    report_busy(cfg, runs)
    report_parts(runs, mw)


def report_busy(cfg: dict, runs: dict) -> None:
    """The nodes' own work against the same blocks run whole, and the wire's bytes."""
    T = TIMED_FROM
    p1 = runs["P=1"]
    blocks, sb = mean_se(p1["whole_blocks_cpu"][T:])
    nodes = sum(p1["busy"])
    busy_blocks = sum(n["blocks_cpu"] * n["calls"] for n in p1["nodes"]) / max(1, len(p1["split"]) - T)
    print(f"  node busy, all nodes, P=1 vs the same blocks whole: {nodes:.2f} s vs {blocks:.2f} +- {sb:.2f} s per step "
          f"({100 * (nodes / blocks - 1):+.1f}%; goal <= +2%; CPU seconds of the compute threads, the whole "
          f"model's blocks timed in its own process; of the nodes' time, blocks alone {busy_blocks:.2f} s, "
          f"{100 * (busy_blocks / blocks - 1):+.1f}%)")
    if "P=4" in runs:
        b4 = sum(runs["P=4"]["busy"])
        print(f"  node busy per timed step, all nodes: P=1 {nodes:.2f} s, P=4 {b4:.2f} s "
              f"({100 * (b4 / nodes - 1):+.0f}%; target within 10%)")
    latent_bytes = cfg["frames"] * (cfg["size"] // 2) ** 2 * cfg["heads"] * cfg["head_dim"] * 4
    for name in ("P=1", "P=2", "P=4"):
        if name in runs:
            r = runs[name]
            print(f"  wire {name}: {r['bytes_per_step'] / 2**20:.2f} MiB per step over {r['hops']} hops "
                  f"(the whole latent on every hop of both calls: {2 * r['hops'] * latent_bytes / 2**20:.2f} MiB)")


def report_parts(runs: dict, whole_step: float) -> None:
    """Where each configuration's time went, per call; the CPU bound of two cores; the attention paths."""
    for name, r in runs.items():
        parts.print_breakdown(name, r, TIMED_FROM)
    for name, r in runs.items():
        parts.print_cpu(name, r, whole_step, TIMED_FROM)
    for name, r in runs.items():
        for stack, m in r.get("paths", {}).items():
            agree = "" if m["agreement"] is None else f", agreement {m['agreement']:.1e}"
            print(f"  attention {name}: {stack} {m['path']}{agree}")
