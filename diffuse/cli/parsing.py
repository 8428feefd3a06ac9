"""The flags of ``diffuse query`` and ``diffuse chat``, every flag check before anything loads, the typed request built from them once, and the error reporter every subcommand runs under."""

from __future__ import annotations

import argparse
import os

from diffuse.flags import (Parser, client_memory_flag, decoder_flag, device_flags, encoders_flag, key_values,
                           positive, quantize_flag, seconds, speculate_flags, threshold)


def ring_flags(ap: argparse.ArgumentParser) -> None:
    """Where the nodes are and how the client speaks to them (query, chat, verify)."""
    ap.add_argument("--nodes", help="comma-separated node addresses, each optionally #HEXKEY to pin its key; "
                    "';' separates groups, each a whole ring, that run guidance branches side by side; auto: the "
                    "nodes announced on the local network (python -m diffuse.node --announce) that serve the model")
    ap.add_argument("--discover-seconds", type=seconds, default=None, metavar="S",
                    help="with --nodes auto: how long to listen for announced nodes (default 3)")
    ap.add_argument("--local-nodes", type=positive, default=None, help="start N nodes on this machine (default 2; "
                    "never more than the longest stack has blocks)")
    ap.add_argument("--local-transport", default="tcp", metavar="SCHEME",
                    help="URL scheme local nodes listen on (tcp; ipc with the diffuse-ipc plugin)")
    ap.add_argument("--placement", choices=("planned", "even"), default="planned",
                    help="for nodes started without --blocks: slices planned from each node's memory and speed "
                    "(default), or even slices; either is refused, with the shortfall, where it does not fit")
    ap.add_argument("--threads", type=positive, help="torch threads here and on local nodes; equal bits need equal "
                    "counts here, on every node and in the run compared with (default: torch's here, and at "
                    "--patches 1 the same on local nodes, so a default run equals a default whole run)")
    ap.add_argument("--timeout", type=seconds, default=300.0, help="seconds one pass through the ring may take while "
                    "every node still answers pings (a dead or frozen node is named within seconds regardless), and the most "
                    "a node still fetching its slice is waited for")
    ap.add_argument("--client-key", metavar="FILE", help="this client's long-term identity (created 0600 if "
                    "missing; its public key is printed), for nodes run with --allow-client; default: a fresh one "
                    "per run")
    quantize_flag(ap, "the nodes' blocks (local nodes are started so; a node holding another mode is refused; with "
                  "--whole, the blocks here)")
    quantize_flag(ap, "this client's own parts (text encoders and other components, the denoiser's ends; not a "
                  "language model's output head, which the last node holds)", "--quantize-client")


def named_device(a: argparse.Namespace) -> tuple[str | None, str | None, bool] | None:
    """What of ``--device`` and ``--dtype`` (or ``DIFFUSE_DEVICE`` and ``DIFFUSE_DTYPE``) is to be held against
    what torch sees here before anything loads: (the device flag, the dtype flag, whether a dtype is named), or
    None where all is ``auto`` (nothing to refuse, and torch is not imported yet: the first line waits).
    ``auto`` dtypes are resolved once the model's folder is read."""
    if not hasattr(a, "device"):
        return None
    named = [x for x in (a.device, a.dtype, os.environ.get("DIFFUSE_DEVICE"), os.environ.get("DIFFUSE_DTYPE"))
             if x and x != "auto"]
    if not named:
        return None
    return a.device, a.dtype, (a.dtype or os.environ.get("DIFFUSE_DTYPE") or "auto") != "auto"


def check_device_flags(a: argparse.Namespace) -> None:
    """``--device`` and a named ``--dtype`` against what torch sees here (``named_device``)."""
    asked = named_device(a)
    if asked is not None:
        from diffuse.plan.devices import check_named

        check_named(*asked)


def query_parser(prog: str = "diffuse query") -> Parser:
    ap = Parser(prog=prog, description="Generate with a model split over a ring of nodes: a diffusers pipeline "
                "makes an image, a video or audio; a transformers model folder answers in text. Flags not given "
                "are not passed, so the model's own defaults hold.")
    ap.add_argument("--model", help="a diffusers pipeline folder or a transformers model folder, a shipped model's "
                    "name, or a Hub id, ORG/NAME[@REVISION], fetched as far as this client needs (default: the shipped "
                    "tiny-wan-shapes)")
    ap.add_argument("--prompt", help="what to make (a language model: the text to answer)")
    ap.add_argument("--negative-prompt", help="what to steer away from (the pipeline's negative_prompt)")
    ap.add_argument("--steps", type=positive, help="denoising steps (default: the pipeline's)")
    ap.add_argument("--patches", type=positive, default=1, help="patches per step (1: exact; >1: PipeFusion)")
    ap.add_argument("--cache-threshold", type=threshold, default=0.0, metavar="T",
                    help="first-block cache: skip the rest of a step's blocks where the first block's residual "
                    "changed less than T (relative) since the last step computed in full, reusing what each node's "
                    "blocks added then (default 0: off, exact)")
    ap.add_argument("--seed", type=int, default=0, help='generator=torch.Generator("cpu").manual_seed(SEED)')
    ap.add_argument("--height", type=positive, help="output height in pixels (default: the model's)")
    ap.add_argument("--width", type=positive, help="output width in pixels (default: the model's)")
    ap.add_argument("--frames", type=positive, help="video frames (num_frames; default: the model's)")
    ring_flags(ap)
    device_flags(ap)
    encoders_flag(ap)
    decoder_flag(ap)
    client_memory_flag(ap)
    ap.add_argument("--branch-groups", type=positive, default=1, metavar="G",
                    help="with --local-nodes: share the local nodes out into G groups, one per guidance branch, "
                    "which then run side by side (default 1)")
    ap.add_argument("--out", help="output file: .png for images; .mp4 or .gif (a preview any viewer plays) for "
                    "video; .wav for audio; a text file for a language model's answer")
    ap.add_argument("--save-array", metavar="FILE.npy", help="save the float32 array the pipeline returns")
    ap.add_argument("--whole", action="store_true", help="run unsplit in this process (the reference)")
    ap.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                    help="any other argument of the pipeline's call (or of generate); VALUE is JSON where it parses, "
                    "else a string")
    ap.add_argument("--report", metavar="FILE.json", help="write run statistics as JSON")
    ap.add_argument("--quiet", action="store_true", help="no status lines, notes, progress bar or progress lines: "
                    "what the run started and wrote, and errors")
    g = ap.add_argument_group("language models (a transformers model folder)")
    g.add_argument("--max-new-tokens", type=positive, help="tokens to generate (default: the model's generation "
                   "config)")
    g.add_argument("--image", action="append", default=[], metavar="FILE", help="an image before the prompt "
                   "(repeatable)")
    g.add_argument("--video", action="append", default=[], metavar="FILE", help="a video before the prompt "
                   "(repeatable)")
    g.add_argument("--media", action="append", default=[], metavar="FILE",
                   help="an image or video, its kind told by its content (repeatable)")
    g.add_argument("--audio", metavar="FILE", help="a clip for a model that listens (a speech recogniser transcribes "
                   "it; a chat model that hears audio answers --prompt about it), at the model's sampling rate")
    g.add_argument("--temperature", type=float, help="sample at this temperature (sampling on)")
    g.add_argument("--top-p", type=float, help="sample from the smallest set of this probability (sampling on)")
    g.add_argument("--top-k", type=positive, help="sample from the K likeliest tokens (sampling on)")
    g.add_argument("--no-template", action="store_true",
                   help="send the prompt as is (default: the processor's chat template, else the tokenizer's)")
    g.add_argument("--save-tokens", metavar="FILE.json",
                   help='write {"input_ids": [[...]], "new_tokens": [[...]]} as generate returns them')
    g.add_argument("--embedding-on-node", action="store_true",
                   help="the first node holds the embedding table and passes carry token ids (default: the client "
                   "embeds, and passes carry hidden states)")
    speculate_flags(g)
    return ap


def chat_parser() -> Parser:
    ap = Parser(prog="diffuse chat", description="An interactive chat with a language model split over a ring: the "
                "history is rendered with the chat template, and each node keeps its layers' cache between turns, "
                "so a turn sends only its own new tokens. Ctrl-C or an empty input at end of file ends it.")
    ap.add_argument("--model", help="a transformers model folder (or a shipped name, or a Hub id ORG/NAME[@REVISION], "
                    "fetched as it runs); default: the embedded chat model, tiny-qwen-chat")
    ap.add_argument("--max-new-tokens", type=positive, default=128, help="tokens per answer at most (default 128)")
    ap.add_argument("--image", action="append", default=[], metavar="FILE", help="an image for the first turn")
    ring_flags(ap)
    device_flags(ap)
    ap.add_argument("--report", metavar="FILE.json", help="write per-turn statistics as JSON at the end")
    ap.add_argument("--embedding-on-node", action="store_true",
                    help="the first node holds the embedding table and passes carry token ids (default: the client "
                    "embeds)")
    speculate_flags(ap)
    return ap


def check_flags(a: argparse.Namespace, options) -> None:
    """What the flags alone can tell, checked before anything is read or loaded (query, chat, verify): the
    plain rules here first, then each rule's owner: the split's ``options`` as the flags built them
    (``options_of``; ``diffuse.client.request.check_options``), the node list (``diffuse.client.known_nodes``) or the network
    search (``diffuse.wire.discovery``), and the device (``diffuse.plan.devices.check_named``)."""
    from diffuse.client.request import check_options
    from diffuse.errors import DiffuseError

    nodes = getattr(a, "nodes", None)
    if getattr(a, "discover_seconds", None) is not None and nodes != "auto":
        raise DiffuseError("--discover-seconds applies with --nodes auto")
    whole = getattr(a, "whole", False)
    if whole and getattr(a, "cache_threshold", 0.0):
        raise DiffuseError("--cache-threshold applies to split runs; --whole runs the model as it is")
    if whole and (nodes is not None or a.local_nodes is not None):
        raise DiffuseError("--whole runs the model unsplit in this process: leave out --nodes and --local-nodes")
    if getattr(a, "temperature", None) is not None and not a.temperature > 0:
        raise DiffuseError(f"--temperature {a.temperature}: must be above 0 (leave it out for greedy decoding)")
    if getattr(a, "top_p", None) is not None and not 0 < a.top_p <= 1:
        raise DiffuseError(f"--top-p {a.top_p}: must be in (0, 1]")
    groups = node_groups(nodes) if nodes not in (None, "auto") else []
    if getattr(a, "client_memory", None) is not None:
        from diffuse.plan.budget import parse_size

        if whole:
            raise DiffuseError("--client-memory plans a split run's client; --whole holds the whole model here")
        parse_size(a.client_memory)
    check_speculate(a)
    if whole and (getattr(a, "speculate", "auto") not in ("auto", "off") or getattr(a, "draft_tokens", None)):
        raise DiffuseError("--speculate and --draft-tokens draft for the ring; --whole runs the model as it is")
    device = named_device(a)
    for mode in (getattr(a, "quantize", None), getattr(a, "quantize_client", None)):
        if mode not in (None, "none"):
            from diffuse.plan.quantize import check_mode

            check_mode(mode, device[0] if device and device[0] not in (None, "auto") else None)
    check_options(options.patches, nodes is not None, options.local_nodes, options.branch_groups,
                  options.cache_threshold)
    if nodes == "auto":
        from diffuse.wire.discovery import zeroconf_library

        zeroconf_library()  # or how to install it, in one line
    if groups:
        from diffuse.client.known_nodes import parse_nodes

        for group in groups:
            parse_nodes(group)  # scheme, port and key of each address
    if device is not None:
        from diffuse.plan.devices import check_named

        check_named(*device)


def lan_nodes(a: argparse.Namespace, subject, out) -> None:
    """``--nodes auto``: replaced by the nodes announced on the local network that serve ``subject``'s model
    (``diffuse.client.lan.heard_nodes``)."""
    if getattr(a, "nodes", None) != "auto":
        return
    from diffuse.client.lan import heard_nodes
    from diffuse.client.progress import status

    a.nodes = heard_nodes(subject, getattr(a, "discover_seconds", None), lambda line: status(out, line))


def node_groups(nodes: str) -> list[str]:
    """``--nodes``: groups separated by ';' (each address in them is checked by ``diffuse.client.known_nodes``)."""
    from diffuse.errors import DiffuseError

    groups = nodes.split(";")
    if any(not g.strip() for g in groups):
        raise DiffuseError("--nodes: an empty group between ';' separators")
    return groups


def query_request(a: argparse.Namespace):
    """The flags of ``diffuse query`` checked (``check_flags``: what they alone can tell) and built, once, into
    the typed request whose pieces the run's parts take (``diffuse.client.request.QueryRequest``)."""
    from diffuse.client.request import ModelAsk, Output, PipelineCall, QueryRequest, RingAsk, TextCall

    args = key_values(a.arg)  # KEY=VALUE form
    options = options_of(a)
    check_flags(a, options)
    return QueryRequest(
        model=ModelAsk(a.model, a.device, a.dtype, a.threads, a.whole, a.quantize_client, a.client_memory),
        ring=RingAsk(a.nodes, a.discover_seconds, options),
        call=PipelineCall(a.prompt, a.negative_prompt, a.steps, a.height, a.width, a.frames, dict(args), a.seed),
        text=TextCall(a.prompt, tuple(a.image), tuple(a.video), tuple(a.media), a.audio, a.no_template,
                      a.max_new_tokens, a.temperature, a.top_p, a.top_k, dict(args), a.seed),
        output=Output(a.out, a.save_array, a.save_tokens, a.report, a.quiet))


def chat_request(a: argparse.Namespace):
    """The flags of ``diffuse chat`` checked and built into the same typed request as a query's (the embedded
    chat model by default; its turns come from the input, so the text call holds only the first turn's images
    and the tokens an answer may take)."""
    from diffuse.client.request import ModelAsk, Output, PipelineCall, QueryRequest, RingAsk, TextCall
    from diffuse.plan.shipped import CHAT_MODEL_NAME

    options = options_of(a)
    check_flags(a, options)
    return QueryRequest(model=ModelAsk(a.model or CHAT_MODEL_NAME, a.device, a.dtype, a.threads,
                                       quantize_client=a.quantize_client),
                        ring=RingAsk(a.nodes, a.discover_seconds, options), call=PipelineCall(),
                        text=TextCall(image=tuple(a.image), max_new_tokens=a.max_new_tokens),
                        output=Output(report=a.report))


def options_of(a: argparse.Namespace):
    """The split's options (``diffuse.client.api.SplitOptions``) from the ring's flags (and a query's own)."""
    from diffuse.client.api import SplitOptions

    return SplitOptions(local_nodes=a.local_nodes, patches=getattr(a, "patches", 1), threads=a.threads,
                        timeout=a.timeout, client_key=a.client_key, local_transport=a.local_transport,
                        branch_groups=getattr(a, "branch_groups", 1),
                        cache_threshold=getattr(a, "cache_threshold", 0.0),
                        embedding_on_node=a.embedding_on_node, placement=a.placement,
                        quantize=getattr(a, "quantize", None), speculate=getattr(a, "speculate", "auto"),
                        draft_tokens=getattr(a, "draft_tokens", None), encoders=getattr(a, "encoders", None),
                        decoder=getattr(a, "decoder", None), decoder_tiling=getattr(a, "decoder_tiling", None))


def report_error(out, exc: BaseException) -> int:
    """An expected failure: one clear line, no traceback, exit status 2. The line is the root cause: a
    failure raised while handling another names the first one too when they differ. The message is printed as
    written: brackets in it (``diffuse[lan]``, ``blocks[0:2]``) are not read as markup."""
    from rich.markup import escape

    out.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
    return 2


def run_guarded(body, out, interrupted: str = "interrupted") -> int:
    """``body()`` with the command's error handling: a ``DiffuseError`` is one line and status 2; Ctrl-C
    is status 130 (sessions are closed and local nodes stopped on the way out)."""
    from diffuse.errors import DiffuseError

    try:
        body()
    except DiffuseError as exc:
        return report_error(out, exc)
    except KeyboardInterrupt:
        out.print(interrupted, highlight=False)
        return 130
    return 0


def check_speculate(a) -> None:
    """The drafting flags alone, checked before anything loads (an assistant is checked as it loads)."""
    from diffuse.lm.client_drafts import check_draft_tokens, parse_speculate

    parse_speculate(getattr(a, "speculate", None))
    if getattr(a, "draft_tokens", None) is not None:
        check_draft_tokens(a.draft_tokens)
