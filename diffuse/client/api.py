"""The Python API, and the one place a split run is assembled.

    import diffuse
    pipe = diffuse.from_pretrained("path/to/wan")      # the pipeline without the blocks nodes will hold
    with diffuse.split(pipe, local_nodes=2) as ring:   # or nodes=["tcp://h1:7000#KEY", ...], patches=P
        frames = pipe(prompt="a paper boat", generator=torch.Generator("cpu").manual_seed(7)).frames
    print(ring.stats)                                  # passes, bytes, per-node busy time

Inside ``split`` the pipeline's own ``__call__`` runs unchanged; its block stacks
are stand-ins that ship hidden states through the ring. ``split`` also takes a
pipeline loaded by diffusers' own ``from_pretrained`` (it frees the blocks it
hands out), or a denoiser alone with ``model=`` naming its pipeline folder. The
CLI, ``diffuse verify``, the benchmarks and the tests all go through here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from diffuse.errors import DiffuseError
from diffuse.client.decoders import DecoderPlace
from diffuse.client.modelinfo import MODEL_DEFAULTS_FILE, ModelInfo, model_info  # noqa: F401  (found here too)
from diffuse.client.readout import SplitReadout
from diffuse.client.request import check_options  # the split's rules, shared with the command line's flags

def from_pretrained(model: str | None = None, device: str | None = None, dtype: str | None = None,
                    quantize_client: str | None = None, encoders: str | None = None, decoder: str | None = None,
                    local_nodes: bool = False):
    """The pipeline at ``model`` (a folder, a shipped model's name, a Hub id ``ORG/NAME[@REVISION]``, fetched as
    far as the client needs; None: the embedded model), loaded by diffusers from safetensors without the blocks the nodes will hold;
    or a transformers model (a folder whose config.json names its architectures), loaded by
    transformers (its decoder layers are freed when it is split). ``device`` and ``dtype`` as the
    command line's ``--device`` and ``--dtype`` (``diffuse.plan.devices``; default ``auto``: the CPU, or the
    first accelerator torch sees, in what the folder declares there): where the client's ends compute.
    ``quantize_client``: its own linear layers held quantized, as ``--quantize-client`` holds them.
    ``encoders``: "ring" leaves the blocks of the pipeline's text encoders to nodes too (``diffuse.plan.encoders``;
    default "client": loaded whole here). ``decoder``: anything but "client" leaves the VAE's weights to the node
    ``diffuse.split`` names (``diffuse.plan.decoders``), never loaded here. ``local_nodes``: the nodes will run
    here too (``diffuse.split(pipe, local_nodes=N)``), so a Hub model is fetched whole now, the room for all of it
    checked once before its first tensor byte (as ``diffuse query`` with local nodes does), not the client's part
    now and the rest as the nodes start."""
    from diffuse.plan.decoders import check_decoder
    from diffuse.plan.encoders import check_encoders
    from diffuse.plan.quantize import check_mode, quantize_ends

    info = ModelInfo.of(model, "whole" if local_nodes else "client", encoders=check_encoders(encoders),
                        decoders=check_decoder(decoder) is not None)
    pipe = load_whole_or_shell(info, client_compute(info, device, dtype), shell=True)
    quantize_ends(pipe, info.draft["stacks"], check_mode(quantize_client), info.subject.denoisers, info.subject.several)
    return pipe


def client_compute(info: "ModelInfo", device: str | None, dtype: str | None):
    """``--device`` and ``--dtype`` of a client of the model ``info`` describes (``diffuse.plan.devices.Compute``)."""
    from diffuse.plan.devices import Compute

    return Compute.of(device, dtype, info.path, info.subject.denoiser or None)


def load_whole_or_shell(info: "ModelInfo", compute, shell: bool, quantize: str = ""):
    """The model in ``compute``'s dtype on its device: without the blocks nodes will hold (``shell``), or whole
    (the reference a split run is compared with; with ``quantize``, its blocks held as nodes started with
    ``--quantize`` hold theirs). On the CPU in no named dtype: exactly the plain load. It
    carries ``info`` (``_diffuse``), so that splitting it, checking its call and reporting on it read no folder
    again (``model_info``)."""
    from diffuse.plan.devices import place
    from diffuse.plan.fetching import partial_folder
    from diffuse.plan.hubmodel import complete_model
    from diffuse.plan.prequant import no_quantize_over_quantized
    from diffuse.plan.bnbread import release_to_meta
    from diffuse.plan.planner import load_model, load_pipeline

    no_quantize_over_quantized(info.subject, quantize)  # a GGUF denoiser or a checkpoint saved quantized
    if not shell:
        complete_model(info.path)  # a Hub model's folder, as a client holds it: the nodes' blocks too
    if info.subject.autoregressive:
        pipe = load_model(info.path, info.subject, compute.dtype)
        if shell and partial_folder(info.path):  # the blocks nodes hold were not fetched here: never to be run
            for st in info.draft["stacks"]:
                for block in list(pipe.get_submodule(st.path))[1:]:
                    release_to_meta(block)
        pipe = place(pipe, compute.device)
    else:
        pipe = load_pipeline(info.path, info.subject, info.draft["stacks"] if shell else None, compute.dtype)
        for part in pipe.components.values():
            if hasattr(part, "_apply"):
                place(part, compute.device)
    if quantize and not shell:
        from diffuse.plan.quantize import quantize_blocks, within

        for name in (info.subject.denoisers if info.subject.several else [info.subject.denoiser]):
            target = pipe if info.subject.autoregressive else getattr(pipe, name)
            quantize_blocks(target, within(info.draft["stacks"], name, info.subject.several), quantize)
    pipe._diffuse = info
    return pipe


@dataclass
class SplitOptions:
    """How a ``Split`` runs: every option of ``diffuse.split`` but the model and its nodes (described there)."""

    local_nodes: int | None = None
    patches: int = 1
    threads: int | None = None
    timeout: float = 300.0
    client_key: str | None = None
    attention: str = "auto"
    local_transport: str = "tcp"
    model: str | None = None
    started: object = None  # local nodes already started by the caller (a diffuse.local.nodes.LocalNodes)
    branch_groups: int = 1
    cache_threshold: float = 0.0
    ahead: bool = True
    repair: object = None  # a diffuse.client.repair.RepairPolicy; None: the default policy
    embedding_on_node: bool = False
    placement: str = "planned"
    device: str | None = None
    dtype: str | None = None
    discover_seconds: float | None = None  # with nodes="auto": how long to listen (default 3)
    quantize: str | None = None  # the nodes' blocks held quantized (diffuse.plan.quantize): int8, int4, fp8
    request_id: str | None = None  # told to every node at the open, which logs it (diffuse.plan.logs)
    speculate: object = "auto"  # a language model's drafter: "lookup", an assistant (diffuse.lm.client_drafts)
    draft_tokens: int | None = None  # the most tokens one pass verifies (default 8)
    encoders: str | None = None  # "ring": the pipeline's encoders' stacks on the nodes too; None: as it was loaded
    decoder: str | None = None  # the VAE on a node: "ring" (the last) or one named; "client"; None: as it was loaded
    decoder_tiling: str | None = None  # "on", "off" or "auto" (None): the VAE's node decodes in tiles


class Split(SplitReadout):
    """A pipeline (or denoiser) split over a ring for the duration of a ``with`` block. Options come as a
    ``SplitOptions``, as keywords (``Split(pipe, nodes, patches=2)``), or both (the keywords win)."""

    def __init__(self, pipe_or_model, nodes=None, options: SplitOptions | None = None, **named):
        from diffuse.client.branches import parse_groups
        from diffuse.client.lan import auto_nodes, check_auto
        from diffuse.client.repair import RepairPolicy
        from diffuse.client.known_nodes import parse_nodes
        from diffuse.local.nodes import local_nodes_plan
        from diffuse.client.routing import PLACEMENTS

        o = replace(options or SplitOptions(), **named)
        check_auto(nodes, o.discover_seconds)
        if o.placement not in PLACEMENTS:
            raise DiffuseError(f"--placement {o.placement}: choose {' or '.join(PLACEMENTS)}")
        self.placement = o.placement
        self.target = pipe_or_model
        from diffuse.plan.decoders import check_decoder
        from diffuse.plan.encoders import check_encoders

        self.info = model_info(pipe_or_model, o.model, None if o.encoders is None else check_encoders(o.encoders),
                               None if o.decoder is None else check_decoder(o.decoder) is not None,
                               "whole" if nodes is None else "client")  # local nodes: all of it, one room check
        listed = None if nodes in (None, "auto") else parse_groups(nodes) if isinstance(nodes, str) and ";" in nodes \
            else nodes if nodes and all(isinstance(g, list) for g in nodes) else [nodes]
        self.branch_groups = len(listed) if listed and len(listed) > 1 else o.branch_groups
        self.cache_threshold = check_options(o.patches, nodes is not None, o.local_nodes, self.branch_groups,
                                             o.cache_threshold, self.info.subject.autoregressive)  # before listening
        self.discovered: list[str] = []  # with nodes="auto": what was heard, a line a node
        if nodes == "auto":
            listed = [auto_nodes(self.info.subject.content_hash(), o.discover_seconds, self.discovered)]
        groups = None if listed is None else [parse_nodes(g) for g in listed]
        self.groups = None  # node lists, one per group of branches, when there are several
        if groups is not None:
            if o.branch_groups not in (1, len(groups)):
                raise DiffuseError(f"--branch-groups {o.branch_groups}, but --nodes lists {len(groups)} group(s) "
                                   "(separate groups with ';')")
            self.nodes = [n for g in groups for n in g]
            self.groups = groups if len(groups) > 1 else None
        else:
            self.nodes = None
        asked = o.local_nodes if o.local_nodes is not None else 2 * o.branch_groups
        self.local = None if nodes is not None else local_nodes_plan(
            asked // o.branch_groups, self.info.draft["stacks"], o.patches, o.threads, o.branch_groups)
        self.decoder = DecoderPlace.of(o.decoder, o.decoder_tiling, self.info, self.nodes, self.local,
                                       self.branch_groups, getattr(pipe_or_model, "_diffuse", None))  # before any starts
        self.decoder_calls = None  # the VAE's stand-ins, while split (diffuse.client.decoders)
        self.patches, self.timeout, self.client_key = o.patches, o.timeout, o.client_key
        self.ahead = o.ahead  # with patches, the next guidance branch's call sent while this one finishes
        self.repair = o.repair if o.repair is not None else RepairPolicy()  # one for all of this split's rings
        self.repair.placement = o.placement  # where nodes that hold nothing fixed get their slices
        self.repair.depth = max(1, o.patches)  # ... planned for this many passes in flight at once
        self.embedding_on_node = o.embedding_on_node
        self.node_device, self.node_dtype = o.device, o.dtype  # local nodes' --device and --dtype (None: as the client)
        if o.device is not None or o.dtype is not None:
            from diffuse.plan.devices import resolve_device, resolve_dtype

            resolve_device(o.device)  # refused here, before any node starts
            if o.dtype not in (None, "auto"):
                resolve_dtype(o.dtype, resolve_device(o.device), None)
        from diffuse.plan.devices import resolve_device
        from diffuse.plan.prequant import no_quantize_over_quantized
        from diffuse.plan.quantize import check_mode

        # refused here, before any node starts: the mode, its library, the local nodes' device
        self.quantize = check_mode(o.quantize, resolve_device(o.device) if nodes is None else None)
        no_quantize_over_quantized(self.info.subject, self.quantize)
        self.drafting = None  # drafts verified by the ring (diffuse.lm.client_drafts), checked before any node starts
        if self.info.subject.autoregressive:
            from diffuse.lm.client_drafts import drafting_for

            self.drafting = drafting_for(o.speculate, o.draft_tokens, self.info.path)
        elif o.speculate not in (None, "off", "auto") or o.draft_tokens is not None:
            raise DiffuseError("--speculate and --draft-tokens are for language models; this is a diffusion pipeline")
        self.attention, self.local_transport, self.started = o.attention, o.local_transport, o.started
        self.request_id = o.request_id  # a request id that is not short and plain is dropped (Handshake)
        self.local_nodes = self.ring = None
        self._rings: list = []
        self.splitter = None
        self.patcher = None
        self.stats = None

    @property
    def denoiser(self):
        """The module whose stacks are split: the pipeline's denoiser, or, where several components hold stacks
        (Wan 2.2's two experts), one ``Denoisers`` holding the pipeline's own, made once per pipeline."""
        subject = self.info.subject
        if not hasattr(self.target, "components"):
            return self.target
        if not subject.several:
            return getattr(self.target, subject.denoiser)
        held = self.target.__dict__.get("_diffuse_denoisers")
        if held is None or list(held.parts) != list(subject.denoisers) or any(
                held.part(n) is not getattr(self.target, n) for n in subject.denoisers):
            from diffuse.plan.analysis import denoisers_class

            held = denoisers_class()({n: getattr(self.target, n) for n in subject.denoisers}, subject.decoders)
            self.target.__dict__["_diffuse_denoisers"] = held
        return held

    @property
    def plan(self):
        return self.ring.plan if self.ring is not None else None

    def start_local_nodes(self):
        """This run's own nodes, which serve this run's client identity only."""
        from diffuse.local.nodes import start_local_nodes
        from diffuse.wire.sealing import load_identity

        return start_local_nodes(self.info.path, self.local.count, self.local.threads, scheme=self.local_transport,
                                 client=load_identity(self.client_key), extra=self.local_node_flags(),
                                 groups=self.branch_groups)

    def local_node_flags(self) -> list[str]:
        """``--device`` and ``--dtype`` for this run's local nodes: as given to ``split``, else where the client's
        own part of the denoiser computes and in its dtype (a float32 client on the CPU names no dtype: its
        nodes compute in what each session asks, as before devices were named)."""
        from diffuse.plan.devices import device_of
        from diffuse.plan.planner import denoiser_dtype

        device = self.node_device if self.node_device not in (None, "auto") else None
        if device is None:
            found = device_of(p for p in self.denoiser.parameters())
            device = str(found) if found is not None else "cpu"
        dtype = self.node_dtype if self.node_dtype not in (None, "auto") else denoiser_dtype(self.denoiser)
        held = ["--quantize", self.quantize] if self.quantize else []
        held += ["--encoders", "ring"] if self.info.encoders else []
        held += ["--decoder", "ring"] if self.info.decoders else []
        if device == "cpu" and dtype == "float32" and self.node_dtype in (None, "auto"):
            return ["--device", "cpu", *held]  # in the dtype each session asks, as before devices were named
        return ["--device", device, "--dtype", dtype, *held]

    def __enter__(self) -> "Split":
        from diffuse.plan.planner import denoiser_dtype, make_plan
        from diffuse.client.ring import Ring
        from diffuse.client.standin import Splitter
        from diffuse.client.decoders import DecoderCalls, decoders_of
        from diffuse.plan.decoders import decoder_stacks
        from diffuse.plan.encoders import encoder_stacks

        try:
            if self.nodes is None:
                self.local_nodes = self.started or self.start_local_nodes()
                self.nodes = [(n.address, n.key) for n in self.local_nodes]
                if self.branch_groups > 1:
                    per = len(self.nodes) // self.branch_groups
                    self.groups = [self.nodes[k * per:(k + 1) * per] for k in range(self.branch_groups)]
            denoiser = self.denoiser
            if self.decoder is not None:  # the VAE's block goes to the node named
                self.repair.decoder = self.decoder.pin(self.nodes, decoder_stacks(self.info.draft["stacks"],
                                                                                  self.info.subject))
            rings = self._rings = []  # closed on the way out, however far this gets
            for group in self.groups or [self.nodes]:
                plan = make_plan(self.info.subject, self.info.draft, [a for a, _ in group], [k for _, k in group],
                                 denoiser_dtype(denoiser), self.quantize)
                rings.append(Ring(plan, self.timeout, self.attention, self.client_key, repair=self.repair,
                                  identity=getattr(self.local_nodes, "client", None), request_id=self.request_id))
                rings[-1].open()
            if len(rings) > 1:
                from diffuse.client.branches import BranchRings

                self.ring = BranchRings(rings)
            else:
                self.ring = rings[0]
            self.splitter = Splitter.on(denoiser, self.ring.plan, self.embedding_on_node)
            self.splitter.encoders.paths = frozenset(encoder_stacks(self.ring.plan.stacks, self.info.subject))
            self.splitter.drafting = self.drafting
            self.splitter.attach(self.ring, self.patches, self.cache_threshold, self.ahead)
            if self.decoder is not None:  # the VAE's decode and encode answered by its node
                self.decoder_calls = DecoderCalls(self.splitter, decoders_of(self.target, self.info),
                                                  self.decoder.tiling, self.repair.decoder, self.ring.say)
                self.decoder_calls.install(self.splitter.changes)
        except BaseException:
            self._close(hurry=True)
            raise
        return self

    def __exit__(self, kind, *_) -> None:
        self._close(hurry=kind is not None)  # after a failure, a dead node is not waited for

    def _close(self, hurry: bool = False) -> None:
        try:
            if self.splitter is not None:
                self.patcher = self.splitter.patcher  # what it did stays readable after the ring is gone
                self.splitter.detach()
            for ring in self._rings:
                # local nodes end with their sessions; remote ones are told, briefly when in a hurry
                ring.close(hurry, tell_nodes=not (hurry and self.local_nodes is not None))
            if self.ring is not None:
                self.stats = self.ring.stats
        finally:
            if self.local_nodes is not None:
                self.local_nodes.stop(hurry)
                self.local_nodes = None


def split(pipe_or_model, nodes=None, local_nodes: int | None = None, patches: int = 1, **options) -> Split:
    """Split ``pipe_or_model`` over ``nodes`` (addresses, each optionally ``#KEY``; ``"auto"``: the nodes
    announced on the local network that serve the model, heard for ``discover_seconds``, default 3, as
    ``--nodes auto`` finds them, ``diffuse.wire.discovery``, needing ``diffuse[lan]``; ``split.discovered`` holds
    what was heard) or over ``local_nodes`` started here (default 2); a context manager. ``patches > 1``: PipeFusion.
    ``nodes`` as ``"A,B;C,D"`` (or a list of lists) forms groups, each a whole ring; a model's guidance
    branches then run side by side, one group each (``diffuse.client.branches``); with local nodes,
    ``branch_groups=G`` shares them out. ``cache_threshold=T`` (> 0): the first-block cache skips steps whose
    first block changes less than T (``diffuse.firstblock``; ``split.cache_skipped`` counts them). Options:
    ``threads`` (local nodes' torch threads; default: the client's at one patch, which keeps the bits of a whole run), ``timeout`` (seconds for one pass),
    ``client_key``, ``attention``, ``local_transport``, ``model`` (the pipeline folder, when it cannot be
    told), ``ahead`` (with patches, send the next guidance branch's call while this one finishes; default
    True), ``repair`` (a ``diffuse.client.repair.RepairPolicy``: how a failed node is replaced; default: the
    first usable holder of its range, the failed node avoided 30 s, doubling, then used again),
    ``embedding_on_node`` (a language model's embedding table on the first node, so passes carry token ids
    instead of hidden states; default False: the client embeds), ``placement`` ("planned": nodes that hold
    nothing fixed get slices planned from their memory and speed, ``diffuse.plan.placement``; "even": even slices,
    still checked against their memory; set on the repair policy, which also repairs by it), ``device`` and
    ``dtype`` (the local nodes' ``--device`` and ``--dtype``; default: the device the client's part of the model
    is on, in its dtype; on the CPU the nodes compute in the dtype each session asks), ``quantize`` ("int8",
    "int4" or "fp8": the nodes hold their blocks' linear weights quantized by torchao, ``diffuse.plan.quantize``;
    local nodes are started so, and a node holding another mode refuses the open), ``speculate`` ("lookup", an
    assistant model or its folder or Hub id: a language model's ``generate`` drafts tokens that one pass verifies,
    ``diffuse.lm.client_drafts``; ``draft_tokens``: at most that many a pass, default 8), ``encoders`` ("ring": the
    pipeline's text encoders' layers on the nodes too, ``diffuse.plan.encoders``; "client": here; default: as the
    pipeline was loaded), ``decoder`` (the VAE's decode and encode on one node, which sees the result: "ring", the
    route's last, or a node's place in ``nodes`` ("1", "2", ...) or its address; "client"; default: the ring's last
    where ``from_pretrained(..., decoder=...)`` loaded it so, else here; ``diffuse.plan.decoders``) and
    ``decoder_tiling`` ("on", "off", "auto": as the pipeline's VAE is set, and tiled where the node is short of
    room)."""
    return Split(pipe_or_model, nodes=nodes, local_nodes=local_nodes, patches=patches, **options)
