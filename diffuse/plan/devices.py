"""Where a node or a client computes (``--device``) and in what (``--dtype``), and tensors on their way there.

``resolve_device`` turns ``auto|cpu|cuda|cuda:N|mps`` into a ``torch.device`` (``auto``: the first
accelerator torch sees, else the CPU) and refuses, in one line naming what torch sees, a device this
machine does not have. ``resolve_dtype`` turns ``auto|bfloat16|float16|float32`` into the compute dtype:
``auto`` is what the model folder declares on an accelerator, and on the CPU what a plain
``from_pretrained`` gives (None: today's behaviour, kept byte for byte); a dtype the device cannot compute
in is refused likewise. Both run before anything loads.

On the wire (``to_device``, ``to_host``): a received tensor goes through a pinned host buffer to a CUDA
device without blocking; outgoing tensors come back to host memory once, all copies started before one
wait. On the CPU both return their input untouched, so the bytes on the wire are those of a CPU run.

A node's outgoing side (``Outgoing``, ``PassClock``): on CUDA a pass's answer is copied to pinned host
memory on a stream of the node's own, after the pass's kernels, and waited for (an event) only when it is
sealed, which the node does once it has queued the next pass's kernels: the copy and the sealing overlap
the next pass's compute. The pass's time is read from CUDA events around its kernels, not from the CPU
thread that queued them. On the CPU nothing of this runs (no copy, no event); ``DIFFUSE_REHEARSE_ASYNC=1``
makes a CPU node take the same path anyway (a host copy and a wall clock stand in for the device's), to
exercise its ordering where no accelerator is lent.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch

from diffuse.errors import DiffuseError

DEVICES = ("auto", "cpu", "cuda", "cuda:N", "mps")
DTYPES = ("auto", "bfloat16", "float16", "float32")


def torch_sees() -> str:
    """What this torch finds, in a few words: its version, how it was built, the accelerators it sees."""
    cuda = torch.version.cuda
    if cuda is None:
        built = "built without CUDA"
    else:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        built = f"CUDA {cuda} build, {n} CUDA device{'s' if n != 1 else ''} visible"
    mps = getattr(torch.backends, "mps", None)
    extra = ", MPS available" if mps is not None and mps.is_available() else ""
    return f"torch {torch.__version__}, {built}{extra}"


def check_named(device: str | None, dtype: str | None, named_dtype: bool) -> None:
    """A command's ``--device`` (and its ``--dtype`` where ``named_dtype``) held against what torch sees here
    before anything loads (``diffuse.cli.parsing.named_device`` says what is named): refused in one line."""
    found = resolve_device(device)
    if named_dtype:
        resolve_dtype(dtype, found, None)


def resolve_device(text: str | None) -> torch.device:
    """``--device``: ``auto`` (None too), ``cpu``, ``cuda``, ``cuda:N`` or ``mps``, checked against what torch
    sees here; a device it does not see is refused in one line. None: ``$DIFFUSE_DEVICE``, else ``auto``."""
    text = (text or os.environ.get("DIFFUSE_DEVICE") or "auto").strip().lower()
    if text == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", 0)
        mps = getattr(torch.backends, "mps", None)
        return torch.device("mps") if mps is not None and mps.is_available() else torch.device("cpu")
    if text == "cpu":
        return torch.device("cpu")
    if text == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise DiffuseError(f"--device mps: torch sees no MPS device ({torch_sees()})")
        return torch.device("mps")
    kind, _, index = text.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise DiffuseError(f"--device {text}: choose auto, cpu, cuda, cuda:N or mps")
    if not torch.cuda.is_available():
        raise DiffuseError(f"--device {text}: torch sees no CUDA device ({torch_sees()})")
    n = int(index or 0)
    if n >= torch.cuda.device_count():
        raise DiffuseError(f"--device {text}: torch sees CUDA devices 0 to {torch.cuda.device_count() - 1} "
                           f"({torch_sees()})")
    return torch.device("cuda", n)


def declared_dtype(folder: str, component: str | None = None) -> torch.dtype | None:
    """The dtype a model folder declares: ``torch_dtype`` (or ``dtype``) in the config of the component that
    holds the blocks, else the dtype most of its stored floating weights have (from the safetensors headers,
    no tensor data read); None if neither says."""
    where = os.path.join(folder, component) if component else folder
    try:
        with open(os.path.join(where, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        cfg = {}
    named = cfg.get("torch_dtype") or cfg.get("dtype") or (cfg.get("text_config") or {}).get("torch_dtype")
    d = getattr(torch, named, None) if isinstance(named, str) else None
    if isinstance(d, torch.dtype) and d.is_floating_point:
        return d
    return _stored_dtype(where)


_STORED = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def _stored_dtype(folder: str) -> torch.dtype | None:
    counts: dict[torch.dtype, int] = {}
    try:
        names = [n for n in os.listdir(folder) if n.endswith(".safetensors")]
    except OSError:
        return None
    for name in names:
        with open(os.path.join(folder, name), "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for key, meta in header.items():
            d = _STORED.get(meta.get("dtype")) if key != "__metadata__" else None
            if d is not None:
                counts[d] = counts.get(d, 0) + 1
    return max(counts, key=counts.get) if counts else None


def can_compute(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``device`` cannot compute in ``dtype`` (None: it can): a small matmul, softmax and layer norm are
    tried there, and on CUDA bfloat16 needs a device that supports it."""
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        return f"{torch.cuda.get_device_name(device)} does not support bfloat16"
    try:
        x = torch.ones(4, 4, dtype=dtype, device=device)
        torch.nn.functional.layer_norm(torch.softmax(x @ x, dim=-1), (4,))
    except (RuntimeError, TypeError) as exc:
        return " ".join(str(exc).split())[:160]
    return None


def resolve_dtype(text: str | None, device: torch.device, declared: torch.dtype | None) -> torch.dtype | None:
    """``--dtype``: ``auto`` (None too) is ``declared`` on an accelerator (float32 if the folder declares
    nothing) and None on the CPU (what a plain ``from_pretrained`` gives, as before devices were named); a
    named dtype is that dtype. A dtype ``device`` cannot compute in is refused in one line. None:
    ``$DIFFUSE_DTYPE``, else ``auto``."""
    text = (text or os.environ.get("DIFFUSE_DTYPE") or "auto").strip().lower()
    if text not in DTYPES:
        raise DiffuseError(f"--dtype {text}: choose {', '.join(DTYPES)}")
    if text == "auto":
        if device.type == "cpu":
            return None
        dtype = declared if declared in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
    else:
        dtype = getattr(torch, text)
    why = can_compute(device, dtype)
    if why:
        raise DiffuseError(f"--dtype {str(dtype).removeprefix('torch.')}: {device} cannot compute in it ({why}; "
                           f"{torch_sees()})")
    return dtype


def dtype_name(dtype: torch.dtype | None, default: str = "as loaded") -> str:
    return str(dtype).removeprefix("torch.") if dtype is not None else default


@dataclass(frozen=True)
class Compute:
    """Where a node computes and in what: ``dtype`` None computes in what each session asks (the CPU default,
    as before devices were named); ``fixed``: the dtype was named (``--dtype``), and sessions asking another
    are refused."""

    device: torch.device = torch.device("cpu")
    dtype: torch.dtype | None = None
    fixed: bool = False
    quant: str = ""  # --quantize: the blocks' linear weights held so (diffuse.plan.quantize); "" unquantized

    @classmethod
    def of(cls, device: str | None, dtype: str | None, folder: str | None = None,
           component: str | None = None) -> "Compute":
        """From ``--device`` and ``--dtype``, checked before anything loads."""
        dev = resolve_device(device)
        named = (dtype or os.environ.get("DIFFUSE_DTYPE") or "auto").strip().lower() != "auto"
        declared = declared_dtype(folder, component) if folder and not named and dev.type != "cpu" else None
        return cls(dev, resolve_dtype(dtype, dev, declared), named)

    @property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu"

    def describe(self) -> str:
        held = f", blocks quantized {self.quant}" if self.quant else ""
        return f"{self.device} in {dtype_name(self.dtype, 'the default dtype')}{held}"


# --------------------------------------------------------------------------- tensors to and from the device

def to_device(tensors: list, device: torch.device | None) -> list:
    """Received tensors (fresh host memory) onto ``device``: on CUDA through a pinned buffer, not waiting for
    the copy (later work on the device's stream is ordered after it); on the CPU (or None) untouched."""
    if device is None or device.type == "cpu":
        return tensors
    out = []
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device == device:
            out.append(t)
        elif device.type == "cuda":
            pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            pinned.copy_(t)
            out.append(pinned.to(device, non_blocking=True))
        else:
            out.append(t.to(device))
    return out


def to_host(tensors: list) -> list:
    """Tensors in host memory, each copied once: CUDA tensors into pinned buffers, every copy started before
    one wait for them all. Tensors already on the CPU are returned as they are (the same objects)."""
    if not any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in tensors):
        return tensors
    out, streams = [], set()
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "cpu":
            out.append(t)
        elif t.device.type == "cuda":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t.detach(), non_blocking=True)
            streams.add(t.device)
            out.append(host)
        else:
            out.append(t.detach().to("cpu"))
    for dev in streams:
        torch.cuda.current_stream(dev).synchronize()
    return out


REHEARSE = "DIFFUSE_REHEARSE_ASYNC"  # "1": a CPU node takes the accelerator's asynchronous path (see above)


def rehearsing(device: torch.device) -> bool:
    return device.type == "cpu" and os.environ.get(REHEARSE) == "1"


class _Copied:
    """A rehearsal's stand-in for a copy's event: the host copy was made at once."""

    def synchronize(self) -> None:
        return None


class Outgoing:
    """A node's answers on their way to host memory (see the module's docstring). ``start(tensors)`` gives
    (host tensors, ready): ready is None where the host tensors can be read at once (the CPU: the very tensors
    given), else what to ``synchronize()`` before reading them (on CUDA an event recorded on the node's copy
    stream after its copies, which wait for the kernels queued so far on the compute stream)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.rehearse = rehearsing(device)

    def start(self, tensors: list) -> tuple[list, object | None]:
        if self.stream is not None and any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
            return _start_to_host(tensors, self.stream)
        if self.rehearse:
            return [t.clone() if isinstance(t, torch.Tensor) else t for t in tensors], _Copied()
        return to_host(tensors), None  # the CPU's: as they are (another accelerator: copied, waited for)


def _start_to_host(tensors: list, stream) -> tuple[list, object]:
    """Each CUDA tensor copied once into a pinned host buffer on ``stream``, after the work queued so far on
    its compute stream, not waited for; the event that says the copies are done. The allocator is told that
    ``stream`` still reads each tensor (``record_stream``), so its memory is not handed out before."""
    compute = torch.cuda.current_stream(stream.device)
    stream.wait_stream(compute)
    out = []
    with torch.cuda.stream(stream):
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.is_cuda:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t.detach(), non_blocking=True)
                t.record_stream(stream)
                out.append(host)
            else:
                out.append(t.detach().to("cpu") if isinstance(t, torch.Tensor) else t)
        ready = stream.record_event()
    return out, ready


class PassClock:
    """How long a pass's blocks took, where the thread that queued them cannot tell: on CUDA between two
    events recorded on the compute stream around the pass (``seconds`` waits for the second); in a rehearsal
    (``DIFFUSE_REHEARSE_ASYNC``) the wall clock. ``start`` gives None on the CPU: the caller's own clocks
    stand, as before."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.begin = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            self.begin.record(torch.cuda.current_stream(device))
        else:
            self.t0 = time.perf_counter()
        self.device = device

    @classmethod
    def start(cls, device: torch.device) -> "PassClock | None":
        return cls(device) if device.type == "cuda" or rehearsing(device) else None

    def stop(self) -> None:
        """The pass's last kernel is queued (on CUDA: the second event recorded after it)."""
        if self.cuda:
            self.end.record(torch.cuda.current_stream(self.device))
        else:
            self.t1 = time.perf_counter()

    def seconds(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return self.begin.elapsed_time(self.end) / 1000.0
        return self.t1 - self.t0


def device_of(tensors) -> torch.device | None:
    """The device of the first tensor not on the CPU among ``tensors`` (None: all on the CPU)."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta"):
            return t.device
    return None


def place(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``module``'s tensors on ``device``, except weightless (meta) ones: the blocks a split hands to nodes
    stay weightless on the client."""
    if device.type == "cpu":
        return module
    return module._apply(lambda t: t if t.is_meta else t.to(device))


def memory_report(device: torch.device) -> dict | None:
    """Free memory on an accelerator, as placement reads it (None on the CPU: its own report counts there).
    ``pool`` names the device, so that nodes sharing one GPU share its free memory."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        props = torch.cuda.get_device_properties(device)
        uuid = str(getattr(props, "uuid", "")) or f"{os.uname().nodename}:{device}"
        return {"available": int(free), "limit": int(total), "source": f"{device} free (torch.cuda.mem_get_info)",
                "pool": f"cuda {uuid}"}
    if device.type == "mps":
        total = int(torch.mps.recommended_max_memory())
        used = int(torch.mps.driver_allocated_memory())
        return {"available": max(0, total - used), "limit": total, "source": "mps recommended less allocated",
                "pool": f"mps {os.uname().nodename}"}
    return None


def device_name(device: torch.device) -> str:
    """The device for a report: ``cpu``, ``cuda:0 (NVIDIA H100 80GB HBM3)``, ``mps``."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def inputs_on(inputs, device: torch.device):
    """A model's call inputs (a dict of tensors and other values) on ``device``; on the CPU ``inputs`` itself."""
    if device.type == "cpu":
        return inputs
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in dict(inputs).items()}


def model_device(model) -> torch.device:
    """Where a model's loaded (not weightless) parameters are; the CPU if it holds none."""
    return device_of(model.parameters()) or torch.device("cpu")
