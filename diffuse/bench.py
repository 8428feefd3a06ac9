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

from diffuse.benchkit import GUIDANCE, inputs, mean_se, ratio

os.environ.setdefault("HF_HUB_OFFLINE", "1")

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


def split_run(path: str, nodes, x: dict, steps: int, patches: int, attention: str = "auto", groups: int = 1,
              ahead: bool = True) -> dict:
    import diffuse

    transformer = load_transformer(path)
    addresses = [f"{n.address}#{n.key}" for n in nodes]
    per = len(addresses) // groups
    spec = ";".join(",".join(addresses[k * per:(k + 1) * per]) for k in range(groups))
    marks: list[int] = []  # per ring, the last pass number sent before the first timed step

    def mark(step: int) -> None:
        if step == TIMED_FROM:
            marks.extend(max((m["seq"] for m in r.channel_stats.messages), default=0) for r in split.rings)

    with diffuse.split(transformer, nodes=spec, patches=patches, attention=attention, timeout=600,
                       model=path, ahead=ahead) as split:
        times, out = denoise(transformer, x, steps, mark)
    # what each node worked on during the timed steps (its own clock, per call it ran)
    busy = [sum(b for seq, b in rep.get("busy_log", []) if seq > marks[k]) / max(1, steps - TIMED_FROM)
            for k, r in enumerate(split.rings) for rep in r.node_reports]
    if groups > 1:
        return {"times": times, "out": out, "busy": busy, "ahead_used": split.ring.ahead_used,
                "reused": split.splitter.reused}
    st, reports = split.ring.channel_stats, split.node_reports
    later = [m for m in st.messages if m.get("step", 2) > 1]
    seqs = {m["seq"] for m in later} if patches > 1 else {m["seq"] for m in st.messages[1:]}
    sent = sum(m["bytes_out"] for m in st.messages if m["seq"] in seqs)
    back = sum(n for seq, n in st.returns if seq in seqs)
    hops = [sum(n for seq, n in r.get("hop_bytes", []) if seq in seqs) for r in reports[1:]]
    return {"times": times, "out": out, "bytes_per_step": (sent + back + sum(hops)) / max(1, steps - 1),
            "hops": 2 + len(hops), "paths": split.attention_paths(), "busy": busy,
            "ahead": split.patch_ahead, "reused": split.splitter.reused}


def patch_times(path: str, cfg: dict, x: dict, patches: int, repeat: int = 3) -> dict:
    """Seconds per patch of one block on the quick and on the plain path (node code, in this process)."""
    import torch

    from diffuse.callplan import flatten
    from diffuse.pipefusion import StaleStack
    from diffuse.plan import Patch, ReturnMap

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


SUBCOMMANDS = {  # python -m diffuse.bench NAME ...: the module and function that run it
    "quality": ("diffuse.quality", "main"),  # the quality table on the trained model
    "cache": ("diffuse.quality", "cache_main"),  # the first-block cache's speed and quality
    "serve": ("diffuse.serve.bench", "main"),  # the service: warm against cold, concurrent streams against one
    "lm": ("diffuse.bench_lm", "main"),  # a language model whole and split
    "device": ("diffuse.bench_device", "main"),  # a Wan2.1-1.3B-shaped model on one device, whole against 2 nodes
    "placement": ("diffuse.bench_placement", "main"),  # even slices against planned ones on unequal nodes
    "links": ("diffuse.bench_links", "main"),  # a language model over a slowed client link, against its floor
    "memory": ("diffuse.bench_memory", "main"),  # peak memory per process at a real model's geometry
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in SUBCOMMANDS:  # each in its own module
        import importlib

        module, function = SUBCOMMANDS[argv[0]]
        return getattr(importlib.import_module(module), function)(argv[1:])
    from diffuse.text import plain

    from diffuse.cli import Parser

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
    ap.add_argument("--steps", type=int, help="denoising steps per configuration (the first is not timed)")
    ap.add_argument("--keep", metavar="DIR", help="build (or reuse) the model in DIR instead of a temp folder")
    a = ap.parse_args(argv)
    cfg = dict(QUICK if a.quick else FULL)
    if a.steps:
        cfg["steps"] = max(2, a.steps)

    import torch

    from diffuse.localnodes import start_local_nodes, stop_local_nodes

    torch.set_num_threads(1)
    tmp = a.keep or tempfile.mkdtemp(prefix="diffuse-bench-")
    nodes, group_nodes = [], []
    try:
        hidden = cfg["heads"] * cfg["head_dim"]
        tokens = cfg["frames"] * (cfg["size"] // 2) ** 2
        print(f"model: WanTransformer3DModel, {cfg['layers']} blocks, hidden {hidden} ({cfg['heads']} heads x "
              f"{cfg['head_dim']}), FFN {cfg['ffn']}, random weights; {tokens} tokens "
              f"(latent {cfg['frames']}x{cfg['size']}x{cfg['size']}, patch 1x2x2), text {cfg['text_len']} tokens",
              flush=True)
        print(f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}; client and each local node at 1 "
              f"torch thread; {cfg['steps']} guided steps per run (two transformer calls each), the first "
              f"{TIMED_FROM} not timed", flush=True)
        if not os.path.isfile(os.path.join(tmp, "model_index.json")):
            build_model(tmp, cfg)
        nodes = start_local_nodes(tmp, 2, threads=1, extra=["--log-level", "WARNING"])
        group_nodes = start_local_nodes(tmp, 2, threads=1, extra=["--log-level", "WARNING"], groups=2)
        x = inputs(cfg)
        steps = cfg["steps"]

        load0 = os.getloadavg()
        whole_times, whole_out = denoise(load_transformer(tmp), x, steps)
        timed = whole_times[TIMED_FROM:]
        whole = mean_se(timed)[0]
        runs = {}
        for name, p, g, ahead in (("P=1", 1, 1, True), ("P=2", 2, 1, True), ("P=4 one by one", 4, 1, False),
                                  ("P=4", 4, 1, True), ("2 groups", 1, 2, True)):
            r = split_run(tmp, group_nodes if g > 1 else nodes, x, steps, p, "auto", g, ahead)
            r["step"] = mean_se(r["times"][TIMED_FROM:])[0]
            runs[name] = r
            busy = ", ".join(f"{b:.2f}" for b in r["busy"])
            print(f"  {name:14s} {r['step']:.3f} s per step (whole: {whole:.3f} s); steps: "
                  f"{' '.join(f'{t:.2f}' for t in r['times'])} s; node busy per timed step: {busy} s", flush=True)
        load1 = os.getloadavg()
        exact = runs["P=1"]["out"]
        latent_bytes = tokens * hidden * 4

        print(f"\nresults on {os.cpu_count()} cores (seconds are a step's two transformer calls, mean of steps "
              f"{TIMED_FROM + 1}..{steps} +- one standard error; load average {load0[0]:.2f} before, "
              f"{load1[0]:.2f} after)")
        mw, sw = mean_se(timed)
        print(f"  whole, one process:       {mw:.3f} +- {sw:.3f} s/step")
        o, so = ratio(runs["P=1"]["times"][TIMED_FROM:], timed)
        print(f"  overhead (split P=1 / whole): {o:.3f} +- {so:.3f}   target <= 1.10   "
              f"(P=1 output equals whole: {bool(torch.equal(exact, whole_out))}; the client reused "
              f"{runs['P=1']['reused']} projections of repeated inputs)")
        for name, p, ideal, what in (("P=2", 2, 4 / 3, "2P/(P+1), one call at a time"),
                                     ("P=4 one by one", 4, 8 / 5, "2P/(P+1), one call at a time"),
                                     ("P=4", 4, 16 / 9, "4P/(2P+1), both calls of a step back to back")):
            r = runs[name]
            sp, ss = ratio(timed, r["times"][TIMED_FROM:])
            ahead = r["ahead"] or {}
            print(f"  speedup {name}: {sp:.2f}x +- {ss:.2f}   ideal {ideal:.2f}x ({what})   "
                  f"{100 * sp / ideal:.0f}% of ideal" + ("   target >= 95%" if name == "P=4 one by one" else "")
                  + f"   calls sent ahead and used: {ahead.get('used', 0)}"
                  + f"   max |out - exact| {float((r['out'] - exact).abs().max()):.2e}")
        same = bool(torch.equal(runs["P=4"]["out"], runs["P=4 one by one"]["out"]))
        print(f"  P=4 output with calls sent ahead equals P=4 one by one: {same}")
        rg = runs["2 groups"]
        sg, sgs = ratio(timed, rg["times"][TIMED_FROM:])
        print(f"  speedup, branches side by side on 2 groups of 1 node: {sg:.2f}x +- {sgs:.2f}   ideal 2.00x   "
              f"{50 * sg:.0f}% of ideal   target >= 1.80x   (calls answered by a pass sent ahead: "
              f"{rg['ahead_used']}; output equals whole: {bool(torch.equal(rg['out'], whole_out))})")
        busy = {name: sum(r["busy"]) for name, r in runs.items()}
        print(f"  node busy per timed step, all nodes: P=1 {busy['P=1']:.2f} s, P=4 {busy['P=4']:.2f} s "
              f"({100 * (busy['P=4'] / busy['P=1'] - 1):+.0f}%; target within 10%)")
        for name in ("P=1", "P=2", "P=4"):
            r = runs[name]
            print(f"  wire {name}: {r['bytes_per_step'] / 2**20:.2f} MiB per step over {r['hops']} hops "
                  f"(the whole latent on every hop of both calls: {2 * r['hops'] * latent_bytes / 2**20:.2f} MiB)")
        for name, r in runs.items():
            for stack, m in r.get("paths", {}).items():
                agree = "" if m["agreement"] is None else f", agreement {m['agreement']:.1e}"
                print(f"  attention {name}: {stack} {m['path']}{agree}")
        pt = patch_times(tmp, cfg, x, 4)
        print(f"  one block, one patch of {tokens // 4} tokens (P=4): quick {1000 * pt['quick']:.1f} ms, "
              f"plain {1000 * pt['plain']:.1f} ms ({pt['plain'] / pt['quick']:.2f}x); "
              f"quick vs plain agreement {pt['quick_agreement']:.1e}")
    finally:
        if nodes:
            stop_local_nodes(nodes)
        if group_nodes:
            stop_local_nodes(group_nodes)
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
