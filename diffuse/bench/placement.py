"""``python -m diffuse.bench placement``: even slices against planned ones on three unequal nodes, in one run.

Three local nodes, started without ``--blocks`` (each session's plan gives them their slices), are put
under cgroup v1 groups this bench makes (``diffuse.local.cgroups``): two at a third of a core and one at a full
core, listed in that order (so that the language model's output head, which goes with the last layer, is on
the quick node either way), every process at one torch thread. The CFS period of the nodes at a third of a
core is ``PERIOD_US``, not the kernel's 100 ms: with that, a node that idles while the others compute
spends the quota it saved on its next pass, and runs it at the speed of a whole core (nodes at a third of a
core then measure as quick as the full one). The node at a whole core keeps the kernel's period (its quota
is the same in any period, and a short one would throttle the moments its threads overlap). Their
``cpu.shares`` (``SHARES``, and the client's own group's, of one core) keep other work on a busy machine
from deciding their speed: at the kernel's 1024 the full-core node measured little quicker than the
others on a loaded machine. Where the groups cannot be made (not root, no cgroup v1), the bench says
so and runs the nodes unlimited.

Two models, each run in ``--pairs`` pairs (default ``PAIRS``) on the same three nodes: even slices (runs that
also have every node measure its own speed), then the slices planned from what the nodes say at hello (their
speeds, all their passes so far, and the links the client measured):

- the diffusion bench model (``diffuse.bench.diffusion``'s Wan transformer, here with ``WAN["layers"]`` blocks),
  driven with fixed inputs for its guided steps, two calls a step, the first two steps not timed: s/step;
- the language-model bench model (``diffuse.bench.lm``'s Qwen2, here with ``LM["layers"]`` layers),
  greedy: tokens/s after the first token.

Beside each measured figure, the prediction for the route that ran: the planner's (``diffuse.plan.placement``:
each node's share at the speed it said after the pair's even run, plus each hop over the links measured), plus
the client's own CPU time in the same run (the planner does not count the client's work), and the ratio. Under
each run, what its timed part saw (``Watch``): the load average, the cores the machine's other work kept busy
and the host stole (``/proc/stat``), and per node its busy time a pass against the planner's share, its blocks'
wall time against their CPU time (above 1: it waited for a core, or for its group's quota) and their page faults,
its process's CPU time, and how often its group was throttled (``cpu.stat``). Then, per model, planned / even (the median of the
pairs), whether every pair made the same output (the diffusion output bit for bit, the tokens), and each
planned run's measured / predicted, marked where the host stole cores (``STEAL_SAID``) or the full-core node
waited for one (``WAITED``) or was throttled. ``--quick``: tiny models, one pair, for a smoke test.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

PERIOD_US = 3_000  # CFS period of the nodes' groups (a third of a core: 1 ms in every 3)
STEAL_SAID = 0.05  # cores stolen by the host in a run's timed part, from which the summary says so
WAITED = 1.10  # a full-core node's blocks this many times their CPU time: said in the summary (it waited for a core)
PAIRS = 3  # pairs of runs (even, then planned) per model: the median ratio, and every prediction beside its run
SHARES = 8192  # cpu.shares of the bench's groups (the kernel's default is 1024)
NODES = (("slow1", 1 / 3), ("slow2", 1 / 3), ("quick", 1.0))
WAN = dict(heads=8, head_dim=64, ffn=2048, layers=12, text_dim=64, text_len=32, frames=3, size=16, steps=5)
WAN_QUICK = dict(heads=2, head_dim=16, ffn=64, layers=3, text_dim=32, text_len=8, frames=1, size=8, steps=3)
LM = dict(layers=12, hidden=768, heads=12, kv_heads=4, ffn=2048, vocab=4096, prompt=32, new=24)
LM_QUICK = dict(layers=3, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, prompt=8, new=4)


class CgroupLimits:
    """The bench's cgroups: one per node, one for this process; ``why`` says why there are none."""

    def __init__(self, period_us: int = PERIOD_US, shares: int | None = SHARES):
        from diffuse.local.cgroups import DEFAULT_PERIOD_US, Cgroups

        self.groups = Cgroups(f"diffuse-bench-{os.getpid()}-{os.urandom(3).hex()}")
        self.why = self.groups.why
        self.count, self.period_us, self.shares = 0, period_us, shares
        self.cpu_groups: dict[str, str] = {}  # node name -> its cpu group folder (of the nodes started last)
        if not self.why:
            self.groups.enter(self.groups.make("client", 1.0, DEFAULT_PERIOD_US, shares), os.getpid())

    def nodes(self, nodes, limits=NODES) -> None:
        """Each of ``nodes`` into a group of its own: ``limits`` gives each its name and cores."""
        from diffuse.local.cgroups import DEFAULT_PERIOD_US

        if self.why:
            return
        self.count += 1
        for node, (name, cpus) in zip(nodes, limits):
            period = self.period_us if cpus < 1 else DEFAULT_PERIOD_US  # a whole core's quota: the same in any
            folders = self.groups.make(f"{name}-{self.count}", cpus, period, self.shares)  # period, and a short
            self.groups.enter(folders, node.proc.pid)  # one would throttle its threads' short overlaps
            self.cpu_groups[name] = folders[0]

    def throttling(self) -> dict[str, dict[str, int]]:
        """Each node group's ``cpu.stat`` now (periods, periods throttled, nanoseconds throttled)."""
        return {name: self.groups.cpu_stat(f) for name, f in self.cpu_groups.items()}

    def close(self) -> None:
        if not self.why:
            self.groups.leave(os.getpid())
            self.groups.close()


def _start(path: str, limits: CgroupLimits):
    from diffuse.local.nodes import start_local_nodes

    nodes = start_local_nodes(path, len(NODES), threads=1, extra=["--log-level", "WARNING"], fixed=False)
    limits.nodes(nodes)
    return nodes


def _speeds_now(plan, heard) -> list:
    """The planner's view (``Capacity``) of the nodes of ``plan``'s route, from a fresh hello to each (as
    ``diffuse plan --nodes`` asks them), kept in ``heard``."""
    from diffuse.cli.plan import ask_nodes

    return ask_nodes(plan, heard)


def _prediction(heard, caps: list, plan, path: str, route, tokens: int, nbytes: int):
    """The planner's ``Placement`` of ``route`` (some of ``plan``'s route), costed with ``caps`` and the links
    measured, for passes of ``tokens`` tokens handing on ``nbytes``."""
    from diffuse.plan.analysis import ModelSubject
    from diffuse.client.routing import link_hops
    from diffuse.plan.needs import block_costs
    from diffuse.plan.solver import placement_of

    blocks = block_costs(ModelSubject.from_path(path), plan.stacks, plan.compute_dtype)
    order = {s.address: i for i, s in enumerate(plan.route)}
    rows = [()] * len(plan.route)
    for stage in route:
        rows[order[stage.address]] = stage.slices
    hops = link_hops(heard, [s.address for s in plan.route], nbytes, [c.hop_s for c in caps])
    return placement_of(blocks, caps, rows, tokens, hops)


def _slices(route) -> str:
    return " ".join("+".join(f"[{s.start}:{s.stop}]" for s in st.slices if not s.empty) for st in route)


def _process_cpu(pid: int) -> float:
    """CPU seconds process ``pid`` has used so far, all its threads (0 where it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_cpu() -> tuple[float, float]:
    """CPU seconds the machine's cores have been busy (user, nice, system, interrupts) and stolen by its host so
    far (``/proc/stat``)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    tick = os.sysconf("SC_CLK_TCK")
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / tick, v[7] / tick


class Watch:
    """The timed part of one run, read at its start and end: the load, the last pass sent before it, each node's
    process CPU seconds and its group's ``cpu.stat``, the client's own CPU seconds."""

    def __init__(self, limits: CgroupLimits, nodes):
        self.limits, self.nodes, self.at, self.seq = limits, nodes, [], 0

    def take(self, split=None) -> None:
        if split is not None:
            self.seq = max((m["seq"] for m in split.ring.channel_stats.messages), default=0)
        self.at.append(dict(load=os.getloadavg()[0], client=time.process_time(), stat=self.limits.throttling(),
                            cpu=[_process_cpu(n.proc.pid) for n in self.nodes], machine=_machine_cpu(),
                            wall=time.perf_counter()))

    def others(self) -> tuple[float, float]:
        """Cores the machine's other work kept busy in the timed part (its busy CPU seconds less this process's and
        the nodes', over the wall time), and cores its host stole."""
        a, b = self.at[0], self.at[-1]
        wall = max(1e-9, b["wall"] - a["wall"])
        ours = b["client"] - a["client"] + sum(b["cpu"]) - sum(a["cpu"])
        return (max(0.0, b["machine"][0] - a["machine"][0] - ours) / wall, (b["machine"][1] - a["machine"][1]) / wall)

    def rows(self, split, p, passes: int) -> list[dict]:
        """Per node (in ``NODES`` order) what the timed part measured against ``p``'s prediction: its slice, the
        passes it ran, their mean busy, block wall and block CPU seconds, its process's CPU seconds a pass, and
        its group's throttling."""
        from diffuse.node.batches import PARTS

        a, b = self.at[0], self.at[-1]
        reports = {s.address: r for s, r in zip(split.plan.route, split.node_reports)}
        slices = {s.address: _slices([s]) for s in split.plan.route}
        order = [c.name for c in p.nodes]
        out = []
        for i, (node, (name, _)) in enumerate(zip(self.nodes, NODES)):
            log = [r[1:] for r in reports.get(node.address, {}).get("parts_log", []) if r[0] > self.seq]
            n = max(1, len(log))
            col = {k: sum(r[j] for r in log) / n for j, k in enumerate(PARTS)}
            t0, t1 = a["stat"].get(name, {}), b["stat"].get(name, {})
            k = order.index(node.address) if node.address in order else None
            out.append(dict(name=name, slices=slices.get(node.address) or "none", passes=len(log),
                            busy=sum(col[x] for x in ("open", "prepare", "blocks", "finish", "seal")),
                            blocks=col["blocks"], blocks_cpu=col["blocks_cpu"], faults=col["faults"],
                            predicted=p.shares[k] if k is not None else 0.0,
                            cpu=(b["cpu"][i] - a["cpu"][i]) / max(1, passes),
                            periods=t1.get("nr_periods", 0) - t0.get("nr_periods", 0),
                            throttled=t1.get("nr_throttled", 0) - t0.get("nr_throttled", 0),
                            throttled_s=(t1.get("throttled_time", 0) - t0.get("throttled_time", 0)) / 1e9))
        return out


def _pairs(run, count: int, calls: int, passes: int, path: str, nbytes: int) -> list[dict]:
    """``count`` pairs of runs on the same nodes, each even then planned (``run(placement)``: the split, its
    ``Watch`` and what it measured), the planned one predicted from the speeds the nodes said after its even one
    (each node's speed: all its passes so far, of every run). ``calls``: passes through the ring a timed unit
    (a diffusion step, a token) makes; ``passes``: such units timed."""
    out = []
    for _ in range(count):
        pair = {}
        for placement in ("even", "planned"):
            split, watch, m = run(placement)
            if placement == "even":
                plan = split.plan
                caps = _speeds_now(plan, split.repair.heard)  # as the even run left them: the planned run's plan
            p = _prediction(split.repair.heard, caps, plan, path, split.plan.route, 1, nbytes)  # per pass, as routed
            pair[placement] = dict(m, nodes=calls * p.pass_s, route=_slices(split.plan.route), caps=caps,
                                   client=(watch.at[1]["client"] - watch.at[0]["client"]) / passes,
                                   rows=watch.rows(split, p, calls * passes), others=watch.others(),
                                   load=(watch.at[0]["load"], watch.at[1]["load"]))
        out.append(pair)
    return out


def diffusion(tmp: str, cfg: dict, limits: CgroupLimits, count: int = 1) -> list[dict]:
    """Pairs of runs, even then planned, on the diffusion bench model: seconds per step, measured and predicted."""
    import torch

    import diffuse
    from diffuse.bench import diffusion

    path = os.path.join(tmp, "wan")
    diffusion.build_model(path, cfg)
    tokens = cfg["frames"] * (cfg["size"] // 2) ** 2
    x = diffusion.inputs(cfg)
    nodes = _start(path, limits)
    spec = [f"{n.address}#{n.key}" for n in nodes]

    def run(placement: str):
        transformer = diffusion.load_transformer(path)
        watch, held = Watch(limits, nodes), []

        def mark(step: int) -> None:
            if step == diffusion.TIMED_FROM:
                watch.take(held[0])

        with diffuse.split(transformer, nodes=spec, placement=placement, timeout=600, model=path) as split:
            held.append(split)
            times, latent = diffusion.denoise(transformer, x, cfg["steps"], mark)
            watch.take()
        return split, watch, dict(s=statistics.mean(times[diffusion.TIMED_FROM:]), latent=latent)

    try:
        pairs = _pairs(run, count, 2, max(1, cfg["steps"] - diffusion.TIMED_FROM), path,
                       tokens * cfg["heads"] * cfg["head_dim"] * 4)
    finally:
        nodes.stop()
    for pair in pairs:
        pair["same"] = bool(torch.equal(pair["even"]["latent"], pair["planned"]["latent"]))
    return pairs


def language_model(tmp: str, cfg: dict, limits: CgroupLimits, count: int = 1) -> list[dict]:
    """Pairs of runs, even then planned, on the language-model bench model: seconds per token, measured and
    predicted."""
    import torch

    import diffuse
    from diffuse.bench import lm

    path = os.path.join(tmp, "lm")
    lm.build(path, cfg)
    ids = torch.randint(0, cfg["vocab"], (1, cfg["prompt"]), generator=torch.Generator().manual_seed(0))
    nodes = _start(path, limits)
    spec = [f"{n.address}#{n.key}" for n in nodes]

    def run(placement: str):
        model = diffuse.from_pretrained(path)
        watch = Watch(limits, nodes)
        with diffuse.split(model, nodes=spec, placement=placement, timeout=600, speculate="off") as split:
            lm.generate(model, ids, 2)  # warm-up: the session open, the call plans learnt
            watch.take(split)
            new, clock = lm.generate(model, ids, cfg["new"])
            watch.take()
        return split, watch, dict(s=1 / clock.per_second, tokens=new)

    try:
        pairs = _pairs(run, count, 1, cfg["new"], path, cfg["hidden"] * 4)
    finally:
        nodes.stop()
    for pair in pairs:
        pair["same"] = bool(torch.equal(pair["even"]["tokens"], pair["planned"]["tokens"]))
    return pairs


def report(name: str, unit: str, pairs: list[dict], per_second: bool = False, per: str = "per pass") -> None:
    print(f"\n{name}")
    for k, r in enumerate(pairs, 1):
        if len(pairs) > 1:
            print(f" pair {k} of {len(pairs)}")
        caps = r["even"]["caps"]
        print(f"  speeds the nodes said after the even run (s per GiB of weights {per}, all their passes so far): "
              + ", ".join(f"{nm} {c.speed:.3g}" if c.speed else f"{nm} not measured"
                          for (nm, _), c in zip(NODES, caps)))
        for placement in ("even", "planned"):
            m = r[placement]
            shown = f"{1 / m['s']:8.2f} tokens/s ({1000 * m['s']:.1f} ms a token)" if per_second else \
                f"{m['s']:8.3f} s/step"
            predicted = m["nodes"] + m["client"]
            print(f"  {placement:8s} slices {m['route']:<28s} {shown}   predicted {predicted:.3f} s "
                  f"(measured / predicted {m['s'] / predicted:.2f}; the planner's nodes and hops {m['nodes']:.3f} s, "
                  f"the client's own CPU time {m['client']:.3f} s)")
            print(f"    timed part: load average {m['load'][0]:.2f} at its start, {m['load'][1]:.2f} at its end; other "
                  f"work on the machine {m['others'][0]:.2f} cores, stolen by the host {m['others'][1]:.2f}")
            for row in m["rows"]:
                print(node_line(row, per))
    ratios = [r["even"]["s"] / r["planned"]["s"] for r in pairs]
    off = [r["planned"]["s"] / (r["planned"]["nodes"] + r["planned"]["client"]) for r in pairs]
    same = all(r["same"] for r in pairs)
    print(f"  planned / even: {statistics.median(ratios):.2f}x   goal >= 1.5x   ({unit} equal on both: {same})"
          + (f"   median of {len(pairs)} pairs: " + ", ".join(f"{x:.2f}x" for x in ratios) if len(pairs) > 1 else ""))
    print("  planned, measured / predicted: " + ", ".join(f"{x:.2f}" + _disturbed(r["planned"]) for x, r in zip(off, pairs))
          + f"   goal within 20%: {sum(abs(x - 1) <= 0.2 for x in off)} of {len(off)}")


def _disturbed(m: dict) -> str:
    """What, in a run's timed part, took cores from the nodes that the planner cannot foresee: the host's steal,
    a node's group throttled beyond what its quota is for (a whole core's), a node's blocks waiting for a core."""
    said = [f"the host stole {m['others'][1]:.2f} cores"] if m["others"][1] >= STEAL_SAID else []
    for row in m["rows"]:
        cpus = dict(NODES)[row["name"]]
        if cpus >= 1 and row["throttled"]:
            said.append(f"{row['name']} throttled {row['throttled']} times")
        if cpus >= 1 and row["passes"] and row["blocks"] > WAITED * row["blocks_cpu"]:
            said.append(f"{row['name']}'s blocks {row['blocks'] / row['blocks_cpu']:.2f}x their CPU time")
    return f" ({'; '.join(said)})" if said else ""


def node_line(row: dict, per: str) -> str:
    """One node's timed part of a run: its busy time a pass against the planner's share, its blocks' wall time
    against their CPU time (above 1: the thread waited for a core, or for its group's quota) and the page faults
    they took, its process's CPU time, and the throttling its group's ``cpu.stat`` counted."""
    if not row["passes"]:
        return f"    {row['name']:<6} no block ({row['slices']})"
    busy = row["busy"]
    return (f"    {row['name']:<6} {row['slices']:<10} {row['passes']:3d} passes: busy {1000 * busy:7.1f} ms {per} "
            f"(predicted {1000 * row['predicted']:.1f}, measured / predicted {busy / max(row['predicted'], 1e-9):.2f}); "
            f"blocks {1000 * row['blocks']:.1f} ms wall / {1000 * row['blocks_cpu']:.1f} ms CPU "
            f"({row['blocks'] / max(row['blocks_cpu'], 1e-9):.2f}), {row['faults']:.0f} page faults; "
            f"process CPU {1000 * row['cpu']:.1f} ms; "
            f"throttled in {row['throttled']} of {row['periods']} periods, {1000 * row['throttled_s']:.0f} ms")


def main(argv: list[str] | None = None) -> int:
    from diffuse.flags import Parser
    from diffuse.text import plain

    ap = Parser(prog="diffuse bench placement", description=plain(__doc__.split("\n")[0]))
    ap.add_argument("--quick", action="store_true", help="tiny models, for a smoke test")
    ap.add_argument("--period-us", type=int, default=PERIOD_US, help=f"CFS period of the groups, in microseconds "
                    f"(default {PERIOD_US}; the kernel's own is 100000)")
    ap.add_argument("--pairs", type=int, default=None, help=f"pairs of runs (even, then planned) on each model, on "
                    f"the same nodes (default {PAIRS}; 1 with --quick)")
    ap.add_argument("--shares", type=int, default=SHARES, help=f"cpu.shares of the groups (default {SHARES}; the "
                    "kernel's own is 1024)")
    a = ap.parse_args(argv)
    if not 1000 <= a.period_us <= 1_000_000 or a.shares < 2:
        ap.error("--period-us must be 1000 to 1000000, --shares at least 2")
    pairs = a.pairs or (1 if a.quick else PAIRS)
    if not 1 <= pairs <= 20:
        ap.error("--pairs must be 1 to 20")

    import torch

    torch.set_num_threads(1)
    limits = CgroupLimits(a.period_us, a.shares)
    tmp = tempfile.mkdtemp(prefix="diffuse-bench-placement-")
    try:
        wan, lm = (WAN_QUICK, LM_QUICK) if a.quick else (WAN, LM)
        print(f"machine: {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.2f}; torch "
              f"{torch.__version__}; every process at 1 torch thread", flush=True)
        if limits.why:
            print(f"cgroup limits cannot be set here ({limits.why}): the nodes run unlimited, and alike", flush=True)
        else:
            print("nodes, in route order: " + ", ".join(f"{n} at {c:.2g} core" for n, c in NODES)
                  + f" (cgroup v1 CFS quota, period {a.period_us / 1000:g} ms for a fraction of a core, 100 ms for "
                  f"a whole one; cpu.shares {a.shares}, the client's own group, of a core, too)", flush=True)
        print(f"diffusion: WanTransformer3DModel, {wan['layers']} blocks, hidden {wan['heads'] * wan['head_dim']}, "
              f"FFN {wan['ffn']}, {wan['frames'] * (wan['size'] // 2) ** 2} tokens, {wan['steps']} guided steps "
              "(the first 2 not timed)", flush=True)
        print(f"language model: Qwen2ForCausalLM, {lm['layers']} layers, hidden {lm['hidden']}, FFN {lm['ffn']}, "
              f"vocabulary {lm['vocab']}; prompt {lm['prompt']} tokens, {lm['new']} new, greedy", flush=True)
        t0 = time.perf_counter()
        d = diffusion(tmp, wan, limits, pairs)
        report("diffusion bench model (seconds a step: two transformer calls)", "output", d)
        m = language_model(tmp, lm, limits, pairs)
        report("language-model bench model (decoding, after the first token)", "tokens", m, per_second=True,
               per="per token decoded")
        print(f"\nload average after: {os.getloadavg()[0]:.2f}; {time.perf_counter() - t0:.0f} s in all")
    finally:
        limits.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0
