"""``python -m diffuse.bench device``: a Wan2.1-1.3B-shaped transformer on one device, whole against split over
2 local nodes sharing that device, at P = 1 and P = 2, side by side in one run.

The transformer has Wan2.1-T2V-1.3B's configuration (30 blocks, hidden 1536 = 12 heads x 128, FFN 8960,
text 4096 wide) with seeded random weights, saved in the compute dtype (bfloat16 unless ``--dtype`` says
otherwise); the inputs are those of a 256x256, 9-frame video (latent 16 x 3 x 32 x 32, 768 tokens; 512 text
tokens). It is driven as a guided pipeline drives it (two calls per step), whole in this process, then split
over two local nodes started with ``--device`` and ``--dtype`` (both on the one device), at one patch and at
two. Only the transformer's calls are timed, the device synchronised around each step, steps after the
first two. Printed: seconds per step whole and split, the split's overhead at P=1 and speedup at P=2 against
its ideal, whether P=1 equals whole bit for bit, the largest difference at P=2, the bytes per step on the
wire, and each node's free device memory as it said at hello. ``--quick`` runs a 4-block model of small
width (a smoke test, on the CPU too).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

WAN_1_3B = dict(heads=12, head_dim=128, ffn=8960, layers=30, text_dim=4096, text_len=512, frames=3, size=32, steps=5)
QUICK = dict(heads=4, head_dim=32, ffn=512, layers=4, text_dim=64, text_len=32, frames=3, size=16, steps=4)
TIMED_FROM = 2


def build(out_dir: str, cfg: dict, device, dtype) -> None:
    """The transformer at ``cfg``'s geometry with seeded random weights, made on ``device`` and saved in ``dtype``
    (with the pipeline index that lets nodes and client read it)."""
    import json

    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    with torch.device(device):
        model = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=cfg["heads"], attention_head_dim=cfg["head_dim"],
            in_channels=16, out_channels=16, text_dim=cfg["text_dim"], freq_dim=256, ffn_dim=cfg["ffn"],
            num_layers=cfg["layers"], cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
            rope_max_seq_len=1024)
    with torch.no_grad():  # each tensor cast in place (the model's own .to() warns of its float32 modules: the
        for t in list(model.parameters()) + list(model.buffers()):  # loads cast them back, whole and split alike)
            if t.is_floating_point():
                t.data = t.data.to(dtype)
    model.save_pretrained(os.path.join(out_dir, "transformer"))
    del model
    with open(os.path.join(out_dir, "model_index.json"), "w") as f:
        json.dump({"_class_name": "WanPipeline", "_diffusers_version": "0.42.1",
                   "transformer": ["diffusers", "WanTransformer3DModel"]}, f)


def load(path: str, device, dtype):
    from diffusers import WanTransformer3DModel

    from diffuse.plan.devices import place

    model = WanTransformer3DModel.from_pretrained(os.path.join(path, "transformer"), use_safetensors=True,
                                                  torch_dtype=dtype).eval()
    return place(model, device)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def denoise(transformer, x: dict, steps: int, device, dtype) -> tuple[list[float], "torch.Tensor"]:
    """The guided Euler loop of ``diffuse.bench.diffusion`` on ``device``: the latent kept in float32 and handed to the
    transformer in ``dtype``, as a pipeline does; the seconds of each step's two calls, synchronised."""
    import torch

    from diffuse.bench.kit import GUIDANCE

    latent = x["latent"].to(device)
    text, negative = x["text"].to(device, dtype), x["negative"].to(device, dtype)
    times = []
    with torch.no_grad():
        for s in range(steps):
            t = torch.tensor([1000.0 * (1 - s / steps)], device=device)
            sync(device)
            t0 = time.perf_counter()
            cond = transformer(hidden_states=latent.to(dtype), timestep=t, encoder_hidden_states=text,
                               return_dict=False)[0]
            uncond = transformer(hidden_states=latent.to(dtype), timestep=t, encoder_hidden_states=negative,
                                 return_dict=False)[0]
            sync(device)
            times.append(time.perf_counter() - t0)
            latent = latent - (uncond.float() + GUIDANCE * (cond.float() - uncond.float())) / steps
    return times, latent


def split_run(path: str, spec: str, x: dict, steps: int, patches: int, device, dtype) -> dict:
    import diffuse

    transformer = load(path, device, dtype)
    with diffuse.split(transformer, nodes=spec, patches=patches, timeout=600, model=path) as split:
        times, out = denoise(transformer, x, steps, device, dtype)
    st = split.ring.channel_stats
    later = [m for m in st.messages if m.get("step", 2) > 1] if patches > 1 else st.messages[1:]
    seqs = {m["seq"] for m in later}
    wire = sum(m["bytes_out"] for m in later) + sum(n for seq, n in st.returns if seq in seqs)
    hops = sum(n for r in split.node_reports[1:] for seq, n in r.get("hop_bytes", []) if seq in seqs)
    return {"times": times, "out": out, "bytes_per_step": (wire + hops) / max(1, steps - 1)}


def report(cfg: dict, whole: list[float], whole_out, runs: dict, nodes: list, loads: tuple) -> None:
    import torch

    from diffuse.bench.kit import mean_se, ratio
    from diffuse.client.heard import Heard

    mw, sw = mean_se(whole[TIMED_FROM:])
    print(f"\nresults (a step's two transformer calls, mean of steps {TIMED_FROM + 1}..{cfg['steps']} +- one "
          f"standard error; load average {loads[0]:.2f} before, {loads[1]:.2f} after)")
    print(f"  whole, one process:          {mw:.4f} +- {sw:.4f} s/step")
    for name, r in runs.items():
        m, s = mean_se(r["times"][TIMED_FROM:])
        print(f"  split {name}, 2 nodes:        {m:.4f} +- {s:.4f} s/step   wire {r['bytes_per_step'] / 2**20:.2f} "
              f"MiB per step")
    o, so = ratio(runs["P=1"]["times"][TIMED_FROM:], whole[TIMED_FROM:])
    print(f"  overhead (split P=1 / whole): {o:.3f} +- {so:.3f}   P=1 output equals whole: "
          f"{bool(torch.equal(runs['P=1']['out'], whole_out))}")
    sp, ss = ratio(whole[TIMED_FROM:], runs["P=2"]["times"][TIMED_FROM:])
    print(f"  speedup P=2: {sp:.2f}x +- {ss:.2f}   ideal 1.60x (4P/(2P+1), two stages; here both on one device)   "
          f"max |P=2 - whole| {float((runs['P=2']['out'] - whole_out).abs().max()):.2e}")
    for n in nodes:
        seen = Heard().ask(n.address)
        free = f"{seen.available / 2**30:.1f} GiB free" if seen and seen.available is not None else "memory not said"
        print(f"  node {n.address}: {seen.device if seen else '?'} in {seen.dtype if seen else '?'}, {free} at hello")


def main(argv: list[str] | None = None) -> int:
    from diffuse.cli.parsing import check_device_flags
    from diffuse.flags import Parser, device_flags
    from diffuse.text import plain

    ap = Parser(prog="diffuse bench device", description=plain(__doc__.split("\n")[0]))
    device_flags(ap, "the model whole, the client and both local nodes")
    ap.add_argument("--quick", action="store_true", help="a 4-block model of small width (a smoke test)")
    ap.add_argument("--steps", type=int, help=f"guided steps per run (default {WAN_1_3B['steps']}; the first "
                    f"{TIMED_FROM} are not timed)")
    ap.add_argument("--keep", metavar="DIR", help="build (or reuse) the model in DIR instead of a temp folder")
    a = ap.parse_args(argv)
    cfg = dict(QUICK if a.quick else WAN_1_3B)
    cfg["steps"] = max(TIMED_FROM + 2, a.steps or cfg["steps"])
    try:
        check_device_flags(a)
    except Exception as exc:
        ap.error(str(exc))
    import torch

    from diffuse.bench.kit import inputs
    from diffuse.plan.devices import Compute, torch_sees
    from diffuse.local.nodes import start_local_nodes, stop_local_nodes

    torch.set_num_threads(1)
    compute = Compute.of(a.device, a.dtype or "bfloat16")
    device, dtype = compute.device, compute.dtype or torch.float32
    flags = ["--log-level", "WARNING", "--device", str(device), "--dtype", str(dtype).removeprefix("torch.")]
    tmp = a.keep or tempfile.mkdtemp(prefix="diffuse-bench-device-")
    nodes = []
    try:
        print(f"model: WanTransformer3DModel, {cfg['layers']} blocks, hidden {cfg['heads'] * cfg['head_dim']}, "
              f"FFN {cfg['ffn']}, random weights in {str(dtype)[6:]}; latent 16x{cfg['frames']}x{cfg['size']}x"
              f"{cfg['size']}, text {cfg['text_len']} tokens; {cfg['steps']} guided steps", flush=True)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
        print(f"device: {device} ({name}); {torch_sees()}; {os.cpu_count()} CPU cores", flush=True)
        if not os.path.isfile(os.path.join(tmp, "model_index.json")):
            build(tmp, cfg, device, dtype)
        nodes = start_local_nodes(tmp, 2, threads=1, extra=flags)
        spec = ",".join(f"{n.address}#{n.key}" for n in nodes)
        x = inputs(cfg)
        loads = [os.getloadavg()[0]]
        whole, whole_out = denoise(load(tmp, device, dtype), x, cfg["steps"], device, dtype)
        runs = {f"P={p}": split_run(tmp, spec, x, cfg["steps"], p, device, dtype) for p in (1, 2)}
        loads.append(os.getloadavg()[0])
        report(cfg, whole, whole_out, runs, nodes, tuple(loads))
    finally:
        if nodes:
            stop_local_nodes(nodes)
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
