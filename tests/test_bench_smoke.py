"""The benchmark command runs end to end on a small model and prints its ratios (the command's own code, run in
this process: a fresh interpreter would only add its start-up)."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import run_cli, subprocess_env


def test_bench_quick_prints_overhead_speedups_wire_and_attention_paths(diffuse_home):
    proc = run_cli(["bench", "--quick"], diffuse_home)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(r"overhead \(split P=1 / whole\): \d+\.\d+ \+- \d+\.\d+ +goal <= 1\.05 +\(load \d", out), out
    assert re.search(r"node busy, all nodes, P=1 vs the same blocks whole: \d+\.\d+ s vs \d+\.\d+", out), out
    for name in ("P=1", "P=4", "P=8", "2 groups"):  # where each call's time went, client and every node
        assert re.search(rf"breakdown {name}, per call .*hashing \d+\.\d+, sealing \d+\.\d+.*waiting", out), out
        assert re.search(rf"CPU {name}: client \d+\.\d+ s \+ nodes \d+\.\d+ s per step", out), out
    assert len(re.findall(r"    node \d: [1-9]\d* passes; per pass: idle .* blocks \d+\.\d+ \(CPU", out)) >= 2 * 5
    assert "P=1 output equals whole: True" in out
    for name, ideal in (("P=2", "1.33"), ("P=4 one by one", "1.60"), ("P=4", "1.78")):
        assert re.search(rf"speedup {name}: \d+\.\d+x \+- \d+\.\d+ +ideal {ideal}x \(.*\) +\d+% of ideal", out), out
    assert re.search(r"speedup P=4: .* calls sent ahead and used: [1-9]", out), out
    assert "P=4 output with calls sent ahead equals P=4 one by one: True" in out
    assert len(re.findall(r"wire P=\d: \d+\.\d+ MiB per step over 3 hops \(the whole latent on every hop of both calls", out)) == 3
    assert re.search(r"branches side by side on 2 groups of 1 node: \d+\.\d+x .*calls answered by a pass sent "
                     r"ahead: [1-9]\d*; output equals whole: True\)", out), out
    assert "attention P=4: blocks quick" in out
    assert re.search(r"quick \d+\.\d+ ms, plain \d+\.\d+ ms", out), out


def test_bench_lm_quick_prints_rates_first_token_and_bytes_per_hop(diffuse_home):
    proc = run_cli(["bench", "lm", "--quick"], diffuse_home)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for name in ("whole", "split, 1 node", "split, 2 nodes", "bare ring, 1 process", "bare ring, 2 processes"):
        assert re.search(rf"{name} +\d+\.\d tokens/s \(\d\.\d\d of whole\) \+- \d\.\d\d +first token +\d+\.\d ms +"
                         r"tokens equal whole: True", out), out
        if name.startswith("split"):  # where a token's time went: the client's loop, the pass, each node
            assert re.search(rf"breakdown {name}, per token \(ms\): .*sealing \d+\.\d+.*waiting", out), out
    assert len(re.findall(r"    node \d per pass \(ms\): idle .* layers \d+\.\d+", out)) == 3
    for n, bare in ((1, "1 process"), (2, "2 processes")):  # each split against a ring with nothing of Diffuse
        assert re.search(rf"split, {n} nodes? / bare ring, {bare}: \d\.\d\d \+- \d\.\d\d", out), out
    assert re.search(r"bare ring, 2 processes: client \d+\.\d+ \+ workers \d+\.\d+ ms", out), out
    assert re.search(r"split, 2 nodes: bytes per decoding step on each hop \(sealed\): client->1 \d+ B, "
                     r"1->2 \d+ B, 2->client \d+ B", out), out


def test_bench_lm_link_ms_prints_each_way_of_drafting_against_off(diffuse_home):
    proc = run_cli(["bench", "lm", "--link-ms", "5", "--quick"], diffuse_home)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    number = r"\d+\.\d +\+- +\d+\.\d +\d+\.\d\d\+-\d\.\d\d"
    for task in ("repetitive", "free"):
        for way in ("off", "lookup", "assistant", "whole", "split, off", "split, lookup"):
            assert re.search(rf"  {task} +{way} +{number} +(\d\.\d\d|-) +(\d+%|-) +True", out), (task, way, out)
    # on the repetitive task prompt lookup drafts, and its drafts are taken
    assert re.search(r"  repetitive +lookup +[\d.]+ +\+- +[\d.]+ +[\d.]+\+-[\d.]+ +0\.\d\d +[1-9]\d*%", out), out


def test_bench_placement_links_and_memory_quick_print_their_figures(diffuse_home):
    """The three benches of placement, at their tiniest, in one process: even against planned slices with the
    planner's prediction beside each figure, a slowed client link against its floor, and peak memory per
    process against what each holds."""
    code = ("import sys; from diffuse.bench.command import main; "
            "sys.exit(max(main([name, '--quick']) for name in ('placement', 'links', 'memory')))")
    proc = subprocess.run([sys.executable, "-c", code], env=subprocess_env(diffuse_home), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for placement in ("even", "planned"):
        assert len(re.findall(rf"  {placement} +slices (\[\d+:\d+\] ?)+ +\d+\.\d+ .* predicted \d+\.\d+ s "
                              r"\(measured / predicted \d+\.\d\d; the planner's nodes and hops \d+\.\d+ s, the "
                              r"client's own CPU time \d+\.\d+ s\)", out)) == 2, out
    assert re.search(r"planned / even: \d+\.\d\dx +goal >= 1\.5x +\(output equal on both: True\)", out), out
    assert re.search(r"planned / even: \d+\.\d\dx +goal >= 1\.5x +\(tokens equal on both: True\)", out), out
    for name in ("no delay", "5 ms, 100 Mbit/s"):
        assert re.search(rf"  {name} +\d+\.\d\d +\d+\.\d\d +\d\.\d\d +\d+\.\d ms +\d+\.\d ms +\d\.\d\d", out), out
    assert "tokens equal in every run: True" in out
    for who in ("client", "node 1", "node 2"):
        assert re.search(rf"  {who}: +\d+\.\d\d GiB +holds \d+\.\d\d GiB .*goal <= \d+\.\d\d GiB: (met|not met)",
                         out), out
    assert "tokens split equal tokens whole: True" in out


def test_bench_fetch_prints_each_machines_bytes_against_the_whole_model(diffuse_home):
    """One round: every machine's row for both checkpoints; a node of 4 fetches about half of what a node of 2
    does (the same configs and headers, half the blocks), and every node less than the client."""
    code = "import sys; from diffuse.bench.command import main; sys.exit(main(['fetch', '--quick']))"
    proc = subprocess.run([sys.executable, "-c", code], env=subprocess_env(diffuse_home), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(r"^(one file|4 shards) +(whole|client|node \d/\d) +([\d,]+) +(\d\.\d{3}) +\d+\.\d{3} \(",
                      proc.stdout, re.M)
    assert len(rows) == 2 * 8, proc.stdout
    for checkpoint in ("one file", "4 shards"):
        got = {who: int(b.replace(",", "")) for c, who, b, _ in rows if c == checkpoint}
        assert all(got[f"node {k}/2"] < got["client"] < got["whole"] for k in (1, 2)), got
        for k in range(1, 5):
            assert abs(2 * got[f"node {k}/4"] - got[f"node {(k + 1) // 2}/2"]) < 200_000, got
    over = re.findall(r"^(?:one file|4 shards) +node \d/\d .* ([\d,]+) +(\d+\.\d{3})$", proc.stdout, re.M)
    assert len(over) == 2 * 6 and all(float(r) <= 1.05 for _, r in over), over  # its tensors, + configs, headers


def test_bench_quant_quick_prints_each_modes_memory_speed_and_cost(diffuse_home):
    """Every part at its tiniest with one mode beside none: the unquantized ring's output is the whole model's (no
    difference at all), the quantized one's is not, and each row carries its figures."""
    proc = run_cli(["bench", "quant", "--quick", "--modes", "int4"], diffuse_home)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(r"floor \(the same on a 2-layer model\): \d+\.\d\d GiB", out), out
    memory = re.findall(r"^  (none|int4) +(\d+\.\d{3}) GiB +\d+\.\d\d GiB +\d+\.\d\d GiB +(\d+\.\d\d)x", out, re.M)
    assert [m for m, _, _ in memory] == ["none", "int4"] and memory[0][2] == "1.00", out
    diffusion = dict(re.findall(r"^  (none|int4) +\d+\.\d\d \+- \d+\.\d\d +\d+\.\d\dx +(\d+\.\d{3}) +\d+ +\d+/1 ", out,
                                re.M))
    assert float(diffusion["none"]) == 0.0 and float(diffusion["int4"]) > 0.0, out
    lm = dict(re.findall(r"^  (none|int4) +(\d\.\d{3}) +\d+\.\d{3} +\d+\.\d \+- +\d+\.\d +\d+\.\d\dx +\d+/\d+ ", out,
                         re.M))
    assert lm.get("none") == "1.000" and "int4" in lm, out
    bad = run_cli(["bench", "quant", "--modes", "int3"], diffuse_home)
    assert bad.returncode == 2 and "int3" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
