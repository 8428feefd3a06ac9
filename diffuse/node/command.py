"""``python -m diffuse.node``: hold slices of a model's block stacks and serve them.

The node's command line: its flags, the checks made before anything loads, and
the ``Node`` (``diffuse.node.server``) it builds and serves. The node prints one
JSON line when it is ready (its control address, data address and public key),
then serves until stopped. With ``--blocks`` it holds its slice before that line
(``Node.hold_slice``): while a Hub model's slice is fetched, its control address
already answers hello and status (said in the log), and refuses opens.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import sys

import torch

from diffuse.wire import discovery
from diffuse.text import plain
from diffuse.errors import DiffuseError
from diffuse.home import config_home
from diffuse.node.server import MAX_SESSIONS, MAX_SESSIONS_PER_CLIENT, Node, NodeOptions
from diffuse.plan.contracts import WIRE_VERSIONS
from diffuse.wire.transport import DEFAULT_MAX_MESSAGE_BYTES

log = logging.getLogger("diffuse.node")


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse instead of handing it back: without this, every large activation a
    block makes (tens of MiB) is a fresh mapping, page-faulted and zeroed by the kernel on every call, the more so
    on the compute thread, whose own arena trims eagerly. Placement within a page is unchanged (torch aligns
    every tensor itself), so results are the same bits. False where this is not glibc."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
    return bool(libc.mallopt(m_trim_threshold, 1 << 30) and libc.mallopt(m_mmap_threshold, 32 << 20)
                and libc.mallopt(m_arena_max, 1))


def compile_unavailable() -> str | None:
    """Why ``--compile`` cannot work here (inductor missing, or no C compiler for its CPU kernels), or None."""
    import shutil

    try:
        import torch._inductor  # noqa: F401
    except Exception as exc:
        return f"torch's inductor compiler is not available in this torch ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available() and not any(shutil.which(c) for c in ("cc", "gcc", "clang", "g++")):
        return "inductor compiles CPU kernels with a C compiler, and none is on PATH (install gcc)"
    return None


def _wire(text: str) -> tuple[int, ...]:
    """``--wire``: the wire versions this node speaks, e.g. "1" or "1,2"."""
    try:
        versions = tuple(sorted({int(v) for v in text.split(",")}))
    except ValueError:
        versions = ()
    if not versions or not set(versions) <= set(WIRE_VERSIONS):
        raise argparse.ArgumentTypeError(f"{text!r}: this node speaks wire versions "
                                         f"{','.join(map(str, WIRE_VERSIONS))} (give one or more, comma-separated)")
    return versions


def _port(text: str) -> int:
    """``--metrics-port``: 0 to 65535."""
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: a port number, 0 (any free port) to 65535")
    return int(text)


def node_compute(device: str | None, dtype: str | None, path: str, quantize: str | None = None):
    """``--device``, ``--dtype`` and ``--quantize`` for the model at ``path`` (``auto`` on an accelerator: the dtype
    the folder declares for the component holding the blocks), checked before anything loads."""
    import dataclasses

    from diffuse.plan.analysis import ModelSubject
    from diffuse.plan.devices import Compute, resolve_device
    from diffuse.plan.prequant import no_quantize_over_quantized
    from diffuse.plan.quantize import check_mode

    mode = check_mode(quantize, resolve_device(device))  # refused before the folder is read
    subject = ModelSubject.from_path(path)
    no_quantize_over_quantized(subject, mode)  # a GGUF denoiser, a checkpoint saved quantized
    compute = Compute.of(device, dtype, path, subject.denoiser or None)
    return dataclasses.replace(compute, quant=mode)


def _parser():
    """The node's command line."""
    from diffuse import flags

    ap = flags.Parser(prog="diffuse node", description=plain(__doc__.split("\n")[0]))
    ap.add_argument("--model", required=True, help="the model folder (the same one the client uses), a shipped "
                    "model's name, or a Hub id, ORG/NAME[@REVISION] (its configs, headers and this node's slice are "
                    "fetched)")
    ap.add_argument("--listen", default="tcp://127.0.0.1:0", help="control address to bind (port 0: pick one)")
    ap.add_argument("--blocks", help='the slice to hold: "2/3" (2nd of 3 even slices of every stack), "all", or '
                    '"blocks[0:20]"; default: load what each session asks for')
    ap.add_argument("--key-file", default=None,
                    help="long-term identity key, created (0600) if missing; default: node.key in $DIFFUSE_HOME "
                    "or ~/.config/diffuse (nodes sharing that folder share one identity: give each its own file)")
    ap.add_argument("--ephemeral-key", action="store_true", help="a fresh identity for this run only")
    ap.add_argument("--allow-client", action="append", default=None, metavar="HEXKEY",
                    type=functools.partial(flags.hex_key, what="client public key"),
                    help="serve only this client key (repeatable); a client shows its key when run with --client-key")
    ap.add_argument("--advertise-data", metavar="ADDR", help="data address peers should dial, if not the bound one")
    ap.add_argument("--wire", type=_wire, default=WIRE_VERSIONS, metavar="V[,V]",
                    help=f"the wire versions to speak (default {','.join(map(str, WIRE_VERSIONS))}; 1: hop keys sealed "
                    "to this node's long-term key; 2: agreed per session, forward secret)")
    ap.add_argument("--max-message-mb", type=flags.positive, default=None, metavar="MB",
                    help=f"the most one received data frame (one tensor) may hold; a peer sending more is cut off "
                    f"before it is buffered (default {DEFAULT_MAX_MESSAGE_BYTES >> 20})")
    ap.add_argument("--max-sessions", type=flags.positive, default=MAX_SESSIONS, metavar="N",
                    help=f"open sessions at once, in all (default {MAX_SESSIONS}; fewer if the open-file limit "
                    "leaves no room)")
    ap.add_argument("--max-sessions-per-client", type=flags.positive, default=MAX_SESSIONS_PER_CLIENT, metavar="N",
                    help=f"open sessions at once per client key (default {MAX_SESSIONS_PER_CLIENT})")
    ap.add_argument("--no-batch", action="store_true",
                    help="run every pass alone (default for a language model: decoding passes of several sessions "
                    "that wait together run through the layers as one batch)")
    ap.add_argument("--compile", action="store_true",
                    help="run the blocks through torch.compile (inductor; on CPU it needs a C compiler): each block "
                    "is compiled as it loads and traced at its first call of each shape. NOT EXACT: results differ "
                    "from plain diffusers/transformers in the last bits; without it a split is byte-identical")
    ap.add_argument("--max-memory", type=float, default=None, metavar="GIB",
                    help="the most this node's blocks and sessions may take, in GiB, as it tells clients planning "
                    "where slices go (default: what its cgroup or machine has available)")
    flags.device_flags(ap, "this node's blocks")
    flags.quantize_flag(ap, "this node's blocks")
    flags.encoders_flag(ap)
    flags.decoder_flag(ap, node=True)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (match the client for exact results)")
    ap.add_argument("--exit-with", type=int, metavar="PID", help="stop when process PID is gone (local nodes)")
    ap.add_argument("--log-level", default="INFO", help="DEBUG, INFO (default), WARNING or ERROR")
    from diffuse.plan.logs import add_flag

    add_flag(ap, "the node")
    ap.add_argument("--metrics-port", type=_port, default=None, metavar="PORT",
                    help="answer Prometheus scrapes at http://HOST:PORT/metrics, HOST that of --listen (127.0.0.1 "
                    "where it has none); 0: a free port, said in the ready line and in status (default: no port)")
    ap.add_argument("--announce", action="store_true", help="advertise this node on the local network (mDNS) while "
                    "it serves, for clients given --nodes auto; needs a --listen others reach, and diffuse[lan]")
    return ap


def main(argv: list[str] | None = None) -> int:
    from diffuse import flags

    a = _parser().parse_args(argv)
    flags.quiet_libraries()
    from diffuse.plan.logs import configure

    formatter = configure(a.log_level.upper(), a.log_format, "%(asctime)s node %(levelname)s %(message)s")
    from diffuse.home import libraries_offline

    libraries_offline()
    keep_freed_memory()
    if a.threads:
        torch.set_num_threads(a.threads)
    from diffuse.plan.resolve import resolve_model

    if a.compile and (why := compile_unavailable()):
        print(f"error: --compile: {why}", file=sys.stderr)
        return 2
    try:
        flags.check_port_free(a.listen)  # before anything loads
        metrics = None
        if a.metrics_port is not None:  # open from the start: a scraper sees the process while its blocks load
            from diffuse.node.metrics import MetricsPort

            metrics = MetricsPort(a.listen, a.metrics_port)
        path = resolve_model(a.model, "node")  # a Hub id: configs and headers; the slice comes as it loads
        compute = node_compute(a.device, a.dtype, path, a.quantize)  # a device or dtype this machine lacks: refused here
        lan = discovery.Announcer(a.listen) if a.announce else None  # the library there, an address others reach
        log.info("loading %s%s on %s", a.model, f" (blocks {a.blocks})" if a.blocks else "", compute.describe())
        key_file = None if a.ephemeral_key else (a.key_file or os.path.join(config_home(), "node.key"))
        node = Node(path, a.listen, a.blocks, key_file, NodeOptions(
            set(a.allow_client) if a.allow_client else None, a.advertise_data,
            a.max_message_mb << 20 if a.max_message_mb else None, a.max_sessions, a.max_sessions_per_client,
            batch=not a.no_batch, compute=compute, compiled=a.compile, encoders=a.encoders == "ring",
            decoders=a.decoder == "ring"))
    except (DiffuseError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    node.control.speaks = a.wire
    if hasattr(formatter, "fields"):  # json: every line says which node it comes from
        formatter.fields["node"] = node.endpoint.control_address
    if metrics is not None:
        from diffuse.plan.resolve import model_name

        metrics.watch(node, model_name(a.model, path))
    if a.max_memory is not None:
        if not a.max_memory > 0:
            print(f"error: --max-memory {a.max_memory}: give a positive number of GiB", file=sys.stderr)
            return 2
        node.max_memory = int(a.max_memory * (1 << 30))
    try:  # --blocks: the slice fetched (hello and status answered meanwhile, with how far it got) and loaded
        node.hold_slice()
    except (DiffuseError, OSError) as exc:
        node.endpoint.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"diffuse_node": max(a.wire), "wire": list(a.wire), "address": node.endpoint.control_address,
                      "data": node.endpoint.address, "key": node.identity.public_hex,
                      **({"metrics": node.metrics_url} if node.metrics_url else {})}), flush=True)
    log.info("serving %s at %s, key %s, wire versions %s", a.model, node.endpoint.control_address,
             node.identity.public_hex, ",".join(map(str, a.wire)))
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    signal.signal(signal.SIGINT, _stopping)
    try:
        with discovery.announced(lan, node, a.model, a.wire):  # withdrawn on the way out
            node.serve(parent=a.exit_with)
    except KeyboardInterrupt:
        pass
    finally:
        node.endpoint.close()
    log.info("stopped")
    return 0


def _stopping(*_) -> None:
    """Ctrl-C: say so at once (the compute thread may take a moment to finish its pass), then stop."""
    log.info("stopping (interrupted)")
    raise KeyboardInterrupt
