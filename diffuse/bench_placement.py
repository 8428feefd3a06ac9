"""``python -m diffuse.bench placement``: even slices against planned ones on three unequal nodes, in one run.

Three local nodes, started without ``--blocks`` (each session's plan gives them their slices), are put
under cgroup v1 groups this bench makes (``diffuse.cgroups``): two at a third of a core and one at a full
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

Two models, each run first on even slices (a run that also has every node measure its own speed), then on
the slices planned from what the nodes say at hello (their speeds and the links the client measured):

- the diffusion bench model (``diffuse.bench``'s Wan transformer, here with ``WAN["layers"]`` blocks),
  driven with fixed inputs for its guided steps, two calls a step, the first two steps not timed: s/step;
- the language-model bench model (``diffuse.bench_lm``'s Qwen2, here with ``LM["layers"]`` layers),
  greedy: tokens/s after the first token.

Beside each measured figure, the prediction for the route that ran: the planner's (``diffuse.placement``:
each node's share at the speed it measured on the even run, plus each hop over the links measured), plus
the client's own CPU time in the same run (the planner does not count the client's work), and the ratio; then planned / even, and whether the two runs made the same output (the diffusion output bit for
bit, the tokens). ``--quick``: tiny models, for a smoke test.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

PERIOD_US = 3_000  # CFS period of the nodes' groups (a third of a core: 1 ms in every 3)
SHARES = 8192  # cpu.shares of the bench's groups (the kernel's default is 1024)
NODES = (("slow1", 1 / 3), ("slow2", 1 / 3), ("quick", 1.0))
WAN = dict(heads=8, head_dim=64, ffn=2048, layers=12, text_dim=64, text_len=32, frames=3, size=16, steps=5)
WAN_QUICK = dict(heads=2, head_dim=16, ffn=64, layers=3, text_dim=32, text_len=8, frames=1, size=8, steps=3)
LM = dict(layers=12, hidden=768, heads=12, kv_heads=4, ffn=2048, vocab=4096, prompt=32, new=24)
LM_QUICK = dict(layers=3, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, prompt=8, new=4)


class Limits:
    """The bench's cgroups: one per node, one for this process; ``why`` says why there are none."""

    def __init__(self, period_us: int = PERIOD_US, shares: int | None = SHARES):
        from diffuse.cgroups import DEFAULT_PERIOD_US, Cgroups

        self.groups = Cgroups(f"diffuse-bench-{os.getpid()}-{os.urandom(3).hex()}")
        self.why = self.groups.why
        self.count, self.period_us, self.shares = 0, period_us, shares
        if not self.why:
            self.groups.enter(self.groups.make("client", 1.0, DEFAULT_PERIOD_US, shares), os.getpid())

    def nodes(self, nodes, limits=NODES) -> None:
        """Each of ``nodes`` into a group of its own: ``limits`` gives each its name and cores."""
        from diffuse.cgroups import DEFAULT_PERIOD_US

        if self.why:
            return
        self.count += 1
        for node, (name, cpus) in zip(nodes, limits):
            period = self.period_us if cpus < 1 else DEFAULT_PERIOD_US  # a whole core's quota: the same in any
            self.groups.enter(self.groups.make(f"{name}-{self.count}", cpus, period, self.shares),  # period,
                              node.proc.pid)  # and a short one would throttle its threads' short overlaps

    def close(self) -> None:
        if not self.why:
            self.groups.leave(os.getpid())
            self.groups.close()


def _start(path: str, limits: Limits):
    from diffuse.localnodes import start_local_nodes

    nodes = start_local_nodes(path, len(NODES), threads=1, extra=["--log-level", "WARNING"], fixed=False)
    limits.nodes(nodes)
    return nodes


def _speeds_now(plan) -> list:
    """The planner's view (``Capacity``) of the nodes of ``plan``'s route, from a fresh hello to each (as
    ``diffuse plan --nodes`` asks them)."""
    from diffuse.plan_command import ask_nodes

    return ask_nodes(plan)


def _prediction(caps: list, plan, path: str, route, tokens: int, nbytes: int):
    """The planner's ``Placement`` of ``route`` (some of ``plan``'s route), costed with ``caps`` and the links
    measured, for passes of ``tokens`` tokens handing on ``nbytes``."""
    from diffuse.analysis import ModelSubject
    from diffuse.placement import block_costs, link_hops, placement_of

    blocks = block_costs(ModelSubject.from_path(path), plan.stacks, plan.compute_dtype)
    order = {s.address: i for i, s in enumerate(plan.route)}
    rows = [()] * len(plan.route)
    for stage in route:
        rows[order[stage.address]] = stage.slices
    hops = link_hops([s.address for s in plan.route], nbytes, [c.hop_s for c in caps])
    return placement_of(blocks, caps, rows, tokens, hops)


def _slices(route) -> str:
    return " ".join("+".join(f"[{s.start}:{s.stop}]" for s in st.slices if not s.empty) for st in route)


def diffusion(tmp: str, cfg: dict, limits: Limits) -> dict:
    """Even, then planned, on the diffusion bench model: seconds per step, measured and predicted."""
    import torch

    import diffuse
    from diffuse import bench

    path = os.path.join(tmp, "wan")
    bench.build_model(path, cfg)
    tokens = cfg["frames"] * (cfg["size"] // 2) ** 2
    nbytes = tokens * cfg["heads"] * cfg["head_dim"] * 4
    x = bench.inputs(cfg)
    nodes = _start(path, limits)
    out = {}
    try:
        spec = [f"{n.address}#{n.key}" for n in nodes]
        for placement in ("even", "planned"):
            transformer = bench.load_transformer(path)
            cpu: list[float] = []  # this process's CPU seconds at the first timed step, and at the end

            def mark(step: int) -> None:
                if step == bench.TIMED_FROM:
                    cpu.append(time.process_time())

            with diffuse.split(transformer, nodes=spec, placement=placement, timeout=600, model=path) as split:
                times, latent = bench.denoise(transformer, x, cfg["steps"], mark)
                cpu.append(time.process_time())
                route = split.plan.route
            if placement == "even":
                plan = split.plan
                caps = _speeds_now(plan)  # as the even run left them: what the planned run is planned from
            p = _prediction(caps, plan, path, route, 1, nbytes)  # speeds per pass, as a route is planned
            client = (cpu[1] - cpu[0]) / max(1, cfg["steps"] - bench.TIMED_FROM)
            out[placement] = dict(s=statistics.mean(times[bench.TIMED_FROM:]), nodes=2 * p.pass_s, client=client,
                                  route=_slices(route), latent=latent, caps=caps)
    finally:
        nodes.stop()
    out["same"] = bool(torch.equal(out["even"]["latent"], out["planned"]["latent"]))
    return out


def language_model(tmp: str, cfg: dict, limits: Limits) -> dict:
    """Even, then planned, on the language-model bench model: seconds per token, measured and predicted."""
    import torch

    import diffuse
    from diffuse import bench_lm

    path = os.path.join(tmp, "lm")
    bench_lm.build(path, cfg)
    ids = torch.randint(0, cfg["vocab"], (1, cfg["prompt"]), generator=torch.Generator().manual_seed(0))
    nodes = _start(path, limits)
    out = {}
    try:
        spec = [f"{n.address}#{n.key}" for n in nodes]
        for placement in ("even", "planned"):
            model = diffuse.from_pretrained(path)
            with diffuse.split(model, nodes=spec, placement=placement, timeout=600) as split:
                bench_lm.generate(model, ids, 2)  # warm-up: the session open, the call plans learnt
                cpu = time.process_time()
                new, clock = bench_lm.generate(model, ids, cfg["new"])
                cpu = (time.process_time() - cpu) / cfg["new"]
                route = split.plan.route
            if placement == "even":
                plan = split.plan
                caps = _speeds_now(plan)
            p = _prediction(caps, plan, path, route, 1, cfg["hidden"] * 4)
            out[placement] = dict(s=1 / clock.per_second, nodes=p.pass_s, client=cpu, route=_slices(route),
                                  tokens=new, caps=caps)
    finally:
        nodes.stop()
    out["same"] = bool(torch.equal(out["even"]["tokens"], out["planned"]["tokens"]))
    return out


def report(name: str, unit: str, r: dict, per_second: bool = False, per: str = "per pass") -> None:
    print(f"\n{name}")
    caps = r["even"]["caps"]
    print(f"  speeds measured on the even run (s per GiB of weights {per}): "
          + ", ".join(f"{nm} {c.speed:.3g}" if c.speed else f"{nm} not measured" for (nm, _), c in zip(NODES, caps)))
    for placement in ("even", "planned"):
        m = r[placement]
        shown = f"{1 / m['s']:8.2f} tokens/s ({1000 * m['s']:.1f} ms a token)" if per_second else \
            f"{m['s']:8.3f} s/step"
        predicted = m["nodes"] + m["client"]
        print(f"  {placement:8s} slices {m['route']:<28s} {shown}   predicted {predicted:.3f} s "
              f"(measured / predicted {m['s'] / predicted:.2f}; the planner's nodes and hops {m['nodes']:.3f} s, "
              f"the client's own CPU time {m['client']:.3f} s)")
    ratio = r["even"]["s"] / r["planned"]["s"]
    print(f"  planned / even: {ratio:.2f}x   goal >= 1.5x   ({unit} equal on both: {r['same']})")


def main(argv: list[str] | None = None) -> int:
    from diffuse.cli import Parser
    from diffuse.text import plain

    ap = Parser(prog="diffuse bench placement", description=plain(__doc__.split("\n")[0]))
    ap.add_argument("--quick", action="store_true", help="tiny models, for a smoke test")
    ap.add_argument("--period-us", type=int, default=PERIOD_US, help=f"CFS period of the groups, in microseconds "
                    f"(default {PERIOD_US}; the kernel's own is 100000)")
    ap.add_argument("--shares", type=int, default=SHARES, help=f"cpu.shares of the groups (default {SHARES}; the "
                    "kernel's own is 1024)")
    a = ap.parse_args(argv)
    if not 1000 <= a.period_us <= 1_000_000 or a.shares < 2:
        ap.error("--period-us must be 1000 to 1000000, --shares at least 2")

    import torch

    torch.set_num_threads(1)
    limits = Limits(a.period_us, a.shares)
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
        d = diffusion(tmp, wan, limits)
        report("diffusion bench model (seconds a step: two transformer calls)", "output", d)
        m = language_model(tmp, lm, limits)
        report("language-model bench model (decoding, after the first token)", "tokens", m, per_second=True,
               per="per token decoded")
        print(f"\nload average after: {os.getloadavg()[0]:.2f}; {time.perf_counter() - t0:.0f} s in all")
    finally:
        limits.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0
