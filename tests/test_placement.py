"""Placement: the planner against an exhaustive search, the nodes' reports, and planned slices through real nodes.

The planner (``diffuse.plan.solver.place``) is a pure function, checked here against every placement there is
on small cases. Through real node processes: a node that says it has no room for a block (``--max-memory``)
is left out of the route, an even split that would not fit is refused before anything is loaded, naming
the node and the shortfall, and the tokens generated over the planned slices are the tokens plain
transformers generates whole (tests/lm_reference.py, run in a subprocess).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys

import pytest

from conftest import TESTS, THREADS, node_process, run_cli, run_client, subprocess_env
from diffuse.plan.needs import GIB, BlockCost
from diffuse.plan.placement import MARGIN_MIN_BYTES, Capacity, DoesNotFit, rooms
from diffuse.plan.reports import NodeReport
from diffuse.plan.solver import even_placement, place
from diffuse.plan.contracts import split_evenly

MIB = 1 << 20


def _runs(p) -> list[tuple[int, int]]:
    """Each node's run of the blocks (one stack)."""
    return [(row[0].start, row[0].stop) for row in p.rows]


def _brute(blocks, nodes):
    """Every contiguous placement in node order (a node may take none): the least slowest share among those
    that fit and use as many nodes as any placement that fits can, and the runs that reach it."""
    L, n = len(blocks), len(nodes)
    room = rooms(nodes)
    speeds = [c.speed for c in nodes]
    best = {}
    for cuts in itertools.combinations_with_replacement(range(L + 1), n - 1):
        bounds = (0, *cuts, L)
        runs = list(zip(bounds, bounds[1:]))
        ok, shares = True, []
        for i, (a, b) in enumerate(runs):
            need = sum((0 if (blk.stack, blk.index) in nodes[i].holds else blk.weight_bytes) + blk.held_bytes
                       for blk in blocks[a:b])
            if room[i] is not None and need > room[i]:
                ok = False
                break
            shares.append(speeds[i] * sum(blk.weight_bytes + blk.end_compute for blk in blocks[a:b]) / GIB)
        if ok:
            used = sum(b > a for a, b in runs)
            best[used] = min(best.get(used, float("inf")), max(shares))
    return (max(best), best[max(best)]) if best else None


def test_planner_with_passes_in_flight_finds_the_least_slowest_share_an_exhaustive_search_finds():
    rng = random.Random(7)
    for case in range(150):
        L, n = rng.randint(1, 9), rng.randint(1, 4)
        blocks = [BlockCost("blocks", i, rng.choice([8, 16, 24]) * MIB, rng.choice([0, 2 * MIB]))
                  for i in range(L)]
        if rng.random() < 0.5:  # a language model's embedding table with the first block, its head with the last
            import dataclasses

            blocks[0] = dataclasses.replace(blocks[0], end_bytes=12 * MIB)
            blocks[-1] = dataclasses.replace(blocks[-1], end_bytes=blocks[-1].end_bytes + 12 * MIB,
                                             end_compute=12 * MIB)
        nodes = [Capacity(f"n{k}", rng.choice([None, MARGIN_MIN_BYTES + rng.randint(0, 80) * MIB]),
                          rng.choice([1.0, 2.0, 3.0]),
                          frozenset(("blocks", i) for i in range(L) if rng.random() < 0.2))
                 for k in range(n)]
        want = _brute(blocks, nodes)
        if want is None:
            with pytest.raises(DoesNotFit, match="GiB"):
                place(blocks, nodes, depth=2)
            continue
        p = place(blocks, nodes, depth=2)
        runs = _runs(p)
        assert runs[0][0] == 0 and runs[-1][1] == L and all(a[1] == b[0] for a, b in zip(runs, runs[1:])), runs
        assert len(p.used) == want[0], (case, runs)
        assert p.slowest_s == pytest.approx(want[1], rel=1e-9), (case, runs)
        for i in range(n):  # every node's run fits its room
            assert p.room[i] is None or p.need[i] <= p.room[i]


def _brute_one_at_a_time(blocks, nodes, hop):
    """Every contiguous placement in node order (a node may take none), passes one at a time: the least pass
    time (used nodes' shares, the hops between the ends used, ``LEAVE_OUT`` of the compute per node left out)."""
    from diffuse.plan.solver import LEAVE_OUT, LEAVE_OUT_S, _speeds

    L, n = len(blocks), len(nodes)
    room, speeds = rooms(nodes), _speeds(nodes)[0]
    total = sum(b.weight_bytes + b.end_compute for b in blocks) / GIB
    mid = sorted(speeds)[(n - 1) // 2] if n % 2 else (sorted(speeds)[n // 2 - 1] + sorted(speeds)[n // 2]) / 2
    penalty = max(LEAVE_OUT * mid * total, LEAVE_OUT_S)
    best = None
    for cuts in itertools.combinations_with_replacement(range(L + 1), n - 1):
        bounds = (0, *cuts, L)
        runs = list(zip(bounds, bounds[1:]))
        if any(room[i] is not None and sum(blk.weight_bytes + blk.held_bytes for blk in blocks[a:b]) > room[i]
               for i, (a, b) in enumerate(runs)):
            continue
        used = [i for i, (a, b) in enumerate(runs) if b > a]
        ends = [n, *used, n]
        t = sum(speeds[i] * sum(blk.weight_bytes for blk in blocks[a:b]) / GIB for i, (a, b) in enumerate(runs))
        t += sum(hop[x][y] for x, y in zip(ends, ends[1:])) + penalty * (n - len(used))
        best = t if best is None else min(best, t)
    return best


def test_link_aware_planning_finds_the_quickest_pass_and_drops_a_hop_over_a_slow_link():
    """Passes one at a time: the least time of a pass with its hops (against every placement there is); two
    equal nodes share the blocks over a quick link, and one holds them all when the link between them costs
    more than the compute the second would take off the first (one hop fewer)."""
    rng = random.Random(19)
    for case in range(120):
        L, n = rng.randint(1, 7), rng.randint(1, 4)
        blocks = [BlockCost("blocks", i, rng.choice([8, 16, 24]) * MIB) for i in range(L)]
        nodes = [Capacity(f"n{k}", rng.choice([None, None, MARGIN_MIN_BYTES + rng.randint(0, 60) * MIB]),
                          rng.choice([0.5, 1.0, 3.0])) for k in range(n)]
        hop = [[0.0 if i == j else rng.choice([1e-4, 2e-3, 0.02]) for j in range(n + 1)] for i in range(n + 1)]
        want = _brute_one_at_a_time(blocks, nodes, hop)
        if want is None:
            with pytest.raises(DoesNotFit):
                place(blocks, nodes, links=hop)
            continue
        p = place(blocks, nodes, links=hop)
        from diffuse.plan.solver import leave_out_s

        penalty = leave_out_s(p.speeds, sum(b.weight_bytes for b in blocks))
        assert p.pass_s + penalty * (n - len(p.used)) == pytest.approx(want, rel=1e-9), (case, _runs(p))
        assert all(p.room[i] is None or p.need[i] <= p.room[i] for i in range(n))
    # two equal nodes, 8 blocks of 64 MiB at 1 s/GiB (0.5 s a pass): a quick link keeps both; a slow one between
    # them (not to the client), 0.2 s, costs more than a tenth of the compute: it is worth one hop fewer
    blocks = [BlockCost("blocks", i, 64 * MIB) for i in range(8)]
    pair = [Capacity("a", None, 1.0), Capacity("b", None, 1.0)]
    quick = [[0.0, 1e-4, 1e-4], [1e-4, 0.0, 1e-4], [1e-4, 1e-4, 0.0]]
    slow = [[0.0, 0.2, 1e-4], [0.2, 0.0, 1e-4], [1e-4, 1e-4, 0.0]]
    assert _runs(place(blocks, pair, links=quick)) == [(0, 4), (4, 8)]
    p = place(blocks, pair, links=slow)
    assert len(p.used) == 1 and p.hops == [1e-4, 1e-4]
    assert any("would make a pass slower" in note for note in p.notes)
    # the same slow link with the blocks too big for either node alone: both are used, and the hop is paid
    tight = [Capacity(name, MARGIN_MIN_BYTES * 2 + 300 * MIB, 1.0) for name in "ab"]
    p = place(blocks, tight, links=slow)
    assert len(p.used) == 2 and p.hops == [1e-4, 0.2, 1e-4]
    # a client link measured as a Link: half its round trip plus the bytes at its throughput
    from diffuse.wire.links import Link

    assert Link(0.010, 1e6).hop_s(2000) == pytest.approx(0.005 + 0.002)


def test_equal_nodes_get_even_slices_and_faster_ones_more():
    blocks = [BlockCost("blocks", i, 16 * MIB) for i in range(10)]
    for n in (1, 2, 3, 4):
        p = place(blocks, [Capacity(f"n{k}", None) for k in range(n)])
        assert _runs(p) == split_evenly(10, n)  # as the even route cuts them: earlier nodes take the remainder
    # patches in flight: one node three times as fast as two others takes three times their share, to the block
    unequal = [Capacity("fast", None, 1.0), Capacity("slow1", None, 3.0), Capacity("slow2", None, 3.0)]
    p = place(blocks, unequal, depth=4)
    assert [b - a for a, b in _runs(p)] == [6, 2, 2]
    # passes one at a time: the fast node takes all but a block each (leaving the slow ones out would save
    # less than a tenth of a pass's compute at the median speed)
    assert [b - a for a, b in _runs(place(blocks, unequal))] == [8, 1, 1]
    # a node not measured counts at the median of those measured (here 3.0: the slow ones' speed)
    p = place(blocks, [Capacity("fast", None, 1.0), Capacity("new", None), Capacity("slow1", None, 3.0),
                       Capacity("slow2", None, 3.0)], depth=4)
    assert p.measured == [True, False, True, True] and p.speeds[1] == 3.0
    assert [b - a for a, b in _runs(p)] == [6, 2, 1, 1]
    # speeds a busy machine measures within a quarter of each other count alike: even slices
    p = place(blocks, [Capacity("a", None, 1.0), Capacity("b", None, 1.2)])
    assert _runs(p) == [(0, 5), (5, 10)] and p.speeds[0] == p.speeds[1]


def test_memory_bounds_each_run_and_a_node_without_room_is_left_out():
    blocks = [BlockCost("blocks", i, 16 * MIB, 1 * MIB) for i in range(6)]
    small = MARGIN_MIN_BYTES + 40 * MIB  # room for two blocks with their state, not three
    p = place(blocks, [Capacity("a", None), Capacity("b", small), Capacity("c", None)])
    assert _runs(p)[1][1] - _runs(p)[1][0] <= 2 and p.need[1] <= p.room[1]
    none = MARGIN_MIN_BYTES + 4 * MIB  # room for no block
    p = place(blocks, [Capacity("a", None), Capacity("b", none), Capacity("c", None)])
    assert _runs(p) == [(0, 3), (3, 3), (3, 6)] and p.used == [0, 2]
    assert any("b holds nothing" in note and "no block" in note for note in p.notes)
    # a block a node already holds costs it no memory: it fits one more
    held = place(blocks, [Capacity("a", None), Capacity("b", small, holds=frozenset({("blocks", 2)})),
                          Capacity("c", None)])
    assert held.need[1] <= held.room[1]


def test_a_model_that_fits_nowhere_is_refused_with_its_shortfall_in_gib():
    blocks = [BlockCost("blocks", i, 256 * MIB) for i in range(8)]  # 2 GiB
    nodes = [Capacity("a", GIB), Capacity("b", GIB // 2)]
    with pytest.raises(DoesNotFit) as refused:
        place(blocks, nodes)
    have = sum(rooms(nodes)) / GIB
    assert f"{have:.2f} GiB between them" in str(refused.value)
    assert f"{2 - have:.2f} GiB short" in str(refused.value)
    # even slices that would overfill a node are refused too, naming it and by how much
    nodes = [Capacity("a", 4 * GIB), Capacity("b", GIB)]
    with pytest.raises(DoesNotFit, match=r"b would take 1\.00 GiB and has room for 0\.90 \(0\.10 GiB short\)"):
        even_placement(blocks, nodes)
    assert _runs(place(blocks, nodes)) == [(0, 5), (5, 8)]


def test_nodes_sharing_one_machine_share_its_memory():
    one = [Capacity("a", 8 * GIB, pool="m1"), Capacity("b", 8 * GIB, pool="m1"), Capacity("c", 8 * GIB, pool="m2")]
    r = rooms(one)
    assert r[0] == r[1] < r[2] and r[0] == 4 * GIB - int(4 * GIB * 0.1)


def test_a_hello_report_is_read_whatever_it_holds():
    good = {"report": {"memory": {"available": 3 * GIB, "limit": 4 * GIB, "source": "cgroup v1", "pool": "ab"},
                       "holds": [["blocks", 0, 3, "float32"]], "threads": 2, "cpus": 0.5, "device": "cpu",
                       "dtype": "float32",
                       "speed": {"model": "h", "s_per_pass": 0.003,
                                 "by_dtype": {"float32": {"s_per_block_token": 0.1, "s_per_gib_token": 2.0,
                                                          "s_per_gib_single": 5.0, "passes": 4}}}}}
    r = NodeReport.from_hello("tcp://x:1", good, 0.002)
    assert r.available == 3 * GIB and r.cpus == 0.5 and len(r.holds) == 3 and r.s_per_gib_token("float32", "h") == 2.0
    assert r.s_per_gib_token("float32", "h", "single") == 5.0 and r.pass_s == 0.003
    assert r.s_per_gib_token("float32", "another model") is None
    rng = random.Random(1)
    junk = [None, 1, "x", [], {}, -5, float("nan"), True, [["blocks", 0, 1 << 40, "f"]], {"by_dtype": [1]}]
    for _ in range(300):
        bad = json.loads(json.dumps(good))
        section = rng.choice(["memory", "holds", "threads", "cpus", "speed", "device"])
        bad["report"][section] = rng.choice(junk)
        r = NodeReport.from_hello("tcp://x:1", bad)  # never raises; what is malformed is not said
        assert r is not None and (r.available is None or r.available >= 0) and len(r.holds) <= 3
    assert NodeReport.from_hello("tcp://x:1", {"ok": True}) is None


def test_block_costs_are_the_bytes_the_headers_give(models):
    """Per block, its tensors' bytes as the safetensors headers lay them out (float32 files, float32 compute)."""
    from diffuse.plan.analysis import ModelSubject
    from diffuse.plan.needs import _header, block_costs
    from diffuse.plan.planner import analyze

    path = models("flux")  # two stacks
    subject, draft = analyze(path)
    costs = block_costs(ModelSubject.from_path(path), draft["stacks"], "float32")
    assert [(c.stack, c.index) for c in costs] == [(s.path, i) for s in draft["stacks"] for i in range(s.length)]
    folder = os.path.join(path, "transformer")
    spans = {}
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            for key, h in _header(os.path.join(folder, name)).items():
                if key != "__metadata__":
                    spans[key] = h["data_offsets"][1] - h["data_offsets"][0]
    for c in costs:
        assert c.weight_bytes == sum(v for k, v in spans.items() if k.startswith(f"{c.stack}.{c.index}.")) > 0
    halves = block_costs(ModelSubject.from_path(path), draft["stacks"], "bfloat16")
    assert [h.weight_bytes * 2 for h in halves] == [c.weight_bytes for c in costs]


def test_diffuse_plan_places_a_model_on_nodes_described_by_hand(models, tmp_path):
    """Two stacks, one node with a tenth of the others' speed: with patches in flight it gets the fewest blocks,
    with passes one at a time none (it would slow every pass); too little memory is refused in one line with
    the shortfall; the JSON route is the placement's."""
    from diffuse.plan.contracts import SlicingPlan

    model = models("flux")  # 3 double blocks, then 3 single ones
    shown = run_cli(["plan", model, "--memory", "1,1,1", "--speed", "1,1,10", "--patches", "4"], str(tmp_path))
    assert shown.returncode == 0, shown.stderr
    rows = [line for line in shown.stdout.splitlines() if line.startswith("node")][1:]
    assert len(rows) == 3 and "single_transformer_blocks[2:3]" in rows[2] and "transformer_blocks[0:" in rows[0]
    assert "4 passes in flight" in shown.stdout
    one = run_cli(["plan", model, "--memory", "1,1,1", "--speed", "1,1,10"], str(tmp_path))
    assert one.returncode == 0, one.stderr
    assert "node3 holds nothing: it would make a pass slower" in " ".join(one.stdout.split())
    as_json = run_cli(["plan", model, "--memory", "1,1,1", "--speed", "1,1,10", "--patches", "4", "--json"],
                      str(tmp_path))
    plan = SlicingPlan.from_json(as_json.stdout)
    assert [str(s) for s in plan.route[2].slices] == ["transformer_blocks[3:3]", "single_transformer_blocks[2:3]"]
    refused = run_cli(["plan", model, "--memory", "0.05,0.05"], str(tmp_path))
    assert refused.returncode != 0 and "GiB short" in " ".join(refused.stderr.split())


# ------------------------------------------------------------------------------------ through real nodes

PROMPT = "Tell me a story about the moon."


@pytest.fixture(scope="module")
def lm_model(tmp_path_factory) -> str:
    import lm_models

    return lm_models.build("qwen2", str(tmp_path_factory.mktemp("placement") / "qwen2"))


def _start(model: str, extra=()) -> tuple:
    proc = node_process(["--model", model, "--ephemeral-key", "--threads", str(THREADS), "--log-level", "WARNING",
                         *extra])
    ready = json.loads(proc.stdout.readline())
    return proc, f"{ready['address']}#{ready['key']}"


def test_planned_slices_leave_out_a_node_without_room_and_generate_the_tokens_of_transformers(
        lm_model, tmp_path, diffuse_home):
    # the middle node offers less room than the margin alone: it can take no layer
    nodes = [_start(lm_model), _start(lm_model, ["--max-memory", f"{MARGIN_MIN_BYTES / GIB / 2:.4f}"]),
             _start(lm_model)]
    addresses = ",".join(a for _, a in nodes)
    try:
        shown = run_cli(["plan", lm_model, "--nodes", addresses], diffuse_home)
        assert shown.returncode == 0, shown.stderr
        rows = {}
        for line in shown.stdout.splitlines():  # the table's rows come before the notes
            if line.startswith("tcp://"):
                rows.setdefault(line.split()[0], line)
        names = [a.split("#")[0] for _, a in nodes]
        import re

        runs = [re.search(r"model\.layers\[(\d+):(\d+)\]|none", rows[n]) for n in names]
        assert runs[1].group(0) == "none"  # left out; the other two hold the four layers between them
        (a0, b0), (a2, b2) = [(int(m.group(1)), int(m.group(2))) for m in (runs[0], runs[2])]
        assert a0 == 0 and b0 == a2 and b2 == 4 and b0 > a0 and b2 > a2
        assert f"{names[1]} holds nothing: it has room for no block" in shown.stdout
        assert re.search(rf"client -> {names[0]}: \d+\.\d\d ms round trip, ", shown.stdout), shown.stdout

        from conftest import hello_report

        tokens, report = tmp_path / "tokens.json", tmp_path / "report.json"
        argv = ["--model", lm_model, "--prompt", PROMPT, "--max-new-tokens", "6", "--threads", str(THREADS),
                "--nodes", addresses, "--save-tokens", str(tokens), "--report", str(report), "--quiet",
                "--timeout", "120"]
        refused = run_client(argv + ["--placement", "even"], diffuse_home)
        assert refused.returncode != 0
        assert f"even slices do not fit these nodes: {names[1]} would take" in " ".join(refused.stderr.split())
        assert run_cli(["plan", lm_model, "--nodes", addresses], diffuse_home).returncode == 0
        assert not any(hello_report(n).holds for n in names)  # refused before any node loaded a layer
        for session in range(2):  # the second session is planned from the speeds the first one measured
            run = run_client(argv, diffuse_home)
            assert run.returncode == 0, run.stderr[-3000:]
            with open(tokens) as f, open(report) as g:
                got, rep = json.load(f), json.load(g)
            used = [n["address"] for n in rep["node_stats"]]
            # the first session, nothing measured: both nodes with room; the second, measured: both, or one
            # where a pass over this tiny model costs less than what the other node's pass and hop would add
            assert used == [names[0], names[2]] if session == 0 else used in (
                [names[0], names[2]], [names[0]], [names[2]]), used
            # every hop's link measured: the client's at hello, the node-to-node one by the first node at open
            ends = ["client", *used, "client"]
            assert [line.rsplit(": ", 1)[0] for line in rep["links"]] == [f"{a} -> {b}" for a, b in zip(ends, ends[1:])]
            assert not any("not measured" in line for line in rep["links"]), rep["links"]
            with open(os.path.join(lm_model, "config.json")) as f:
                layers = json.load(f)["num_hidden_layers"]
            assert all(n["cache_bytes"] > 0 for n in rep["node_stats"]) and layers == 4
            seen = [hello_report(n) for n in names]
            assert seen[1].available < MARGIN_MIN_BYTES and not seen[1].holds and not seen[1].speed
            assert seen[0].device == "cpu" and seen[0].dtype == "float32" and seen[0].threads == THREADS
        # both nodes that ran layers measured their speed, kept for this model
        assert all(seen[k].speed["float32"]["passes"] > 0 for k in (0, 2))
    finally:
        for proc, _ in nodes:
            proc.terminate()
        for proc, _ in nodes:
            proc.wait(10)
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    with open(ref_dir / "jobs.json", "w") as f:
        json.dump([dict(model=lm_model, prompt=PROMPT, max_new_tokens=6, images=[], do_sample=False,
                        generate_args={})], f)
    cmd = [sys.executable, os.path.join(TESTS, "lm_reference.py"), "--jobs", str(ref_dir / "jobs.json"),
           "--threads", str(THREADS), "--out", str(ref_dir / "results.json")]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(ref_dir / "results.json") as f:
        ref = json.load(f)[0]
    assert got["input_ids"] == ref["input_ids"] and got["new_tokens"] == ref["new_tokens"]
    assert rep["top"] == ref["top"]


# ------------------------------------------------------------------------------------ unequal machines, for real

HEADROOM = 80 << 20  # what the memory-limited node may still take: the margin and one block, not two


def _wan_model(out_dir: str) -> str:
    """A Wan pipeline whose 6 blocks weigh about 10 MiB each (float32)."""
    from diffusers import WanPipeline, WanTransformer3DModel
    import torch

    from diffuse.train.build import CALL_DEFAULTS, build_scheduler, build_text_encoder, build_tokenizer, build_vae

    tok = build_tokenizer()
    te = build_text_encoder("tiny", len(tok), 0)
    vae = build_vae("tiny", 1)
    torch.manual_seed(2)
    tr = WanTransformer3DModel(patch_size=(1, 2, 2), in_channels=vae.config.z_dim, out_channels=vae.config.z_dim,
                               text_dim=te.config.d_model, freq_dim=128, cross_attn_norm=True,
                               qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=32, num_attention_heads=4,
                               attention_head_dim=64, ffn_dim=4096, num_layers=6)
    WanPipeline(tokenizer=tok, text_encoder=te, vae=vae, transformer=tr, scheduler=build_scheduler()).save_pretrained(
        out_dir, safe_serialization=True)
    with open(os.path.join(out_dir, "diffuse_defaults.json"), "w") as f:
        json.dump(CALL_DEFAULTS, f)
    return out_dir


def test_unequal_nodes_under_cgroup_limits_get_slices_that_fit_and_the_bytes_of_a_whole_run(tmp_path, diffuse_home):
    """Three nodes: one at a full core, two at a third of one, and one of those two with a memory limit below an
    even share of the blocks. Even slices are refused before anything loads; planned slices fit (no node is
    killed) and the video is the one plain diffusers makes whole, bit for bit, at one patch."""
    import numpy as np

    import families
    from conftest import run_reference
    from conftest import hello_report

    from diffuse.local.cgroups import Cgroups, memory_used

    groups = Cgroups(f"diffuse-test-{os.getpid()}")
    if groups.why:
        pytest.skip(f"cgroup limits cannot be set here: {groups.why}")
    model = _wan_model(str(tmp_path / "wan6"))
    kwargs = dict(families.call_args("wan"), num_inference_steps=2)
    procs, ready = [], []
    try:
        specs = [("fast", 1.0), ("slow", 1 / 3), ("small", 1 / 3)]
        for name, cpus in specs:  # forked from the launcher, then moved into their groups with what they hold
            procs.append(node_process(["--model", model, "--ephemeral-key", "--threads", str(THREADS),
                                       "--log-level", "WARNING"], stderr=open(tmp_path / f"{name}.log", "w")))
            line = procs[-1].stdout.readline()
            assert line, (tmp_path / f"{name}.log").read_text()[-3000:]
            ready.append(json.loads(line))
            groups.enter(groups.make(name, cpus), procs[-1].pid)
        small_memory = groups.made[-1]
        limit = memory_used(small_memory) + HEADROOM
        groups.limit_memory(small_memory, limit)
        addresses = ",".join(f"{r['address']}#{r['key']}" for r in ready)
        names = [r["address"] for r in ready]

        import diffuse

        pipe = diffuse.from_pretrained(model)
        with pytest.raises(DoesNotFit, match=rf"even slices do not fit these nodes: {names[2]} would take"):
            with diffuse.split(pipe, nodes=addresses, placement="even"):
                pass
        reports = [hello_report(n) for n in names]
        assert [r.cpus for r in reports] == [1.0, 0.333, 0.333]
        assert reports[2].limit == limit and reports[2].source == "cgroup v1"

        save = tmp_path / "split.npy"
        argv = ["--model", model, "--seed", "0", "--threads", str(THREADS), "--nodes", addresses,
                "--save-array", str(save), "--quiet", "--timeout", "300"]
        for k, v in kwargs.items():
            argv += ["--arg", f"{k}={json.dumps(v)}"]
        run = run_client(argv, diffuse_home)
        assert run.returncode == 0, run.stderr[-3000:]
        shown = run_cli(["plan", model, "--nodes", addresses], diffuse_home)  # fresh hellos: what each holds now
        assert shown.returncode == 0, shown.stderr
        reports = [hello_report(n) for n in names]
        assert [len(r.holds) for r in reports][2] == 1  # the small node: one block, less than an even share
        assert sum(len(r.holds) for r in reports) == 6 and all(r.speed for r in reports)  # each measured itself
        assert all(p.poll() is None for p in procs)  # nobody was killed
        with open(os.path.join(small_memory, "memory.oom_control")) as f:
            assert "oom_kill 0" in f.read()
        split = np.load(save)
        whole = run_reference(model, kwargs, str(tmp_path / "whole.npy"))
        assert split.dtype == whole.dtype and split.shape == whole.shape
        assert split.tobytes() == whole.tobytes()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
        groups.close()
