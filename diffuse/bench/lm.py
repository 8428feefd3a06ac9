"""``python -m diffuse.bench lm``: a language model whole and split, side by side in one run.

A Qwen2-shaped causal model with seeded random weights is built offline and
saved; the same greedy ``generate`` (a fixed prompt of token ids) runs whole in
this process and split over 1 and over 2 local nodes (every process at one
torch thread), in turn for ``--rounds`` rounds so that the machine's load hits
each alike. Printed: tokens per second after the first token against whole
(the mean of the per-round ratios, with its spread), first-token latency, the
bytes one decoding step puts on each hop (sealed, as measured on the wire),
whether the tokens are the same, the CPU per token of every process (the work a
split adds, and the cap that work alone puts on its rate), and where a token's
time goes: the client's generate loop, hashing, sealing, waiting; on each node
opening, checking and assembling, the layers, handing on, sealing; the hops.
In the same rounds a bare ring of 1 and of 2 worker processes runs the same
layers with nothing of Diffuse between them (``diffuse.bench.bare``): what a
plain ring of processes over ZeroMQ reaches on this machine at this size, and
each split's rate as a fraction of it.

``--link-ms MS``: drafts verified by the ring, over links delayed MS each hop (``diffuse.bench.drafts``).

``--sessions N``: N greedy sessions at once (prompts of different lengths),
each its own client on a thread of this process (its own model copy and
``diffuse.split``) over the same 2 local nodes, started once with ``--no-batch``
and once batching; and a single stream on each. Printed: tokens per second of
all sessions together, the median time between two tokens of a session, the
batches the nodes formed, and whether every session's tokens are those of its
prompt run alone, whole.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import threading
import time

from diffuse.bench import parts
from diffuse.bench.bare import BareRing
from diffuse.bench.kit import Clock
from diffuse.bench.lm_report import BARE, print_cpu, print_rates, print_sessions, print_token_breakdown

FULL = dict(layers=8, hidden=512, heads=8, kv_heads=2, ffn=1536, vocab=8192, prompt=64, new=32)
QUICK = dict(layers=4, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=512, prompt=16, new=8)


def build(out_dir: str, cfg: dict, family: str = "Qwen2") -> None:
    """The model at ``cfg``'s geometry, of transformers' ``{family}ForCausalLM``, with seeded random weights."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(
        hidden_size=cfg["hidden"], intermediate_size=cfg["ffn"], num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"], vocab_size=cfg["vocab"],
        max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
        pad_token_id=None)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model.save_pretrained(out_dir)


def generate(model, ids, new: int):
    import torch

    clock = Clock()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, streamer=clock)
    return out[:, ids.shape[1]:], clock


def main(argv: list[str] | None = None) -> int:
    from diffuse.cli.parsing import check_device_flags
    from diffuse.flags import Parser, device_flags
    from diffuse.text import plain

    ap = Parser(prog="diffuse bench lm", description=plain(__doc__.split("\n")[0]))
    device_flags(ap, "the model whole, the client and the local nodes")
    ap.add_argument("--quick", action="store_true", help="a tiny model, for a smoke test")
    ap.add_argument("--new-tokens", type=int, help="tokens to generate per run")
    ap.add_argument("--rounds", type=int, help="rounds of whole and split generation in turn (default 3; 2 with "
                    "--quick)")
    ap.add_argument("--sessions", type=int, metavar="N",
                    help="N concurrent sessions, the nodes batching off and on, and a single stream on each")
    ap.add_argument("--link-ms", type=float, metavar="MS",
                    help="drafts verified by the ring (off, prompt lookup, an assistant) on the shipped chat model, "
                    "every hop delayed MS one way, and on loopback beside whole (diffuse.bench.drafts)")
    a = ap.parse_args(argv)
    if a.sessions is not None and a.sessions < 1:
        ap.error("--sessions must be at least 1")
    if a.link_ms is not None:
        if not 0 <= a.link_ms <= 1000:
            ap.error("--link-ms: 0 to 1000")
        from diffuse.bench import drafts

        return drafts.main(a.link_ms, max(2, a.rounds or (2 if a.quick else 3)), a.quick)
    try:
        check_device_flags(a)  # before the model is built
    except Exception as exc:
        ap.error(str(exc))
    cfg = dict(QUICK if a.quick else FULL)
    a.rounds = max(2, a.rounds or (2 if a.quick else 3))
    if a.new_tokens:
        cfg["new"] = max(2, a.new_tokens)

    import torch

    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="diffuse-bench-lm-")
    try:
        build(tmp, cfg)
        print(f"model: Qwen2ForCausalLM, {cfg['layers']} layers, hidden {cfg['hidden']} ({cfg['heads']} heads, "
              f"{cfg['kv_heads']} key/value heads), FFN {cfg['ffn']}, vocabulary {cfg['vocab']}, random weights; "
              f"prompt {cfg['prompt']} tokens, {cfg['new']} new tokens, greedy", flush=True)
        print(f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}; every process at 1 torch thread",
              flush=True)
        if a.sessions:
            return sessions(tmp, cfg, a.sessions, a.device, a.dtype)
        ids = torch.randint(0, cfg["vocab"], (1, cfg["prompt"]), generator=torch.Generator().manual_seed(0))
        rows = interleaved(tmp, cfg, ids, a.rounds, a.device, a.dtype)
        print(f"\nresults ({a.rounds} rounds, whole and split in turn, each ratio the mean of the per-round ratios "
              f"+- one standard error; load average {rows['load'][0]:.2f} before, {rows['load'][1]:.2f} after)")
        print_rates(rows)
        for name in ("split, 1 node", "split, 2 nodes"):
            r = rows[name]
            print(f"  {name}: bytes per decoding step on each hop (sealed): "
                  + ", ".join(f"{h} {b:.0f} B" for h, b in r["hops"]))
        print_cpu(rows, cfg["new"])
        for name in ("split, 1 node", "split, 2 nodes"):
            print_token_breakdown(name, rows[name], rows["whole"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def interleaved(tmp: str, cfg: dict, ids, rounds: int, device: str | None = None, dtype: str | None = None) -> dict:
    """The whole model and splits over 1 and 2 local nodes (all open at once), generating in turn for ``rounds``
    rounds (the order turning each round), so that the machine's load hits each alike. Per configuration: its
    clocks, whether its tokens equal whole's, bytes per hop, and where its time went per pass."""
    import contextlib

    import torch

    import diffuse
    from diffuse.client.api import ModelInfo, client_compute, load_whole_or_shell

    load0 = os.getloadavg()[0]
    info = ModelInfo.of(tmp)
    compute = client_compute(info, device, dtype)
    print(f"device: {compute.describe()} (client, whole model and local nodes)", flush=True)
    ids = ids.to(compute.device)
    models = {"whole": load_whole_or_shell(info, compute, shell=False),
              "split, 1 node": diffuse.from_pretrained(tmp, device=device, dtype=dtype),
              "split, 2 nodes": diffuse.from_pretrained(tmp, device=device, dtype=dtype)}
    if device is None and dtype is None:  # the bare ring runs on the CPU in the default dtype only
        models.update((name, load_whole_or_shell(info, compute, shell=False)) for name in BARE)
    rows = {name: {"clocks": [], "tokens": None, "client": {}, "marks": None, "cpu": []} for name in models}
    with contextlib.ExitStack() as stack:
        bare = {name: stack.enter_context(BareRing(tmp, n)) for name, n in BARE.items() if name in models}
        rings = {name: stack.enter_context(diffuse.split(models[name], local_nodes=n, speculate="off"))
                 for name, n in (("split, 1 node", 1), ("split, 2 nodes", 2))}
        for name, ring in bare.items():
            ring.install(models[name])
        for name, model in models.items():
            generate(model, ids, 2)  # warm-up: sessions open, blocks loaded, call plans learnt
            if name in rings:
                rows[name]["marks"] = max((m["seq"] for m in rings[name].ring.channel_stats.messages), default=0)
        names = list(models)
        for k in range(rounds):
            for name in names[k % len(names):] + names[:k % len(names)]:
                before = parts.snapshot(rings[name]) if name in rings else None
                pids = [n.proc.pid for n in (rings[name].local_nodes or [])] if name in rings else \
                    bare[name].pids if name in bare else []
                c0, n0 = time.process_time(), parts.process_cpu(pids)
                tokens, clock = generate(models[name], ids, cfg["new"])
                row = rows[name]
                row["cpu"].append((time.process_time() - c0, parts.process_cpu(pids) - n0))
                row["clocks"].append(clock)
                row["tokens"] = tokens if row["tokens"] is None else row["tokens"]
                if before is not None:
                    for key, v in parts.snapshot(rings[name]).items():
                        row["client"][key] = row["client"].get(key, 0.0) + v - before[key]
    for name, ring in rings.items():
        row = rows[name]
        row["hops"] = per_token_hops(ring, cfg["new"])
        row["nodes"] = parts.node_parts(ring.node_reports, [row["marks"]], len(ring.node_reports))
        row["same"] = bool(torch.equal(row["tokens"], rows["whole"]["tokens"]))
        row["passes"] = rounds * cfg["new"]
    for name in bare:
        rows[name]["same"] = bool(torch.equal(rows[name]["tokens"], rows["whole"]["tokens"]))
    rows["whole"]["same"] = True
    rows["load"] = (load0, os.getloadavg()[0])
    return rows


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


def gaps(clock: Clock) -> list[float]:
    """Seconds between a session's consecutive tokens."""
    return [b - a for a, b in zip(clock.times, clock.times[1:])]


def sessions(model_dir: str, cfg: dict, n: int, device: str | None = None, dtype: str | None = None) -> int:
    """``--sessions N`` (see the module's docstring); 1 if any session's tokens differ from its solo run. ``device``
    and ``dtype``: the flags of that name, for the whole model, every client and the nodes."""
    import torch

    import diffuse
    from diffuse.client.api import ModelInfo, client_compute, load_whole_or_shell
    from diffuse.local.nodes import start_local_nodes
    from diffuse.wire.transport import transport_for

    lengths = [max(2, cfg["prompt"] * (i + 1) // n) for i in range(n)]
    info = ModelInfo.of(model_dir)
    compute = client_compute(info, device, dtype)
    prompts = [torch.randint(0, cfg["vocab"], (1, length), generator=torch.Generator().manual_seed(i)).to(compute.device)
               for i, length in enumerate(lengths)]
    whole = load_whole_or_shell(info, compute, shell=False)
    on = ["--device", str(compute.device)] + (["--dtype", str(compute.dtype)[6:]] if compute.dtype else [])
    solo = [generate(whole, ids, cfg["new"])[0] for ids in prompts]  # each prompt alone, whole
    del whole
    print(f"{n} concurrent greedy sessions (prompts of {lengths[0]} to {lengths[-1]} tokens, {cfg['new']} new tokens "
          "each), each its own client thread and split, over the same 2 local nodes", flush=True)
    rows, same = {}, True
    for mode, extra in (("off", ["--no-batch"]), ("on", [])):
        load = os.getloadavg()[0]
        nodes = start_local_nodes(model_dir, 2, threads=1, extra=extra + on)
        try:
            spec = [f"{node.address}#{node.key}" for node in nodes]
            copies = [diffuse.from_pretrained(model_dir, device, dtype) for _ in range(n)]  # one after another
            with diffuse.split(copies[0], nodes=spec, speculate="off"):
                generate(copies[0], prompts[0], 2)  # warm-up
                tokens, clock = generate(copies[0], prompts[0], cfg["new"])
            single_same = bool(torch.equal(tokens, solo[0]))
            rows[("single", mode)] = (clock.per_second, statistics.median(gaps(clock)), single_same)
            before = [transport_for(node.address).request(node.address, {"op": "status"}, 10.0) for node in nodes]
            ready = threading.Barrier(n + 1, timeout=600)
            out: dict[int, object] = {}
            timed: dict[int, tuple] = {}  # per session: its nodes' time per timed pass, tails run with its batch's

            def session(i: int) -> None:
                try:
                    with diffuse.split(copies[i], nodes=spec, speculate="off") as sp:
                        generate(copies[i], prompts[i], 2)  # warm-up: the session is open, its call plans learnt
                        mark = max(m["seq"] for m in sp.ring.channel_stats.messages)
                        ready.wait()
                        out[i] = generate(copies[i], prompts[i], cfg["new"])
                    timed[i] = (parts.node_parts(sp.node_reports, [mark], len(sp.node_reports)),
                                sum(r.get("joint_tails", 0) for r in sp.node_reports))
                except BaseException as exc:  # reported below
                    ready.abort()
                    out[i] = exc

            threads = [threading.Thread(target=session, args=(i,), daemon=True) for i in range(n)]
            for t in threads:
                t.start()
            pids = [p for p in (getattr(node.proc, "pid", None) for node in nodes) if p]
            ready.wait()
            t0, c0, n0 = time.perf_counter(), time.process_time(), parts.process_cpu(pids)
            for t in threads:
                t.join(600)
            wall = time.perf_counter() - t0
            cpu = (time.process_time() - c0, parts.process_cpu(pids) - n0)
            for i in range(n):
                if not isinstance(out.get(i), tuple):
                    raise RuntimeError(f"session {i} failed: {out.get(i)!r}")
            after = [transport_for(node.address).request(node.address, {"op": "status"}, 10.0) for node in nodes]
        finally:
            nodes.stop()
        equal = [bool(torch.equal(out[i][0], solo[i])) for i in range(n)]
        same = same and all(equal) and single_same
        batches = sum(a["batches"] - b["batches"] for a, b in zip(after, before))
        batched = sum(a["batched_rows"] - b["batched_rows"] for a, b in zip(after, before))
        rows[("sessions", mode)] = (n * cfg["new"] / wall,
                                    statistics.median(g for i in range(n) for g in gaps(out[i][1])), all(equal),
                                    batches, batched, sum(t[1] for t in timed.values()))
        rows[("cpu", mode)] = tuple(c / (n * cfg["new"]) for c in cpu)
        rows[("nodes", mode)] = parts.merged([t[0] for t in timed.values()])
        rows[("load", mode)] = (load, os.getloadavg()[0])
    print_sessions(rows, n)
    print(f"  every session's tokens equal its solo run: {same}")
    return 0 if same else 1
