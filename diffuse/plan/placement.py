"""Placement: which node holds which contiguous slice, from what the nodes say and what the model needs.

A node says at hello what it can hold and how fast it is (``node_report``): the memory still available
to it (its cgroup's limit less what the group uses, where a limit is set, else the machine's available
memory), the blocks it already holds, its torch threads, CPUs, device and compute dtype, and, once it has
run blocks of its model, its measured seconds per block per token (``SpeedBook``, kept per model and dtype
for as long as the node runs, so the next session is planned from it; also per pass, per decoding token,
and what a pass costs it besides its blocks).

The client reads each report (``NodeReport.from_hello``: whatever is missing or malformed counts as not
said) and what the model needs per block (``block_costs``: weight bytes in the compute dtype from the
safetensors headers, no weights read; for a language model also its key/value cache at ``context``
tokens), then ``place`` cuts the blocks of every stack, taken in the plan's order, into contiguous runs,
one per node in the listed order (a node with no room for a block gets none and stays out of the
route): every node's run fits its memory less a margin, and the slowest node's share of a pass is as
small as it can be; among placements as good as that, the one with the least total compute, then the
most even. A node not measured counts at the median speed of those measured (all alike when
none is). A model that fits no placement is refused (``DoesNotFit``) before any node loads a block,
naming the shortfall in GiB. ``route`` is the one place a route is planned from (``diffuse.client.repair``);
``even_placement`` keeps the even slices, checked against the same memory.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import threading
import time
import weakref
import dataclasses
from dataclasses import dataclass, field

from diffuse.errors import DiffuseError
from diffuse.plan.contracts import Slice, SlicingPlan, Stage, even_route

GIB = 1 << 30
MARGIN_FRACTION = 0.10  # of a node's available memory, kept free for activations and the unforeseen
MARGIN_MIN_BYTES = 64 << 20  # ... and at least this much
DEFAULT_CONTEXT = 4096  # tokens of key/value cache planned per language-model session (capped by the model's own)
PLACEMENTS = ("planned", "even")
UNLIMITED = 1 << 62  # a cgroup limit at or above this is no limit (v1 writes 9223372036854771712)
MAX_REPORTS = 1024  # node reports the client remembers (the most recent)
REPORT_FRESH_S = 3600.0  # an older report is not planned from (each ring's opening asks every listed node afresh;
# a repair later in a session plans from what they said then)
DEVICE, NODE_DTYPE = "cpu", "float32"  # what a node computes on and in when it is named neither (diffuse.plan.devices)


class DoesNotFit(DiffuseError):
    """The model fits no placement on the given nodes."""


# --------------------------------------------------------------------------- the node's side


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


def _cgroup_dirs(controller: str) -> list[tuple[str, str]]:
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


def _stat_value(folder: str, name: str) -> int:
    for line in (_read(os.path.join(folder, "memory.stat")) or "").splitlines():
        k, _, v = line.partition(" ")
        if k == name and v.strip().isdigit():
            return int(v)
    return 0


def _cgroup_memory() -> tuple[int | None, int | None, str, str]:
    """(limit, bytes the limiting group uses less its inactive file cache, source, limiting group's folder)."""
    for controller in ("memory", ""):
        best = None
        for folder, version in _cgroup_dirs(controller):
            raw = _read(os.path.join(folder, "memory.limit_in_bytes" if version == "v1" else "memory.max"))
            if raw is None or not raw.isdigit() or int(raw) >= UNLIMITED:
                continue
            if best is None or int(raw) < best[0]:
                best = (int(raw), folder, version)
        if best is not None:
            limit, folder, version = best
            used = _read(os.path.join(folder, "memory.usage_in_bytes" if version == "v1" else "memory.current"))
            inactive = _stat_value(folder, "total_inactive_file" if version == "v1" else "inactive_file")
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
        for folder, version in _cgroup_dirs(controller):
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
        n = cache[module] = sum(p.numel() * p.element_size() for p in module.parameters())
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


# --------------------------------------------------------------------------- the client's side


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


_reports: dict[str, NodeReport] = {}
_reports_lock = threading.Lock()


def note_hello(address: str, hello: dict, rtt_s: float | None = None) -> None:
    """Remember what a node's hello said of it (``diffuse.client.handshake`` calls this for every hello)."""
    report = NodeReport.from_hello(address, hello, rtt_s)
    if report is None:
        return
    with _reports_lock:
        _reports.pop(address, None)
        _reports[address] = report
        while len(_reports) > MAX_REPORTS:
            _reports.pop(next(iter(_reports)))


def report_of(address: str) -> NodeReport | None:
    """The node's latest report, if it came in the last ``REPORT_FRESH_S``."""
    with _reports_lock:
        r = _reports.get(address)
    return r if r is not None and time.monotonic() - r.at <= REPORT_FRESH_S else None


# --------------------------------------------------------------------------- what the model needs


@dataclass(frozen=True)
class BlockCost:
    stack: str
    index: int
    weight_bytes: int  # its tensors in the compute dtype (integer tensors in their own)
    state_bytes: int = 0  # per-session state it keeps on its node (a language model's key/value cache)
    end_bytes: int = 0  # what the node holding it holds besides: a language model's output head (last block)
    end_compute: int = 0  # ... and computes, in weight bytes (the head, once a token)

    @property
    def held_bytes(self) -> int:
        """Memory its node gives it beyond its weights."""
        return self.state_bytes + self.end_bytes


_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
          "I8": 1, "U8": 1, "U16": 2, "U32": 4, "U64": 8, "BOOL": 1}
_costs_cache: dict[tuple, list[BlockCost]] = {}


def _header(path: str) -> dict:
    """A safetensors file's header: tensor name -> {dtype, shape, data_offsets} (no tensor data is read)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= 100 << 20:
            raise DiffuseError(f"{path}: not a safetensors file (header of {n} bytes)")
        return json.loads(f.read(n))


def _dtype_size(dtype: str) -> int:
    import torch

    d = getattr(torch, dtype, None)
    if not isinstance(d, torch.dtype):
        raise DiffuseError(f"unknown compute dtype {dtype!r}")
    return d.itemsize


def load_dtype(subject) -> str:
    """The dtype a plain load computes in: a transformers model's config dtype (its ``from_pretrained`` loads
    ``"auto"``), float32 for a diffusers pipeline."""
    if subject.autoregressive:
        cfg = subject.denoiser_config
        d = cfg.get("dtype") or cfg.get("torch_dtype") or (cfg.get("text_config") or {}).get("dtype")
        return d if isinstance(d, str) and d in ("float32", "float16", "bfloat16") else "float32"
    return "float32"


def cache_bytes_per_token(subject, itemsize: int) -> int:
    """A language model's key/value cache per layer per token (0 for other models, or where it cannot be told)."""
    if not subject.autoregressive:
        return 0
    cfg = subject.denoiser_config
    cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    heads = cfg.get("num_attention_heads")
    kv = cfg.get("num_key_value_heads") or heads
    dim = cfg.get("head_dim") or ((cfg.get("hidden_size") or 0) // heads if heads else 0)
    return 2 * int(kv or 0) * int(dim or 0) * itemsize


def context_tokens(subject, context: int | None = None) -> int:
    cfg = subject.denoiser_config
    cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    most = cfg.get("max_position_embeddings")
    want = context or DEFAULT_CONTEXT
    return min(want, most) if isinstance(most, int) and most > 0 else want


def block_costs(subject, stacks, dtype: str, context: int | None = None) -> list[BlockCost]:
    """Each block of ``stacks`` (in order) as a node holds it in ``dtype``: its weight bytes from the
    safetensors headers, and for a language model its cache at ``context`` tokens (default
    ``DEFAULT_CONTEXT``, at most the model's longest)."""
    from diffuse.plan.modelfiles import located, renamed_for, weight_map

    key = (subject.path, subject.denoiser, dtype, context, tuple((s.path, s.length) for s in stacks))
    if key in _costs_cache:
        return _costs_cache[key]
    size = _dtype_size(dtype)
    skeleton = subject.meta_denoiser()
    wmap = located(renamed_for(weight_map(subject.component_dir), skeleton), skeleton, [s.path for s in stacks])
    headers: dict[str, dict] = {}
    per_token = cache_bytes_per_token(subject, size)
    state = per_token * context_tokens(subject, context)
    head = _head_bytes(subject, skeleton, size)
    out = []
    for st in stacks:
        blocks = skeleton.get_submodule(st.path)
        for i in range(st.length):
            total = 0
            for name, t in blocks[i].state_dict().items():
                full = f"{st.path}.{i}.{name}"
                file = wmap.get(full)
                if file is None:
                    raise DiffuseError(f"the weights lack {full}, which the model declares")
                if file not in headers:
                    headers[file] = _header(file)
                h = headers[file].get(wmap.source(full))
                if not isinstance(h, dict):
                    raise DiffuseError(f"{file} has no tensor {wmap.source(full)}")
                numel = math.prod(h.get("shape") or [])
                own = _SIZES.get(h.get("dtype"), 4)
                floating = str(h.get("dtype", "")).startswith(("F", "BF")) and t.is_floating_point()
                total += numel * (size if floating else own)
            out.append(BlockCost(st.path, i, total, state))
    if out and head:
        out[-1] = dataclasses.replace(out[-1], end_bytes=out[-1].end_bytes + head, end_compute=head)
    _costs_cache[key] = out
    return out


def _head_bytes(subject, skeleton, size: int) -> int:
    """A language model's output head in bytes (the last node holds it); 0 for other models. Counted on the
    weightless skeleton. (The embedding table stays on the client unless a run puts it on the first node,
    which is not counted.)"""
    if not subject.autoregressive:
        return 0
    try:
        head = skeleton.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return 0
    if head is None:
        return 0
    return sum(p.numel() * (size if p.is_floating_point() else p.element_size()) for p in head.parameters())


# --------------------------------------------------------------------------- the planner (a pure function)

SPEEDS_ALIKE = 1.25  # measured speeds within this factor of each other count alike: one busy machine measures
# the same node this far apart from one session to the next, and a placement should not swing with that
LEAVE_OUT = 0.10  # a node is left out of a route of passes one at a time only where that saves this share of the
LEAVE_OUT_S = 0.005  # pass's compute (at the median speed) and this many seconds: listed nodes are used, unless one
# is slow or behind a slow link (a hop on a LAN, a fraction of a millisecond, never leaves one out)


@dataclass(frozen=True)
class Capacity:
    """One node as the planner sees it."""

    name: str
    free: int | None  # bytes it may still take (None: not said, planned as unlimited)
    speed: float | None = None  # seconds per GiB of weights per token (None: not measured)
    holds: frozenset = frozenset()  # (stack, index) it already holds in the compute dtype (costs no memory)
    pool: str = ""  # nodes of one pool share its memory
    hop_s: float = 0.0  # one hop's time to or from it (half its round trip), where no link table is given
    pass_s: float | None = None  # seconds a pass spends on it besides its blocks, when it holds any (measured)


@dataclass
class Placement:
    nodes: list[Capacity]
    blocks: list[BlockCost]
    rows: list[tuple[Slice, ...]]  # per node: its slice of every stack (empty where it holds none of it)
    room: list[int | None]  # per node: bytes it may take after the margin
    need: list[int]  # per node: bytes its run costs it (weights it does not hold yet, plus state)
    size: list[int]  # per node: bytes of its run (weights and state, held or not)
    speeds: list[float]  # per node: the speed planned with (seconds per GiB per token)
    measured: list[bool]
    shares: list[float]  # per node: seconds its run takes per token
    hop_s: float  # a hop, in the same seconds, on average over the route (0 where no node is measured)
    notes: list[str]
    tokens: int = 1
    hops: list[float] = field(default_factory=list)  # each hop of the route: the client to the first, ..., home
    depth: int = 1  # passes in flight at once it was planned for (1: one after another)

    @property
    def used(self) -> list[int]:
        return [i for i, row in enumerate(self.rows) if any(not s.empty for s in row)]

    @property
    def slowest_s(self) -> float:
        return max(self.shares)

    @property
    def pass_s(self) -> float:
        """One pass through every used node in turn, with its hops (one patch, one stream)."""
        if self.hops:
            return sum(self.shares) + sum(self.hops)
        return sum(self.shares) + self.hop_s * (len(self.used) + 1)

    def step_s(self, depth: int | None = None) -> float:
        """``depth`` passes in flight at once (default: what it was planned for), per pass: each node works its
        share of every pass, the first pass takes every share in turn and each later one the slowest; plus the
        hops of one pass."""
        d = max(1, depth or self.depth)
        hops = sum(self.hops) if self.hops else self.hop_s * (len(self.used) + 1)
        return (sum(self.shares) + (d - 1) * self.slowest_s) / d + hops

    def lines(self) -> list[str]:
        """The placement as a table: per node its blocks, their GiB (weights and cache), the GiB it has room for
        besides what it holds, its speed, and its share of the time."""
        total = sum(self.shares) or 1.0
        rows = [f"{'node':<28} {'blocks':<34} {'GiB':>6} {'room':>7} {'speed':>14} {'share':>6}"]
        for i, (c, sl) in enumerate(zip(self.nodes, self.rows)):
            names = ", ".join(str(s) for s in sl if not s.empty) or "none"
            room = "-" if self.room[i] is None else f"{self.room[i] / GIB:.2f}"
            speed = (f"{self.speeds[i]:.3g} s/GiB/t" if any(self.measured) else "alike") + \
                ("" if self.measured[i] else "*")
            rows.append(f"{c.name[:28]:<28} {names[:34]:<34} {self.size[i] / GIB:>6.2f} {room:>7} {speed:>14} "
                        f"{self.shares[i] / total:>6.0%}")
        unmeasured = ("* not measured yet: counted at the median speed of those measured" if any(self.measured)
                      else "* no node measured yet: all counted alike")
        return rows + [unmeasured] * (not all(self.measured)) + self.notes


def _margin(free: int) -> int:
    return max(int(free * MARGIN_FRACTION), MARGIN_MIN_BYTES)


def rooms(nodes: list[Capacity]) -> list[int | None]:
    """What each node may take after the margin; nodes sharing a pool share its memory evenly."""
    pools: dict[str, int] = {}
    for c in nodes:
        if c.pool:
            pools[c.pool] = pools.get(c.pool, 0) + 1
    out = []
    for c in nodes:
        if c.free is None:
            out.append(None)
            continue
        share = c.free // pools.get(c.pool, 1) if c.pool else c.free
        out.append(max(0, share - _margin(share)))
    return out


def _alike(speeds: list[float]) -> dict[float, float]:
    """Each speed, with those within ``SPEEDS_ALIKE`` of the quickest of its group set to the group's median."""
    groups: list[list[float]] = []
    for s in sorted(set(speeds)):
        if groups and s <= groups[-1][0] * SPEEDS_ALIKE:
            groups[-1].append(s)
        else:
            groups.append([s])
    return {s: statistics.median(g) for g in groups for s in g}


def _around(nodes: list[Capacity]) -> list[float]:
    """Each node's seconds a pass spends on it besides its blocks: as measured, else the median of those
    measured (0 when none is)."""
    known = [c.pass_s for c in nodes if c.pass_s is not None]
    median = statistics.median(known) if known else 0.0
    return [c.pass_s if c.pass_s is not None else median for c in nodes]


def _speeds(nodes: list[Capacity]) -> tuple[list[float], list[bool], bool]:
    measured = [c.speed is not None and c.speed > 0 for c in nodes]
    known = [c.speed for c, m in zip(nodes, measured) if m]
    median = statistics.median(known) if known else 1.0
    snap = _alike(known)
    return [snap[c.speed] if m else median for c, m in zip(nodes, measured)], measured, bool(known)


def _shortfall(blocks: list[BlockCost], nodes: list[Capacity], room: list[int | None]) -> DoesNotFit:
    need = sum(b.weight_bytes + b.held_bytes for b in blocks)
    have = sum(r for r in room if r is not None)
    biggest = max(b.weight_bytes + b.held_bytes for b in blocks)
    each = ", ".join(f"{c.name} {r / GIB:.2f}" for c, r in zip(nodes, room) if r is not None)
    state, ends = sum(b.state_bytes for b in blocks), sum(b.end_bytes for b in blocks)
    what = (f"{len(blocks)} blocks, {need / GIB:.2f} GiB" + (f" with {state / GIB:.2f} GiB of cache" if state else "")
            + (f" and a {ends / GIB:.2f} GiB output head" if ends else ""))
    if need > have:
        why = f"{(need - have) / GIB:.2f} GiB short"
    else:
        why = (f"no node has room for the next whole block ({biggest / GIB:.2f} GiB) where it is needed: at least "
               f"{biggest / GIB:.2f} GiB short on one node")
    return DoesNotFit(f"the model does not fit these nodes: it needs {what}; the {len(nodes)} node(s) can take "
                      f"{have / GIB:.2f} GiB between them after a {MARGIN_FRACTION:.0%} margin ({each}): {why}. "
                      "Add a node or memory, or compute in a smaller dtype")


class _Costs:
    """Prefix sums over the blocks, for what a run of them costs a node in time and in memory."""

    def __init__(self, blocks: list[BlockCost], nodes: list[Capacity], speeds: list[float], tokens: int):
        self.blocks, self.nodes, self.speeds, self.tokens = blocks, nodes, speeds, tokens
        self.around = _around(nodes) if any(c.speed for c in nodes) else [0.0] * len(nodes)
        self.room = rooms(nodes)
        self.W, self.S = [0], [0]  # compute in weight bytes; memory besides the blocks' weights
        for b in blocks:
            self.W.append(self.W[-1] + b.weight_bytes + b.end_compute)
            self.S.append(self.S[-1] + b.held_bytes)
        self.fresh = []  # per node: prefix sums of the weight bytes it does not hold yet
        for c in nodes:
            p = [0]
            for b in blocks:
                p.append(p[-1] + (0 if (b.stack, b.index) in c.holds else b.weight_bytes))
            self.fresh.append(p)

    def cost(self, i: int, a: int, b: int) -> float:
        """Seconds node ``i`` takes a pass to run blocks [a, b): their weights at its speed, and what a pass
        costs it besides (none where it runs no block)."""
        return self.speeds[i] * (self.W[b] - self.W[a]) / GIB * self.tokens + (self.around[i] if b > a else 0.0)

    def need(self, i: int, a: int, b: int) -> int:
        return self.fresh[i][b] - self.fresh[i][a] + self.S[b] - self.S[a]

    def fits(self, i: int, a: int, b: int) -> bool:
        return self.room[i] is None or self.need(i, a, b) <= self.room[i]


def _hop_matrix(n: int, nodes: list[Capacity], links: list[list[float]] | None) -> list[list[float]]:
    """Seconds of a hop from end i to end j (index n: the client): ``links`` where given, else the mean of
    the nodes' own ``hop_s``."""
    if links is not None:
        return links
    hop = statistics.mean(c.hop_s for c in nodes)
    return [[hop] * (n + 1) for _ in range(n + 1)]


def place(blocks: list[BlockCost], nodes: list[Capacity], tokens: int = 1, links: list[list[float]] | None = None,
          depth: int = 1) -> Placement:
    """Contiguous runs of ``blocks`` (every stack's blocks in plan order), one per node in the given order,
    that fit every node's room. ``depth`` 1 (passes one after another: a language model's tokens, a diffusion
    step at one patch): the least time for a pass, every used node's share plus every hop (``links[i][j]``:
    seconds from end i to end j, index ``len(nodes)`` the client; a slow link between two nodes is then
    worth one fewer hop), a node left out only where that saves ``LEAVE_OUT`` of the compute; among those
    as quick, the most even. ``depth`` > 1 (patches in flight): the least slowest share, every node that can
    take a block taking one; among those, the least total compute, then the most even. Raises
    ``DoesNotFit`` with the shortfall in GiB."""
    if not nodes:
        raise DiffuseError("no node to place the model on")
    if not blocks:
        raise DiffuseError("the model has no block to place")
    speeds, measured, any_measured = _speeds(nodes)
    t = _Costs(blocks, nodes, speeds, tokens)
    n = len(nodes)
    hop = _hop_matrix(n, nodes, links) if any_measured else [[0.0] * (n + 1) for _ in range(n + 1)]
    ranges = _one_at_a_time(t, hop) if depth <= 1 else _in_flight(t)
    return _placement(t, ranges, measured, hop, depth)


def _better(v: tuple, w: tuple | None) -> bool:
    """``v`` before ``w``: the float parts in order, each to a relative 1e-9, then the rest as they compare."""
    if w is None:
        return True
    for x, y in zip(v[:2], w[:2]):
        if x < y - 1e-9 * max(1.0, abs(y)):
            return True
        if x > y + 1e-9 * max(1.0, abs(y)):
            return False
    return v[2:] < w[2:]


def leave_out_s(speeds: list[float], weight_bytes: int, tokens: int = 1, timed: bool = True) -> float:
    """What leaving a node out must save a pass (see ``LEAVE_OUT``); ``timed``: the speeds are seconds
    (measured), not all counted alike."""
    share = LEAVE_OUT * statistics.median(speeds) * weight_bytes / GIB * tokens
    return max(share, LEAVE_OUT_S) if timed else share


def _one_at_a_time(t: _Costs, hop: list[list[float]]) -> list[tuple[int, int]]:
    """Ranges per node for passes one after another (see ``place``): (time with hops and any left-out
    penalty, sum of squared shares, earlier runs longer), over states (blocks placed, last node used)."""
    n, L = len(t.nodes), len(t.blocks)
    penalty = leave_out_s(t.speeds, t.W[L], t.tokens, any(h for row in hop for h in row))
    best: dict[tuple[int, int], tuple] = {(0, -1): (0.0, 0.0, ())}
    back: list[dict] = []
    for i in range(n):
        nxt: dict[tuple[int, int], tuple] = {}
        bk: dict[tuple[int, int], tuple] = {}
        for (a, j), v in best.items():
            options = [((a, j), (v[0] + penalty, v[1], v[2]), None)]  # node i left out
            for b in range(a + 1, L + 1):
                if not t.fits(i, a, b):
                    break
                c = t.cost(i, a, b)
                options.append(((b, i), (v[0] + c + hop[j if j >= 0 else n][i], v[1] + c * c, v[2] + (a - b,)),
                                (a, b)))
            for state, value, run in options:
                if _better(value, nxt.get(state)):
                    nxt[state], bk[state] = value, ((a, j), run)
        best = nxt
        back.append(bk)
    end = None
    for (b, j), v in best.items():
        if b == L and j >= 0:
            value = (v[0] + hop[j][n], v[1], v[2])
            if _better(value, end and end[0]):
                end = (value, (b, j))
    if end is None:
        raise _shortfall(t.blocks, t.nodes, t.room)
    ranges: list[tuple[int, int]] = [(0, 0)] * n
    state = end[1]
    for i in range(n - 1, -1, -1):
        state, run = back[i][state]
        ranges[i] = run if run is not None else (state[0], state[0])
    return ranges


def _in_flight(t: _Costs) -> list[tuple[int, int]]:
    """Ranges per node for passes in flight at once (see ``place``)."""
    n, L = len(t.nodes), len(t.blocks)
    inf, tol = math.inf, 1e-12
    # phase 1: per number of nodes used, the least possible slowest share
    f = [[inf] * (L + 1) for _ in range(n + 1)]  # f[u][b]: blocks [0, b) on u of the nodes so far
    f[0][0] = 0.0
    for i in range(n):
        g = [row[:] for row in f]
        for u in range(i + 1):
            for a in range(L):
                if f[u][a] == inf:
                    continue
                for b in range(a + 1, L + 1):
                    if not t.fits(i, a, b):
                        break
                    v = max(f[u][a], t.cost(i, a, b))
                    if v < g[u + 1][b]:
                        g[u + 1][b] = v
        f = g
    options = [u for u in range(1, n + 1) if f[u][L] < inf]
    if not options:
        raise _shortfall(t.blocks, t.nodes, t.room)
    u_star = max(options)  # every listed node that can take a block takes one: the user chose them
    return _least_total(t, u_star, f[u_star][L] * (1 + 1e-9) + tol)


def _least_total(t: _Costs, u_star: int, cap: float) -> list[tuple[int, int]]:
    """Under the slowest share ``cap``, on ``u_star`` nodes: the least total, then the least sum of squares;
    ties go to the placement whose earlier nodes take more (as even slices do)."""
    n, L, inf = len(t.nodes), len(t.blocks), math.inf
    zero = (inf, inf)
    h = [[zero] * (L + 1) for _ in range(u_star + 1)]
    h[0][0] = (0.0, 0.0)
    back: list[list[list]] = []
    for i in range(n):
        g = [row[:] for row in h]
        bk = [[None] * (L + 1) for _ in range(u_star + 1)]  # (u, a) it came from; None: node i unused
        for u in range(min(i, u_star - 1), -1, -1):
            for b in range(L, 0, -1):
                for a in range(b - 1, -1, -1):
                    if h[u][a][0] == inf:
                        continue
                    if not t.fits(i, a, b):
                        break
                    c = t.cost(i, a, b)
                    if c > cap:
                        break
                    v = (h[u][a][0] + c, h[u][a][1] + c * c)
                    if _less(v, g[u + 1][b]):
                        g[u + 1][b] = v
                        bk[u + 1][b] = (u, a)
        back.append(bk)
        h = g
    ranges: list[tuple[int, int]] = [(0, 0)] * n
    u, b = u_star, L
    for i in range(n - 1, -1, -1):
        step = back[i][u][b]
        if step is None:
            ranges[i] = (b, b)
        else:
            ranges[i] = (step[1], b)
            u, b = step
    return ranges


def _route_hops(ranges: list[tuple[int, int]], hop: list[list[float]]) -> list[float]:
    """Each hop of the route the ranges make: the client to the first used node, between used nodes, home."""
    n = len(ranges)
    used = [i for i, (a, b) in enumerate(ranges) if b > a]
    ends = [n, *used, n]
    return [hop[x][y] for x, y in zip(ends, ends[1:])]


def _placement(t: _Costs, ranges: list[tuple[int, int]], measured: list[bool], hop: list[list[float]],
               depth: int) -> Placement:
    blocks, nodes, L = t.blocks, t.nodes, len(t.blocks)
    need = [t.need(i, a, b) for i, (a, b) in enumerate(ranges)]
    shares = [t.cost(i, a, b) for i, (a, b) in enumerate(ranges)]
    notes = []
    for i, c in enumerate(nodes):
        a, b = ranges[i]
        if b == a:
            notes.append(f"{c.name} holds nothing: it {_why_none(t, i, a, depth)}")
        elif t.room[i] is not None and b < L and not t.fits(i, a, b + 1) and shares[i] < max(shares) * (1 - 1e-9):
            notes.append(f"{c.name} holds {b - a} block(s), as many as its memory allows")
    size = [sum(blk.weight_bytes + blk.held_bytes for blk in blocks[a:b]) for a, b in ranges]
    hops = _route_hops(ranges, hop)
    return Placement(list(nodes), list(blocks), _rows(blocks, ranges), t.room, need, size, t.speeds, measured,
                     shares, statistics.mean(hops), notes, t.tokens, hops, depth)


def _why_none(t: _Costs, i: int, a: int, depth: int) -> str:
    one = min(blk.weight_bytes + blk.held_bytes for blk in t.blocks)
    if t.room[i] is not None and t.room[i] < one:
        return "has room for no block"
    if depth > 1 or len(t.blocks) < len(t.nodes) or (a < len(t.blocks) and not t.fits(i, a, a + 1)):
        return "is one node too many for the blocks there are, or has no room where its turn comes"
    return "would make a pass slower than the others make it without it (its speed, or its links)"


def _stacks_of(blocks: list[BlockCost]) -> list[tuple[str, int]]:
    """(stack, length) in the order the blocks list them."""
    out: dict[str, int] = {}
    for b in blocks:
        out[b.stack] = out.get(b.stack, 0) + 1
    return list(out.items())


def _rows(blocks: list[BlockCost], ranges: list[tuple[int, int]]) -> list[tuple[Slice, ...]]:
    """Per node, its run of the blocks as a slice of every stack (empty where the run has none of it)."""
    out = []
    for a, b in ranges:
        row, off = [], 0
        for stack, length in _stacks_of(blocks):
            lo, hi = min(max(a - off, 0), length), min(max(b - off, 0), length)
            row.append(Slice(stack, lo, max(lo, hi)))
            off += length
        out.append(tuple(row))
    return out


def _less(v: tuple, w: tuple) -> bool:
    """``v`` before ``w``, comparing in order, each to a relative 1e-9 (sums of the same costs in another order)."""
    for x, y in zip(v, w):
        if y == math.inf:
            return x < y
        if x < y - 1e-9 * max(1.0, abs(y)):
            return True
        if x > y + 1e-9 * max(1.0, abs(y)):
            return False
    return False


def even_placement(blocks: list[BlockCost], nodes: list[Capacity], tokens: int = 1,
                   links: list[list[float]] | None = None, depth: int = 1) -> Placement:
    """Even slices of every stack (as ``diffuse.plan.contracts.even_route`` cuts them), checked against the nodes'
    memory: refused, naming each node that would run short and by how much, when they do not fit."""
    from diffuse.plan.contracts import split_evenly

    speeds, measured, any_measured = _speeds(nodes)
    t = _Costs(blocks, nodes, speeds, tokens)
    rows = [tuple(Slice(stack, *split_evenly(length, len(nodes))[i]) for stack, length in _stacks_of(blocks))
            for i in range(len(nodes))]
    need, size, shares, short = [], [], [], []
    for i, c in enumerate(nodes):
        mine = [b for b in blocks for s in rows[i] if s.stack == b.stack and s.start <= b.index < s.stop]
        need.append(sum((0 if (b.stack, b.index) in c.holds else b.weight_bytes) + b.held_bytes for b in mine))
        size.append(sum(b.weight_bytes + b.held_bytes for b in mine))
        shares.append(speeds[i] * sum(b.weight_bytes + b.end_compute for b in mine) / GIB * tokens
                      + (t.around[i] if mine else 0.0))
        if t.room[i] is not None and need[-1] > t.room[i]:
            short.append(f"{c.name} would take {need[-1] / GIB:.2f} GiB and has room for {t.room[i] / GIB:.2f} "
                         f"({(need[-1] - t.room[i]) / GIB:.2f} GiB short)")
    if short:
        raise DoesNotFit("even slices do not fit these nodes: " + "; ".join(short) +
                         " (the default placement plans the slices by memory)")
    n = len(nodes)
    hop = _hop_matrix(n, nodes, links) if any_measured else [[0.0] * (n + 1) for _ in range(n + 1)]
    ranges = [(0, 1) if any(not s.empty for s in row) else (0, 0) for row in rows]  # which nodes the route uses
    hops = _route_hops(ranges, hop)
    return Placement(list(nodes), list(blocks), rows, t.room, need, size, speeds, measured, shares,
                     statistics.mean(hops), [], tokens, hops, depth)


def placement_of(blocks: list[BlockCost], nodes: list[Capacity], rows, tokens: int = 1,
                 links: list[list[float]] | None = None, depth: int = 1) -> Placement:
    """A given placement (``rows``: per node its slices, as a route's stages hold them), costed as ``place``
    costs its own: what a bench predicts a route's pass takes."""
    offsets, off = {}, 0
    for stack, length in _stacks_of(blocks):
        offsets[stack] = off
        off += length
    ranges = []
    for row in rows:
        held = [(offsets[s.stack] + s.start, offsets[s.stack] + s.stop) for s in row if not s.empty]
        ranges.append((min(a for a, _ in held), max(b for _, b in held)) if held else (0, 0))
    speeds, measured, any_measured = _speeds(nodes)
    n = len(nodes)
    hop = _hop_matrix(n, nodes, links) if any_measured else [[0.0] * (n + 1) for _ in range(n + 1)]
    return _placement(_Costs(blocks, nodes, speeds, tokens), ranges, measured, hop, depth)


# --------------------------------------------------------------------------- from reports to a route


def capacities(stages, dtype: str, model_hash: str, per: str = "token") -> list[Capacity] | None:
    """The planner's view of ``stages`` from their nodes' hello reports; None if any has not reported.
    ``per``: the speed planned with (``NodeReport.s_per_gib_token``)."""
    out = []
    for s in stages:
        r = report_of(s.address)
        if r is None:
            return None
        speed = r.s_per_gib_token(dtype, model_hash, per)
        holds = frozenset((st, i) for st, i, d in r.holds if d == dtype)
        out.append(Capacity(s.address, r.available, speed, holds, r.pool, (r.rtt_s or 0.0) / 2,
                            r.pass_s if speed is not None else None))
    return out


def link_hops(addresses: list[str], nbytes: int, fallback: list[float] | None = None) -> list[list[float]]:
    """Seconds of a hop carrying ``nbytes`` from end i to end j (index ``len(addresses)``: the client), from
    the links measured (``diffuse.wire.links``): the client's link to a node counts both ways; a link between two
    nodes not measured yet counts as the mean of their links to the client; a client link not measured as
    ``fallback[i]`` (half the hello's round trip)."""
    from diffuse.wire import links

    n = len(addresses)
    client = []
    for i, a in enumerate(addresses):
        link = links.known(links.CLIENT, a)
        client.append(link.hop_s(nbytes) if link else (fallback[i] if fallback else 0.0))
    m = [[0.0] * (n + 1) for _ in range(n + 1)]
    for i in range(n + 1):
        for j in range(n + 1):
            if i == j:
                continue
            if n in (i, j):
                m[i][j] = client[j if i == n else i]
                continue
            link = links.known(addresses[i], addresses[j])
            m[i][j] = link.hop_s(nbytes) if link else (client[i] + client[j]) / 2
    return m


def pass_bytes(plan: SlicingPlan, subject, dtype: str) -> int:
    """The bytes one pass hands from end to end: the first stack's streams as its first call carried them
    (where the plan has learnt it), a language model's hidden state of one token, else 0 (not known yet)."""
    first = plan.stacks[0].path if plan.stacks else None
    cp, rm = plan.call_plans.get(first), plan.return_maps.get(first)
    if cp is not None and rm is not None:
        total = 0
        for i in rm.streams:
            if i < len(cp.tensors):
                spec = cp.tensors[i]
                total += math.prod(spec.shape) * _dtype_size(spec.dtype.removeprefix("torch."))
        return total
    if subject.autoregressive:
        cfg = subject.denoiser_config
        cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
        hidden = cfg.get("hidden_size")
        return int(hidden) * _dtype_size(dtype) if isinstance(hidden, int) and hidden > 0 else 0
    return 0


def per_pass(subject) -> str:
    """The speed a route of ``subject`` is planned with: per decoding token, or per pass as they came."""
    return "single" if subject.autoregressive else "pass"


def plan_for(plan: SlicingPlan, stages, placement: str = "planned", context: int | None = None,
             depth: int = 1) -> Placement | None:
    """The placement of ``plan``'s model on ``stages`` (None when a node has not reported, or the model is
    not on this machine to read its headers: the caller then splits evenly, as before reports)."""
    from diffuse.plan.analysis import ModelSubject

    try:
        subject = ModelSubject.from_path(plan.model.path)
    except (DiffuseError, OSError):
        return None
    # a pass as it comes: a language model's token, a diffusion stack's call (its tokens not known yet)
    caps = capacities(stages, plan.compute_dtype, plan.model.content_hash, per_pass(subject))
    if caps is None:
        return None
    try:
        blocks = block_costs(subject, plan.stacks, plan.compute_dtype, context)
        nbytes = pass_bytes(plan, subject, plan.compute_dtype)
    except (DiffuseError, OSError, ValueError):  # headers this client cannot read: the nodes read their own
        return None
    hops = link_hops([s.address for s in stages], nbytes, [c.hop_s for c in caps])
    if placement == "even":
        return even_placement(blocks, caps, links=hops, depth=depth)
    return place(blocks, caps, links=hops, depth=depth)


def route(plan: SlicingPlan, stages, placement: str = "planned", depth: int = 1) -> SlicingPlan:
    """``plan`` routed over ``stages`` (nodes that load what they are asked for): slices planned from the
    nodes' reports and links (nodes given none stay out of the route; ``depth``: passes in flight at once,
    as ``place`` takes it), or even slices (``placement="even"``, or when a node has not reported), checked
    against their memory where they reported it."""
    if placement not in PLACEMENTS:
        raise DiffuseError(f"unknown placement {placement!r}: {' or '.join(PLACEMENTS)}")
    stages = list(stages)
    p = plan_for(plan, stages, placement, depth=depth)
    if p is None or placement == "even":
        return plan.with_route(even_route(plan.stacks, [s.address for s in stages], [s.key for s in stages]))
    return plan.with_route(Stage(s.address, s.key, p.rows[i]) for i, s in enumerate(stages) if i in p.used)
