"""``python -m diffuse.bench fetch``: what each machine of a ring fetches of a Hub model, against the whole model.

A Hub on loopback (``diffuse.bench.hubserver``) serves the shipped tiny-wan-shapes twice: as it ships (its
denoiser's weights in one file) and with those weights cut into shards. For 2 and 4 nodes, each node, in a
Hugging Face home of its own, fetches what ``diffuse node --model ORG/NAME --blocks K/N`` fetches before it serves
(configs, headers, then its slice's tensors: ``diffuse.plan.hubmodel``, ``diffuse.plan.fetching.hold``); the
client what ``diffuse query`` fetches; and one more home downloads the whole model. Bytes come from the server's
own log, seconds from each fetch's clock; ``--rate`` caps the server (bytes a second, all transfers together) so
that the bytes, not this machine's disk, set the time. Each figure is the median of ``--rounds`` fresh fetches,
with its spread (min-max).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time


def _sharded(source: str, into: str, shards: int) -> str:
    """``source`` copied with its denoiser's weights cut into ``shards`` files and an index, as large
    checkpoints ship."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(source, into)
    folder = os.path.join(into, "transformer")
    single = os.path.join(folder, "diffusion_pytorch_model.safetensors")
    with safe_open(single, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    os.unlink(single)
    keys = list(tensors)
    per = -(-len(keys) // shards)
    weight_map = {}
    for i in range(shards):
        name = f"diffusion_pytorch_model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k].contiguous() for k in keys[i * per:(i + 1) * per]}
        save_file(part, os.path.join(folder, name), metadata={"format": "pt"})
        weight_map.update((k, name) for k in part)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(folder, "diffusion_pytorch_model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return into


def _fetch_as(hub, who: str, root: str, what, repo: str) -> tuple[int, float, int]:
    """(bytes sent, seconds, bytes of its slice's tensors as stored: 0 but for a node) for one machine's fetch in
    a fresh home: ``what`` is "whole", "client" or (k, n)."""
    from diffuse.plan.fetching import hold
    from diffuse.plan.hub import hub_ref
    from diffuse.plan.hubmodel import block_keys, fetch_model
    from diffuse.plan.planner import analyze

    os.environ.update(HF_HOME=os.path.join(root, who), HF_ENDPOINT=hub.endpoint(who), DIFFUSE_HUB_OFFLINE="0")
    quiet = lambda line: None  # noqa: E731
    t0, own = time.perf_counter(), 0
    if isinstance(what, str):
        fetch_model(hub_ref(repo), what, quiet)
    else:
        from diffuse.plan.contracts import parse_slices

        folder = fetch_model(hub_ref(repo), "node", quiet)
        subject, draft = analyze(folder)
        keys = block_keys(subject, draft["stacks"])
        needs: dict[str, list[str]] = {}
        for sl in parse_slices(f"{what[0]}/{what[1]}", list(draft["stacks"])):
            for i in range(sl.start, sl.stop):
                for file, key in keys[(sl.stack, i)]:
                    needs.setdefault(file, []).append(key)
        hold(needs, quiet)
        seconds = time.perf_counter() - t0
        for file, names in needs.items():
            with open(file, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                meta = json.loads(f.read(n))
            own += sum(meta[k]["data_offsets"][1] - meta[k]["data_offsets"][0] for k in names)
        return hub.fetched(who), seconds, own
    return hub.fetched(who), time.perf_counter() - t0, own


def main(argv: list[str] | None = None) -> int:
    from diffuse.bench.hubserver import HubServer
    from diffuse.plan.shipped import shipped_models

    ap = argparse.ArgumentParser(prog="python -m diffuse.bench fetch", description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=50e6, help="the server's bytes a second (default 50e6)")
    ap.add_argument("--rounds", type=int, default=3, help="fresh fetches per figure (default 3)")
    ap.add_argument("--shards", type=int, default=4, help="shards of the sharded copy's denoiser (default 4)")
    ap.add_argument("--quick", action="store_true", help="one round (as --rounds 1)")
    a = ap.parse_args(argv)
    if a.quick:
        a.rounds = 1
    saved = {k: os.environ.get(k) for k in ("HF_HOME", "HF_ENDPOINT", "DIFFUSE_HUB_OFFLINE")}
    root = tempfile.mkdtemp(prefix="diffuse-bench-fetch-")
    try:
        with HubServer(rate=a.rate) as hub:
            source = shipped_models()["tiny-wan-shapes"]
            repos = {"one file": ("org/one-file", source),
                     f"{a.shards} shards": ("org/sharded", _sharded(source, os.path.join(root, "sharded"), a.shards))}
            for repo, folder in repos.values():
                hub.publish(repo, folder)
            from diffuse.plan.planner import analyze

            analyze(source)  # the libraries the analysis imports, imported before any clock starts
            print(f"tiny-wan-shapes from a loopback Hub at {a.rate / 1e6:.0f} MB/s; medians of {a.rounds} fresh "
                  "fetches (min-max); bytes from the server's log")
            print(f"{'checkpoint':<11} {'machine':<14} {'bytes':>12} {'of whole':>9} {'seconds':>18} {'of whole':>9} "
                  f"{'its tensors':>12} {'bytes / them':>12}")
            run = 0
            for label, (repo, _) in repos.items():
                whos = [("whole", "whole"), ("client", "client")] + \
                       [(f"node {k}/{n}", (k, n)) for n in (2, 4) for k in range(1, n + 1)]
                figures = {}
                for name, what in whos:
                    got = []
                    for _ in range(a.rounds):
                        run += 1
                        got.append(_fetch_as(hub, f"r{run}", root, what, repo))
                    figures[name] = got
                whole_b = statistics.median(b for b, _, _ in figures["whole"])
                whole_s = statistics.median(s for _, s, _ in figures["whole"])
                for name, got in figures.items():
                    b, s, own = [x[0] for x in got], [x[1] for x in got], got[0][2]
                    spread = f"{statistics.median(s):.3f} ({min(s):.3f}-{max(s):.3f})"
                    mine = f"{own:>12,} {statistics.median(b) / own:>12.3f}" if own else f"{'':>12} {'':>12}"
                    print(f"{label:<11} {name:<14} {statistics.median(b):>12,.0f} {statistics.median(b) / whole_b:>9.3f} "
                          f"{spread:>18} {statistics.median(s) / whole_s:>9.3f} {mine}")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(root, ignore_errors=True)
    return 0
