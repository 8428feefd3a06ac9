"""Command-line pieces every process's command shares, the client's and the node's: the parser (a mistake is one line, with "did you mean"), value types, the device flags, a port checked free, and ending at once. Imports nothing of Diffuse but its errors."""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import sys
import warnings


def exit_now(code: int) -> None:
    """End the process at once with ``code``, output flushed."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def quiet_libraries() -> None:
    """Libraries' deprecation and future warnings are for their callers' authors, not for a user of the
    command: off in normal output (``PYTHONWARNINGS`` or ``-W`` given explicitly still rule)."""
    if sys.warnoptions:
        return
    for category in (DeprecationWarning, FutureWarning, PendingDeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    import logging

    # what quantization libraries say as they load (kernels built for other devices, deprecations) is not the user's
    for name in ("torchao", "bitsandbytes", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


class Parser(argparse.ArgumentParser):
    """A flag mistake is one line and exit status 2, before anything is loaded or started; an unknown
    flag near a known one says which was meant."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {self.suggest(message)} (see --help)\n")

    def suggest(self, message: str) -> str:
        if not message.startswith("unrecognized arguments:"):
            return message
        known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        hints = []
        for word in message.split(":", 1)[1].split():
            if word.startswith("-"):
                near = difflib.get_close_matches(word.split("=", 1)[0], known, n=1, cutoff=0.6)
                if near:
                    hints.append(near[0])
        return f"{message}; did you mean {' and '.join(hints)}?" if hints else message


def positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is less than 1")
    return n


def seconds(text: str) -> float:
    try:
        s = float(text)
    except ValueError:
        s = float("nan")
    if not math.isfinite(s) or s <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0")
    return s


def threshold(text: str) -> float:
    """``--cache-threshold``: a finite number of 0 or more (0: off)."""
    try:
        t = float(text)
    except ValueError:
        t = float("nan")
    if not math.isfinite(t) or t < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of 0 or more (0: off; 0.1 skips steps whose "
                                         "first block changes less than 10%)")
    return t


def hex_key(text: str, what: str = "public key") -> bytes:
    """A public key: 64 hex digits (``what``: how the refusal names it)."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        key = b""
    if len(key) != 32:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a {what} (64 hex digits, as `diffuse query --client-key FILE` or `diffuse key` "
            "prints)")
    return key


def parse_value(text: str):
    """``--arg KEY=VALUE``'s VALUE: JSON where it parses, else the string itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def key_values(items: list[str]) -> dict:
    """Every ``--arg KEY=VALUE`` as a dict, in order (a repeated key: the last wins)."""
    from diffuse.errors import DiffuseError

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise DiffuseError(f"--arg {item!r}: expected KEY=VALUE")
        out[key] = parse_value(value)
    return out


def device_flags(ap: argparse.ArgumentParser, what: str = "the client's ends of the model, and local nodes") -> None:
    """``--device`` and ``--dtype`` (``diffuse.plan.devices``): where ``what`` computes, and in what."""
    ap.add_argument("--device", default=None, metavar="auto|cpu|cuda|cuda:N|mps",
                    help=f"where {what} compute (default: $DIFFUSE_DEVICE, "
                    "else auto: the first accelerator torch sees, else the CPU); a device torch does not see is "
                    "refused")
    ap.add_argument("--dtype", default=None, choices=("auto", "bfloat16", "float16", "float32"),
                    help="the compute dtype (default: $DIFFUSE_DTYPE, else auto: on an accelerator what the model "
                    "folder declares, on the CPU what a plain from_pretrained gives, float32 for a diffusers "
                    "pipeline)")


def quantize_flag(ap: argparse.ArgumentParser, what: str, flag: str = "--quantize") -> None:
    """``--quantize`` (``diffuse.plan.quantize``): the linear weights of ``what`` held quantized, weight-only."""
    ap.add_argument(flag, default=None, choices=("none", "int8", "int4", "fp8"),
                    help=f"hold the linear weights of {what} quantized by torchao (weight-only; needs diffuse[quant]): "
                    "int8, int4 or fp8; default none. Exact against plain diffusers/transformers loading the same "
                    "torchao config whole")


def encoders_flag(ap: argparse.ArgumentParser) -> None:
    """``--encoders`` (``diffuse.plan.encoders``): where a pipeline's text encoders run."""
    ap.add_argument("--encoders", default=None, choices=("client", "ring"),
                    help="where a pipeline's text encoders run: client (default: whole, as plain diffusers holds "
                    "them) or ring (their layers split over the nodes like the denoiser's blocks; the tokenizer, "
                    "token embedding and final norm stay on the client). Client and nodes must agree")


def parts_flags(ap: argparse.ArgumentParser) -> None:
    """``--encoders`` and ``--decoder`` of a command that plans where a pipeline's parts go (``diffuse plan``)."""
    encoders_flag(ap)
    decoder_flag(ap, tiling=False)


def decoder_flag(ap: argparse.ArgumentParser, node: bool = False, tiling: bool = True) -> None:
    """``--decoder`` (and a client's ``--decoder-tiling``, ``diffuse.plan.decoders``): where a pipeline's VAE runs."""
    if node:
        ap.add_argument("--decoder", default=None, choices=("client", "ring"),
                        help="ring: this node serves the pipeline's VAE too (its decode, and its encode), when a "
                        "client names it to (--decoder there); that node sees the result. Client and nodes must "
                        "agree (default client: the client decodes)")
        return
    ap.add_argument("--decoder", default=None, metavar="client|ring|NODE",
                    help="where the pipeline's VAE decodes (and encodes): client (default, as plain diffusers), ring "
                    "(the ring's last node), or NODE (a node of --nodes by its address, or by its place: 1, 2, ...). "
                    "That node holds the VAE's weights (the client never loads them) and sees the result; nodes "
                    "need --decoder ring")
    if not tiling:
        return
    ap.add_argument("--decoder-tiling", default="auto", choices=("auto", "on", "off"),
                    help="with --decoder on a node: on decodes in tiles (as vae.enable_tiling() whole), off never, "
                    "auto (default) as the pipeline's VAE is set, and in tiles where the node's memory asks for it")


def client_memory_flag(ap: argparse.ArgumentParser) -> None:
    """``--client-memory`` (``diffuse.plan.budget``): the client's budget for the model's weights."""
    ap.add_argument("--client-memory", default=None, metavar="SIZE",
                    help="the most of the model's weights this client may hold (2GiB, 1.5GB, 512MiB; a plain number: "
                    "GiB): the encoders go to the ring where the client's part does not fit with them (unless "
                    "--encoders says where), and a budget no placement meets is refused, naming what the smallest "
                    "client needs")


def speculate_flags(ap) -> None:
    """``--speculate`` and ``--draft-tokens`` (``diffuse.lm.client_drafts``): drafts a pass of a split language
    model verifies."""
    ap.add_argument("--speculate", default="auto", metavar="off|auto|lookup|MODEL",
                    help="draft tokens on the client that one pass through the ring verifies: lookup (n-grams of the "
                    "context), or an assistant model with the model's tokenizer (a folder or ORG/NAME), run whole "
                    "here; auto (default): lookup for greedy float32 decoding that asks for no logits; off")
    ap.add_argument("--draft-tokens", type=int, default=None, metavar="K",
                    help="drafted tokens one pass verifies at most with lookup, where an assistant's drafts start, "
                    "1 to 32 (default 8; the length follows what is accepted)")


def check_port_free(listen: str) -> None:
    """A node's ``--listen tcp://HOST:PORT``: refused in one line when PORT is taken, before anything loads
    (port 0 and other schemes pass)."""
    import socket

    from diffuse.errors import DiffuseError

    if not listen.startswith("tcp://"):
        return
    host, _, port = listen[6:].rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds: a closed port's wait passes
        try:
            probe.bind(("" if host in ("*", "0.0.0.0", "::") else host, int(port)))
        except OSError as exc:
            if exc.errno == 98 or "in use" in str(exc):
                raise DiffuseError(f"--listen {listen}: port {port} is already in use (another node, or another "
                                   "program): give another port, or stop what holds it") from None
            raise DiffuseError(f"--listen {listen}: cannot listen there ({exc.strerror or exc})") from None
