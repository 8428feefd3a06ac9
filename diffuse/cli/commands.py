"""The small subcommands of ``diffuse``: key, check, plan, verify, plugins (the table is ``diffuse.cli.command.COMMANDS``)."""

from __future__ import annotations

import os

from diffuse.cli import command
from diffuse.cli import parsing
from diffuse import flags
from diffuse.client import progress


def key_main(argv: list[str]) -> int:
    """``diffuse key``: the public key a node started with the same ``$DIFFUSE_HOME`` (or ``--key-file``)
    presents, created (0600) if missing, so a client can pin it before the node is up."""
    from diffuse.home import config_home
    from diffuse.wire.sealing import load_identity

    ap = flags.Parser(prog="diffuse key", description=key_main.__doc__.split("\n")[0].replace("``", ""))
    ap.add_argument("--key-file", metavar="FILE", help="the identity file (default: node.key in $DIFFUSE_HOME, "
                    "else ~/.config/diffuse)")
    a = ap.parse_args(argv)
    out = progress.console()
    path = a.key_file or os.path.join(config_home(), "node.key")

    def body():
        print(load_identity(path).public_hex)

    return parsing.run_guarded(body, out)


def check_main(argv: list[str]) -> int:
    ap = flags.Parser(prog="diffuse check", description="The verdict on a model from its config.json files alone "
                    "(no weights read): whether it splits, its block stacks, what it makes, how --patches runs.")
    ap.add_argument("model", help="a model folder, a shipped model's name, or a Hub id, ORG/NAME[@REVISION] (only "
                    "configs and headers are fetched)")
    a = ap.parse_args(argv)
    out = progress.console(stderr=False)
    code = 0

    def body():
        nonlocal code
        from diffuse.cli.check import print_check
        from diffuse.plan.resolve import resolve_model

        code = print_check(resolve_model(a.model, "headers"), out, cache=True)

    return parsing.run_guarded(body, out) or code


def verify_main(argv: list[str]) -> int:
    ap = parsing.query_parser("diffuse verify")
    ap.description = ("Run the model whole and split with the same arguments; print the largest difference "
                      "(exit 0 when byte-identical, or with --patches above 1).")
    ap.add_argument("model_pos", nargs="?", metavar="MODEL", help="the model (or give --model)")
    a = ap.parse_args(argv)
    a.model = a.model or a.model_pos
    out = progress.console()
    result: dict = {}

    def body():
        import numpy as np
        import torch

        import diffuse
        from diffuse.client.api import load_whole_or_shell
        from diffuse.client.dryrun import call_kwargs
        from diffuse.cli.modelread import read_model
        from diffuse.client.output import output_array

        q, (info, _, compute) = read_model(parsing.query_request(a), out, "diffuse verify")
        with progress.phase(out, f"{os.path.basename(info.path)}: running it whole, in this process, on "
                       f"{compute.describe()}", a.quiet):
            whole = load_whole_or_shell(info, compute, shell=False)
            for name in info.subject.decoders if q.ring.options.decoder_tiling == "on" else ():
                getattr(whole, name).enable_tiling()  # the split's node decodes in tiles: so does the whole run
            with torch.no_grad():
                reference = output_array(whole(**call_kwargs(q.call, whole, info)))
            del whole
        with progress.phase(out, f"{os.path.basename(info.path)}: running it split", a.quiet):
            pipe = diffuse.from_pretrained(info.path, device=a.device, dtype=a.dtype,  # --encoders, --client-memory
                                           encoders="ring" if info.encoders else None,
                                           decoder="ring" if info.decoders else None)  # --decoder
            with diffuse.split(pipe, nodes=q.ring.nodes, local_nodes=a.local_nodes, patches=a.patches,
                               threads=a.threads, timeout=a.timeout, local_transport=a.local_transport,
                               decoder=q.ring.options.decoder, decoder_tiling=q.ring.options.decoder_tiling), \
                    torch.no_grad():
                split = output_array(pipe(**call_kwargs(q.call, pipe, info)))
        result["diff"] = float(np.abs(reference.astype(np.float64) - split).max())
        result["same"] = reference.tobytes() == split.tobytes()

    code = parsing.run_guarded(body, out)
    if code:
        return code
    print(f"max abs difference, whole vs split ({a.patches} patch{'es' if a.patches > 1 else ''}): "
          f"{result['diff']:.3g}{'  (byte-identical)' if result['same'] else ''}")
    return 0 if (result["same"] or a.patches > 1) else 1


def plugins_main(argv: list[str]) -> int:
    flags.Parser(prog="diffuse plugins", description="The installed plugins and the hooks each implements.") \
        .parse_args(argv)
    from diffuse.plan.plugins import plugin_manager

    pm = plugin_manager()
    for plugin in pm.get_plugins():
        name = pm.get_name(plugin)
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or [])
        print(f"{name:12s} {getattr(plugin, '__name__', plugin)}  {', '.join(hooks)}")
    return 0
