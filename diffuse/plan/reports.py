"""What a node says at hello of what it can hold and how fast it is (``node_report``, its ``SpeedBook``), and how the client reads it (``NodeReport``)."""

from __future__ import annotations

from diffuse.plan.needs import GIB
from dataclasses import dataclass
from dataclasses import field
import hashlib
import math
import os
import threading
import time
import weakref


UNLIMITED = 1 << 62  # a cgroup limit at or above this is no limit (v1 writes 9223372036854771712)


MAX_REPORTS = 1024  # node reports the client remembers (the most recent)


REPORT_FRESH_S = 3600.0  # an older report is not planned from (each ring's opening asks every listed node afresh;


# a repair later in a session plans from what they said then)
DEVICE, NODE_DTYPE = "cpu", "float32"  # what a node computes on and in when it is named neither (diffuse.plan.devices)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _meminfo_available() -> int | None:
    text = _read("/proc/meminfo") or ""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def cgroup_dirs(controller: str) -> list[tuple[str, str]]:
    """This process's cgroup folders for ``controller`` (``""``: the unified v2 hierarchy), innermost first, up
    to the hierarchy's mount; each with the version it belongs to ("v1", "v2")."""
    groups = {}
    for line in (_read("/proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for c in parts[1].split(",") if parts[1] else [""]:
                groups[c] = parts[2]
    mounts = []
    for line in (_read("/proc/self/mountinfo") or "").splitlines():
        left, _, right = line.partition(" - ")
        f, r = left.split(), right.split()
        if len(f) >= 5 and len(r) >= 3:
            mounts.append((f[3], f[4], r[0], r[2].split(",")))  # root, mount point, type, super options
    out = []
    for root, point, kind, opts in mounts:
        if kind == "cgroup" and controller and controller in opts and controller in groups:
            version, path = "v1", groups[controller]
        elif kind == "cgroup2" and not controller and "" in groups:
            version, path = "v2", groups[""]
        else:
            continue
        rel = os.path.relpath(path, root) if path.startswith(root) else path.lstrip("/")
        here = os.path.normpath(os.path.join(point, rel))
        if not os.path.isdir(here):
            here = point  # a container sees its own group at the mount
        while True:
            out.append((here, version))
            if os.path.normpath(here) == os.path.normpath(point) or len(here) <= len(point):
                break
            here = os.path.dirname(here)
        if out:
            return out
    return out


def stat_value(folder: str, name: str) -> int:
    for line in (_read(os.path.join(folder, "memory.stat")) or "").splitlines():
        k, _, v = line.partition(" ")
        if k == name and v.strip().isdigit():
            return int(v)
    return 0


def _cgroup_memory() -> tuple[int | None, int | None, str, str]:
    """(limit, bytes the limiting group uses less its inactive file cache, source, limiting group's folder)."""
    for controller in ("memory", ""):
        best = None
        for folder, version in cgroup_dirs(controller):
            raw = _read(os.path.join(folder, "memory.limit_in_bytes" if version == "v1" else "memory.max"))
            if raw is None or not raw.isdigit() or int(raw) >= UNLIMITED:
                continue
            if best is None or int(raw) < best[0]:
                best = (int(raw), folder, version)
        if best is not None:
            limit, folder, version = best
            used = _read(os.path.join(folder, "memory.usage_in_bytes" if version == "v1" else "memory.current"))
            inactive = stat_value(folder, "total_inactive_file" if version == "v1" else "inactive_file")
            used_b = max(0, int(used) - inactive) if used and used.isdigit() else None
            return limit, used_b, f"cgroup {version}", folder
    return None, None, "machine", ""


def memory_report() -> dict:
    """The memory this process may still take: its cgroup's limit less what the group uses (where a limit is
    set; never more than the machine has available), else the machine's available memory. ``pool`` names
    what the memory is shared with: processes on one machine under no limit of their own (or under the same
    one) share a pool, and the client plans them as sharing it."""
    machine = _meminfo_available()
    limit, used, source, folder = _cgroup_memory()
    available = machine
    if limit is not None and used is not None:
        available = max(0, limit - used) if machine is None else min(machine, max(0, limit - used))
    boot = _read("/proc/sys/kernel/random/boot_id") or ""
    pool = hashlib.blake2b(f"{boot}:{folder or 'machine'}".encode(), digest_size=8).hexdigest()
    return {"available": available, "limit": limit, "source": source, "pool": pool}


def cpu_count() -> float:
    """CPUs this process may use: its affinity, less a CFS quota where one is set (cgroup v1 or v2)."""
    try:
        cpus = float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cpus = float(os.cpu_count() or 1)
    for controller in ("cpu", ""):
        for folder, version in cgroup_dirs(controller):
            if version == "v1":
                quota, period = _read(os.path.join(folder, "cpu.cfs_quota_us")), _read(
                    os.path.join(folder, "cpu.cfs_period_us"))
            else:
                raw = (_read(os.path.join(folder, "cpu.max")) or "max").split()
                quota, period = (raw + ["100000"])[:2]
            try:
                q, p = int(quota), int(period)
            except (TypeError, ValueError):
                continue
            if q > 0 and p > 0:
                cpus = min(cpus, q / p)
    return round(cpus, 3)


def _module_bytes(module, cache=weakref.WeakKeyDictionary()) -> int:
    n = cache.get(module)
    if n is None:
        from diffuse.plan.quantize import tensor_bytes

        n = cache[module] = sum(tensor_bytes(p) for p in module.parameters())  # a quantized weight as stored
    return n


class SpeedBook:
    """What the node measured of its own speed, per model and compute dtype, while it runs: wall seconds (a
    node under a CPU quota is slow in wall time, not in CPU time), blocks times tokens, and weight bytes
    times tokens, summed over the passes it ran alone (batched passes and skipped steps are left out)."""

    def __init__(self, model_hash: str):
        self.model_hash = model_hash
        self.lock = threading.Lock()
        self.sums: dict[str, list[float]] = {}  # dtype -> [seconds, block tokens, byte tokens, passes, bytes]
        self.single: dict[str, list[float]] = {}  # dtype -> [seconds, bytes] of passes of one token (decoding)
        self.around = [0.0, 0]  # seconds a pass spent on the node besides its blocks, passes

    def add(self, p, dtype, seconds: float) -> None:
        """Count one pass ``p`` (a ``diffuse.node.stage.Prepared``) that ran its blocks in ``seconds``."""
        try:
            if getattr(p, "reuse", None) is not None or not p.blocks:
                return
            streams = p.rmap.streams
            t = p.values[streams[0]] if streams else None
            tokens = t.numel() // max(1, t.shape[-1]) if t is not None and t.dim() >= 2 else 1
            nbytes = sum(_module_bytes(b) for _, b in p.blocks)
            if dtype is None:  # the blocks' own dtype
                dtype = next(p.blocks[0][1].parameters()).dtype
        except Exception:  # a pass of a shape this does not know is simply not counted
            return
        key = str(dtype).removeprefix("torch.") if dtype is not None else NODE_DTYPE
        with self.lock:
            s = self.sums.setdefault(key, [0.0, 0.0, 0.0, 0, 0.0])
            s[0] += seconds
            s[1] += len(p.blocks) * tokens
            s[2] += nbytes * tokens
            s[3] += 1
            s[4] += nbytes
            if tokens == 1:  # a token costs more alone than within a long prompt: kept apart
                one = self.single.setdefault(key, [0.0, 0.0])
                one[0] += seconds
                one[1] += nbytes

    def overhead(self, p, seconds: float) -> None:
        """Count what pass ``p`` spent on the node besides its blocks: opened, checked, sealed and sent on."""
        if getattr(p, "reuse", None) is not None or not getattr(p, "blocks", None) or not 0 <= seconds < 60:
            return
        with self.lock:
            self.around[0] += seconds
            self.around[1] += 1

    def report(self) -> dict:
        with self.lock:
            out = {d: {"s_per_block_token": s[0] / s[1], "s_per_gib_token": s[0] / s[2] * GIB,
                       "s_per_gib_pass": s[0] / s[4] * GIB, "passes": int(s[3])}
                   for d, s in self.sums.items() if s[1] > 0 and s[2] > 0 and s[4] > 0}
            for d, (sec, nbytes) in self.single.items():
                if d in out and nbytes > 0:
                    out[d]["s_per_gib_single"] = sec / nbytes * GIB
            per_pass = self.around[0] / self.around[1] if self.around[1] else None
            return {"model": self.model_hash, "by_dtype": out, "s_per_pass": per_pass}


def _held_runs(store) -> list[list]:
    """[stack, start, stop, dtype] runs of the blocks a node's store holds now."""
    keys = sorted((k[0], k[1], str(k[2]).removeprefix("torch.")) for k in list(store.blocks))
    runs: list[list] = []
    for stack, i, dtype in keys:
        if runs and runs[-1][0] == stack and runs[-1][3] == dtype and runs[-1][2] == i:
            runs[-1][2] = i + 1
        else:
            runs.append([stack, i, i + 1, dtype])
    return runs


def device_report(node) -> tuple[str, str, dict]:
    """A node's device (``cpu``, ``cuda:0 (NVIDIA ...)``), its compute dtype (float32 where it was named none: a
    CPU node then computes in what each session asks) and the memory it may still take: on an accelerator the device's free memory
    (``torch.cuda.mem_get_info``), shared by the nodes on that device (its pool); on the CPU ``memory_report``."""
    from diffuse.plan.devices import device_name, dtype_name, memory_report as device_memory

    compute = getattr(node, "runs_on", None)
    if compute is None or compute.on_cpu:
        return DEVICE, dtype_name(getattr(compute, "dtype", None), NODE_DTYPE), memory_report()
    return device_name(compute.device), dtype_name(compute.dtype, NODE_DTYPE), device_memory(compute.device)


def node_report(node) -> dict:
    """What a node says of itself at hello (``diffuse.node.control``)."""
    import torch

    speeds = getattr(node, "speeds", None)
    device, dtype, memory = device_report(node)
    most = getattr(node, "max_memory", None)
    if most is not None:  # --max-memory: what its blocks may take in all, whatever the machine has
        held = sum(_module_bytes(b) for b in list(node.store.blocks.values()))
        room = max(0, most - held)
        if memory["available"] is None or room < memory["available"]:  # its own bound: shared with no one
            memory = dict(memory, available=room, source=f"--max-memory {most / GIB:.3g} GiB", pool="")
    return {"memory": memory, "holds": _held_runs(node.store)[:256],
            "threads": torch.get_num_threads(), "cpus": cpu_count(), "device": device, "dtype": dtype,
            "speed": speeds.report() if speeds is not None else None}


def _num(x, kind=(int, float)) -> float | None:
    return x if isinstance(x, kind) and not isinstance(x, bool) and math.isfinite(x) and x >= 0 else None


@dataclass(frozen=True)
class NodeReport:
    """One node's hello report as the client read it (what was missing or malformed is None)."""

    address: str
    available: int | None = None  # bytes it may still take
    limit: int | None = None
    source: str = "?"
    pool: str = ""
    holds: frozenset = frozenset()  # (stack, index, dtype)
    threads: int | None = None
    cpus: float | None = None
    device: str = "?"
    dtype: str = "?"
    speed: dict = field(default_factory=dict)  # dtype -> {"s_per_block_token", "s_per_gib_token",
    # "s_per_gib_single" (passes of one token), "s_per_gib_pass" (per pass), "passes"}
    model: str = ""  # the model the speeds were measured on
    rtt_s: float | None = None  # the hello's round trip, as the client measured it
    at: float = 0.0  # when it came (time.monotonic)
    pass_s: float | None = None  # seconds a pass spends on it besides its blocks (measured with the speeds)

    @classmethod
    def from_hello(cls, address: str, hello: dict, rtt_s: float | None = None) -> "NodeReport | None":
        r = hello.get("report") if isinstance(hello, dict) else None
        if not isinstance(r, dict):
            return None
        mem = r.get("memory") if isinstance(r.get("memory"), dict) else {}
        holds = set()
        for run in r.get("holds")[:256] if isinstance(r.get("holds"), list) else ():  # as many runs as a node sends
            if (isinstance(run, list) and len(run) == 4 and isinstance(run[0], str) and isinstance(run[3], str)
                    and _num(run[1], int) is not None and _num(run[2], int) is not None and run[2] - run[1] <= 4096):
                holds.update((run[0][:256], i, run[3][:32]) for i in range(run[1], run[2]))
        speed, model, per_pass = {}, "", None
        sp = r.get("speed")
        if isinstance(sp, dict) and isinstance(sp.get("by_dtype"), dict):
            model = sp.get("model") if isinstance(sp.get("model"), str) else ""
            per_pass = _num(sp.get("s_per_pass"))
            for d, v in list(sp["by_dtype"].items())[:8]:
                if isinstance(d, str) and isinstance(v, dict) and _num(v.get("s_per_gib_token")):
                    speed[d] = {k: v[k] for k in ("s_per_block_token", "s_per_gib_token", "s_per_gib_single",
                                                  "s_per_gib_pass", "passes") if _num(v.get(k))}

        def text(x, default="?"):
            return x[:64] if isinstance(x, str) else default

        return cls(address, _num(mem.get("available"), int), _num(mem.get("limit"), int), text(mem.get("source")),
                   text(mem.get("pool"), ""), frozenset(holds), _num(r.get("threads"), int), _num(r.get("cpus")),
                   text(r.get("device")), text(r.get("dtype")), speed, model[:64], rtt_s, time.monotonic(), per_pass)

    def s_per_gib_token(self, dtype: str, model: str, per: str = "token") -> float | None:
        """Its measured seconds per GiB of weights: per token (``per="token"``), per pass of one token (a
        language model's decoding, ``"single"``, where it measured those), or per pass as its passes came
        (``"pass"``: a diffusion stack's, whose tokens a route is planned without knowing)."""
        s = self.speed.get(dtype) if model and self.model == model else None
        if not s:
            return None
        key = {"single": "s_per_gib_single", "pass": "s_per_gib_pass"}.get(per, "s_per_gib_token")
        return s.get(key, s["s_per_gib_token"])
