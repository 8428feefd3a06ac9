"""``diffuse serve``: models kept warm on a ring of nodes, answering on an OpenAI-compatible HTTP API, with a
page at ``/`` to chat and generate.

    diffuse serve                                   # the shipped models, 2 local nodes each, on 127.0.0.1:8000
    diffuse serve --model /models/wan --nodes tcp://h1:7000#K1,tcp://h2:7000#K2 --model /models/qwen ...

Each ``--model`` is loaded once (its client ends: text encoder, VAE, tokenizer, embeddings); its nodes are
started here (``--local-nodes N``) or listed (``--nodes``, one per ``--model``, in the same order). Every
request is its own session on the nodes, so concurrent chats batch there; diffusion requests take turns.
Loopback only unless ``--api-key`` is given (every ``/v1`` request then sends ``Authorization: Bearer KEY``).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, fields

from diffuse.home import libraries_offline  # noqa: E402

libraries_offline()

from diffuse.errors import DiffuseError  # noqa: E402

LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def build_parser() -> argparse.ArgumentParser:
    from diffuse.flags import Parser, positive, seconds

    ap = Parser(prog="diffuse serve", description="Serve models split over a ring of nodes on an "
                "OpenAI-compatible HTTP API (chat, completions, images, video jobs, transcription, speech), "
                "with a page at / to chat and generate.")
    ap.add_argument("--model", action="append", default=[], metavar="M",
                    help="a model folder, a shipped model's name or a Hub id, ORG/NAME[@REVISION], fetched as it runs "
                    "and served by that name (repeatable; default: the shipped models, tiny-wan-shapes and "
                    "tiny-qwen-chat)")
    ap.add_argument("--nodes", action="append", default=[], metavar="ADDR,...",
                    help="the nodes of one --model (repeatable, in the order of --model), each address "
                    "optionally #HEXKEY, or auto (the nodes announced on the local network that serve it); without "
                    "it each model gets --local-nodes nodes started here")
    ap.add_argument("--discover-seconds", type=seconds, default=None, metavar="S",
                    help="with --nodes auto: how long to listen for announced nodes (default 3)")
    ap.add_argument("--local-nodes", type=positive, default=2, metavar="N",
                    help="nodes started here for each model given no --nodes (default 2)")
    ap.add_argument("--node-metrics-port", type=int, default=None, metavar="PORT",
                    help="local nodes answer Prometheus scrapes (--metrics-port), the first at PORT, the next at "
                    "PORT+1, ...; 0: each at a free port (GET /health says where)")
    ap.add_argument("--listen", default="127.0.0.1:8000", metavar="HOST:PORT",
                    help="where to answer (default 127.0.0.1:8000; anything but loopback needs --api-key)")
    ap.add_argument("--api-key", default=os.environ.get("DIFFUSE_API_KEY"), metavar="KEY",
                    help="a bearer token every /v1 request must send (default: $DIFFUSE_API_KEY)")
    ap.add_argument("--parallel", type=positive, default=8, metavar="N",
                    help="requests a language model answers at once, each its own session (default 8); a "
                    "diffusion model answers one at a time")
    ap.add_argument("--max-waiting", type=positive, default=32, metavar="N",
                    help="requests that may wait for a model; beyond, 429 with Retry-After (default 32)")
    ap.add_argument("--max-body-mb", type=positive, default=32, metavar="MB",
                    help="largest request body accepted (default 32 MiB)")
    ap.add_argument("--max-tokens", type=positive, default=256, metavar="N",
                    help="new tokens per answer when a request does not say and the model's generation config sets "
                    "no max_new_tokens (default 256)")
    ap.add_argument("--threads", type=positive, help="torch threads here and on local nodes")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one pass through the ring may take")
    ap.add_argument("--client-key", metavar="FILE", help="this service's long-term identity as a client of the "
                    "nodes (for nodes run with --allow-client)")
    ap.add_argument("--local-transport", default="tcp", metavar="SCHEME", help="URL scheme of local nodes")
    ap.add_argument("--quiet", action="store_true", help="no line per request")
    from diffuse.plan.logs import add_flag

    add_flag(ap, "the service and its local nodes")
    from diffuse.flags import decoder_flag, device_flags, encoders_flag, speculate_flags

    device_flags(ap)
    encoders_flag(ap)  # for every pipeline served; its local nodes are started so
    decoder_flag(ap)  # ... and its VAE, on the node named (each request's session opens with it there)
    speculate_flags(ap)  # for every language model served (an assistant must share its tokenizer)
    return ap


def default_models() -> list[str]:
    from diffuse.plan.shipped import TRAINED

    names = ["tiny-wan-shapes", "tiny-qwen-chat"]
    return [n for n in names if (TRAINED / n).is_dir()]


@dataclass
class ServeOptions:
    """The service's settings, as ``diffuse serve``'s flags of the same names give them."""

    local_nodes: int = 2
    parallel: int = 8
    max_waiting: int = 32
    max_tokens: int = 256
    threads: int | None = None
    timeout: float = 300.0
    client_key: str | None = None
    local_transport: str = "tcp"
    api_key: str | None = None
    node_metrics_port: int | None = None
    log_format: str = "text"
    speculate: str = "auto"
    draft_tokens: int | None = None
    encoders: str | None = None  # "ring": every pipeline's text encoders' layers on the nodes (diffuse.plan.encoders)
    decoder: str | None = None  # every pipeline's VAE on a node: "ring" (the last) or one named (diffuse.plan.decoders)
    decoder_tiling: str | None = None  # ... decoding in tiles: "on", "off" or "auto"

    @classmethod
    def of(cls, a: argparse.Namespace) -> "ServeOptions":
        return cls(**{f.name: getattr(a, f.name) for f in fields(cls)})


def analyse(models: list[str], nodes: list[str], say, encoders: str | None = None,
            decoder: str | None = None) -> tuple[list, list[str]]:
    """Every model analysed (its refusals, before any node starts; ``encoders``: ``--encoders``, ``decoder``:
    ``--decoder``) and its name; the counts and node lists checked against the models."""
    from diffuse.plan.decoders import check_decoder
    from diffuse.plan.encoders import check_encoders

    from diffuse.client.api import ModelInfo
    from diffuse.client.known_nodes import parse_nodes
    from diffuse.plan.resolve import model_name

    if not models:
        raise DiffuseError("no --model given and no shipped model found: reinstall diffuse or give --model")
    if nodes and len(nodes) != len(models):
        raise DiffuseError(f"--nodes given {len(nodes)} time(s) for {len(models)} --model(s): give one --nodes "
                           "per --model, in the same order, or none (local nodes for every model)")
    for spec in nodes:
        parse_nodes(spec)  # address and key mistakes, before anything loads
    infos = []
    for m in models:
        say(f"analysing {m}")
        infos.append(ModelInfo.of(m, encoders=check_encoders(encoders), decoders=check_decoder(decoder) is not None))
    names = [model_name(m, i.path) for m, i in zip(models, infos)]  # a Hub id by its id, not its commit's folder
    if len(set(names)) != len(names):
        raise DiffuseError(f"two models share a name ({', '.join(names)}): give folders with different names")
    return infos, names


def load_engines(names: list[str], infos: list, split_options: dict, opts: ServeOptions, say) -> dict:
    """An engine per model, each with one warm copy of its client ends (so the first request pays no loading);
    their nodes are set once they are up."""
    from diffuse.serve.language import LanguageEngine
    from diffuse.serve.pipeline import PipelineEngine

    engines: dict = {}
    started = int(time.time())
    for name, info in zip(names, infos):
        if info.subject.autoregressive:
            from diffuse.lm.client_drafts import drafting_for

            drafting = drafting_for(opts.speculate, opts.draft_tokens, info.path)  # an assistant loads once, here
            e = LanguageEngine(name, info, None, dict(split_options, speculate=drafting), started, opts.parallel,
                               opts.max_waiting, opts.max_tokens)
        else:
            placed = dict(decoder=opts.decoder, decoder_tiling=opts.decoder_tiling) if info.decoders else {}
            e = PipelineEngine(name, info, None, dict(split_options, **placed), started, 1, opts.max_waiting)
        engines[name] = e
        say(f"loading {name}'s client ends ({e.kind})")
        e.pool.prewarm()
    return engines


class Service:
    """What one ``diffuse serve`` holds: the engines by model name, their nodes, the video jobs."""

    def __init__(self, engines: dict, api_key: str | None, version: str):
        from diffuse.serve.jobs import Jobs

        self.engines = engines
        self.api_key = api_key
        self.version = version
        self.jobs = Jobs()
        self.started = time.time()
        from diffuse.serve.metrics import service_registry

        self.registry = service_registry(self)  # its own, never the library's global one: GET /metrics

    @classmethod
    def start(cls, models: list[str], nodes: list[str], opts: "ServeOptions | None" = None,
              say=print) -> "Service":
        """Load each model's client ends, start or dial its nodes (one ``--nodes`` per model, or none: local
        nodes for each), and make one warm copy of each; ``say`` gets a line per phase."""
        import torch

        opts = opts or ServeOptions()
        if opts.threads:
            torch.set_num_threads(opts.threads)
        infos, names = analyse(models or default_models(), nodes, say, opts.encoders, opts.decoder)
        keys, client_key = None, opts.client_key
        if client_key is None:  # one identity for every request; local nodes serve it alone
            import tempfile

            keys = tempfile.TemporaryDirectory(prefix="diffuse-serve-key-")
            client_key = os.path.join(keys.name, "client.key")
        from diffuse.wire.sealing import load_identity

        identity = load_identity(client_key)
        node_sets: list = [None] * len(infos)
        failed: list = []

        def start_nodes():  # nodes come up (and load their blocks) while the client ends load here
            try:
                port = opts.node_metrics_port
                for k, info in enumerate(infos):
                    node_sets[k] = cls._nodes(info, nodes[k] if nodes else None, opts, identity, say, port)
                    port = port + len(node_sets[k].specs) if port else port  # 0: each its own free one
            except BaseException as exc:
                failed.append(exc)

        if not nodes:
            from diffuse.local.nodes import warm_launcher

            warm_launcher()
        starter = threading.Thread(target=start_nodes, name="start-nodes", daemon=True)
        starter.start()
        try:
            engines = load_engines(names, infos, dict(timeout=opts.timeout, client_key=client_key), opts, say)
            starter.join()
            if failed:
                raise failed[0]
            for e, node_set in zip(engines.values(), node_sets):
                e.nodes = node_set
        except BaseException:
            starter.join()
            for node_set in node_sets:
                if node_set is not None:
                    node_set.stop()
            raise
        from diffuse import __version__

        service = cls(engines, opts.api_key, __version__)
        service._keys = keys
        return service

    @staticmethod
    def _nodes(info, spec, opts: "ServeOptions", identity, say, metrics_port: int | None = None):
        from diffuse.serve.engines import NodeSet

        if spec is not None:
            return NodeSet([s.strip() for s in spec.split(",") if s.strip()])
        from diffuse.local.nodes import plan_local_nodes
        from diffuse.local.nodes import start_local_nodes

        plan = plan_local_nodes(opts.local_nodes, info.draft["stacks"], 1, opts.threads)
        for note in plan.notes:
            say(note)
        from diffuse.plan.fetching import hub_folder

        name = (hub_folder(info.path) or {}).get("repo") or os.path.basename(os.path.normpath(info.path))
        say(f"starting {plan.count} local node{'s' if plan.count > 1 else ''} for {name}")
        each = None if metrics_port is None else \
            [["--metrics-port", str(metrics_port + i if metrics_port else 0)] for i in range(plan.count)]
        local = start_local_nodes(info.path, plan.count, plan.threads, scheme=opts.local_transport, client=identity,
                                  each=each, extra=["--log-format", opts.log_format,
                                                    *(["--encoders", "ring"] if info.encoders else []),
                                                    *(["--decoder", "ring"] if info.decoders else [])])
        return NodeSet([f"{n.address}#{n.key}" for n in local], local)

    _keys = None  # the folder of a key made for this service alone

    def stop(self) -> None:
        self.jobs.stop()
        for e in self.engines.values():
            e.nodes.stop()
        if self._keys is not None:
            self._keys.cleanup()


def lan_nodes(models: list[str], nodes: list[str], seconds: float | None, say) -> list[str]:
    """Each ``--nodes auto`` replaced by the nodes announced on the local network that serve its ``--model``
    (one listening window for all; ``diffuse.wire.discovery``). Counts that do not match are left for
    ``Service.start`` to refuse."""
    if "auto" not in nodes and seconds is not None:
        raise DiffuseError("--discover-seconds applies with --nodes auto")
    if "auto" not in nodes or len(nodes) != len(models):
        return nodes
    from diffuse.plan.analysis import ModelSubject
    from diffuse.client.lan import nodes_on_lan
    from diffuse.plan.resolve import resolve_model

    auto = [k for k, spec in enumerate(nodes) if spec == "auto"]
    found = nodes_on_lan([ModelSubject.from_path(resolve_model(models[k], "headers")).content_hash() for k in auto], seconds,
                         say)
    nodes = list(nodes)
    for k, spec in zip(auto, found):
        nodes[k] = spec
    return nodes


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise DiffuseError(f"--listen {text!r}: expected HOST:PORT, e.g. 127.0.0.1:8000")
    return host.strip("[]") or "127.0.0.1", int(port)


def main(argv: list[str] | None = None) -> int:
    from diffuse.cli import command
    from diffuse.cli import parsing
    from diffuse import flags
    from diffuse.client import progress

    out = progress.console()
    a = build_parser().parse_args(argv)
    service = None

    def say(line: str) -> None:
        progress.status(out, line)

    def body() -> None:
        nonlocal service
        parsing.check_device_flags(a)  # then the default of every load here and of the local nodes (diffuse.plan.devices)
        os.environ.update({k: v for k, v in (("DIFFUSE_DEVICE", a.device), ("DIFFUSE_DTYPE", a.dtype)) if v})
        host, port = parse_listen(a.listen)
        if host not in LOOPBACK and not a.api_key:
            raise DiffuseError(f"--listen {a.listen}: beyond loopback the service needs --api-key KEY (or "
                               "$DIFFUSE_API_KEY), which every request then sends as a bearer token")
        flags.check_port_free(f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}")
        parsing.check_speculate(a)
        if a.node_metrics_port is not None and (a.nodes or not 0 <= a.node_metrics_port < 65536):
            raise DiffuseError(f"--node-metrics-port {a.node_metrics_port}: a port (0: any free one) for the nodes "
                               "started here; nodes given with --nodes open their own (diffuse node --metrics-port)")
        a.nodes = lan_nodes(a.model, a.nodes, a.discover_seconds, say)  # --nodes auto
        with progress.phase(out, "starting: models analysed and loaded, nodes started"):
            service = Service.start(a.model, a.nodes, ServeOptions.of(a), say)
        serve(service, host, port, a.max_body_mb << 20, quiet=a.quiet, say=say, log_format=a.log_format)

    try:
        return parsing.run_guarded(body, out, interrupted="stopped")
    finally:
        if service is not None:
            service.stop()


def serve(service: Service, host: str, port: int, max_body: int, quiet: bool = False, say=print,
          log_format: str = "text") -> None:
    import uvicorn

    from diffuse.plan.logs import configure
    from diffuse.serve.app import BodyLimit, make_app

    configure(logging.WARNING if quiet else logging.INFO, log_format, "%(asctime)s %(message)s", "%H:%M:%S")
    logging.getLogger("diffuse.serve").setLevel(logging.WARNING if quiet else logging.INFO)
    app = BodyLimit(make_app(service), max_body)
    shown = f"[{host}]" if ":" in host else host
    for e in service.engines.values():
        say(f"  {e.name}: {e.kind}, nodes {', '.join(s.split('#')[0] for s in e.nodes.specs)}")
    # the port is bound and listening before the line says so: a client that reads it and connects at once waits
    # in the backlog until the server takes it, never finds the port closed
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise DiffuseError(f"--listen {host}:{port}: cannot listen there ({exc.strerror or exc})") from None
    sock.listen(2048)
    say(f"serving on http://{shown}:{port}  (page at /, API at /v1, health at /health; Ctrl-C stops)")
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2)
    uvicorn.Server(config).run(sockets=[sock])
