"""`diffuse check MODEL`: the verdict and its reasons, from config.json files alone (no weights read).

Nearly all of a first check is Python importing torch and diffusers' model
code (a few seconds); the analysis itself takes milliseconds. So ``diffuse
check`` keeps its verdicts (``cache=True``) under ``$DIFFUSE_HOME/cache/``, keyed
by everything they rest on: a repeated check of an unchanged model with
unchanged code imports neither.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

from diffuse.analysis import ModelSubject
from diffuse.errors import RefusedModel
from diffuse.plan import PATCHABLE, UNCUT_STEPS

SPLITTABLE, REFUSED = "splittable", "refused"
EXIT_CODES = {SPLITTABLE: 0, REFUSED: 2}
_SMALL = 1 << 20  # bytes: configs and shipped code are small; a weights index is not read
_LIBRARIES = ("diffusers", "transformers", "torch", "accelerate")


def check(path: str, cache: bool = False) -> dict:
    """Run the config-phase analyzers on a local pipeline folder and sum up what they found.

    Returns a plain dict: ``verdict`` ("splittable" or "refused"), ``reason``
    (the refusal, or None), ``denoiser``, ``stacks`` (path, length, config key,
    block class, params per block, width, two-stream and why), ``output_kind``,
    ``frame_rate``, ``sample_rate``, ``patches`` (how ``--patches P>1`` will run),
    ``other_lists`` and ``seconds``; for a transformers model, ``config``: what config.json alone says
    (``analyzers.config_reader.read_config``: decoder depth and its key, generates, media, encoder, recurrent
    state). With ``cache``, a verdict found before for
    the same model and code is reused (``cached``: its file) and a new one kept.
    """
    start = time.perf_counter()
    if not cache:
        return _check(path, start)
    file = os.path.join(_cache_dir(), f"check-{cache_key(path)}.json")
    try:
        with open(file) as f:
            return {**json.load(f), "model": path, "seconds": time.perf_counter() - start, "cached": file}
    except (OSError, ValueError):  # none yet, or unreadable: check afresh
        pass
    result = _check(path, start)
    try:
        os.makedirs(os.path.dirname(file), exist_ok=True)
        with open(f"{file}.{os.getpid()}", "w") as f:
            json.dump(result, f)
        os.replace(f"{file}.{os.getpid()}", file)  # whole or absent, even with two checks at once
    except OSError:  # a read-only home: the verdict stands without it
        pass
    return result


def cache_key(path: str) -> str:
    """A fingerprint of what a verdict rests on: the checkpoint's small files (model_index.json, every
    config, any .py) and weight layouts (``content_hash``) in its top two levels, and the code that judges
    it: library versions plus the size and time of every file of the installed plugins and of the
    component libraries model_index.json names (an edited analyzer is new code)."""
    from importlib.metadata import PackageNotFoundError, entry_points, version
    from importlib.util import find_spec

    from diffuse.modelfiles import content_hash

    h = hashlib.blake2b(digest_size=16)
    for folder in ["", *sorted(e.name for e in os.scandir(path) if e.is_dir())]:
        here = os.path.join(path, folder)
        for name in sorted(os.listdir(here)):
            full = os.path.join(here, name)
            h.update(f"{folder}/{name}\0".encode())
            if name.endswith((".json", ".py")) and os.path.isfile(full) and os.path.getsize(full) <= _SMALL:
                with open(full, "rb") as f:
                    h.update(f.read())
        if folder and os.path.isfile(os.path.join(here, "config.json")):
            h.update(content_hash(here).encode())
    for lib in _LIBRARIES:
        try:
            h.update(f"{lib}={version(lib)}".encode())
        except PackageNotFoundError:
            pass
    named = []
    index = os.path.join(path, "model_index.json")
    if os.path.isfile(index):  # a transformers model folder has none: its library is among _LIBRARIES
        with open(index) as f:
            named = [e[0] for e in json.load(f).values() if isinstance(e, list) and e and isinstance(e[0], str)]
    tops = {ep.value.split(".")[0].split(":")[0] for ep in entry_points(group="diffuse")} | {n.split(".")[0] for n in named}
    for top in sorted(tops - {"", *_LIBRARIES}):
        spec = find_spec(top)
        roots = list(spec.submodule_search_locations or []) if spec else []
        files = [spec.origin] if spec and spec.origin and not roots else []
        files += [os.path.join(d, n) for r in roots for d, _, ns in os.walk(r) for n in ns if n.endswith(".py")]
        for f in sorted(files):
            st = os.stat(f)
            h.update(f"{f}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def _cache_dir() -> str:
    from diffuse.home import config_home

    return os.path.join(config_home(), "cache")


def _check(path: str, start: float) -> dict:
    subject = ModelSubject.from_path(path)
    result = {"model": path, "denoiser": (f"{subject.denoiser}: {subject.denoiser_class_name}" if subject.denoiser
                                          else subject.denoiser_class_name if subject.autoregressive else None)}
    if subject.autoregressive:  # a transformers model: the five answers config.json gives, refused or not
        from diffuse.config_verdict import read_config

        result["config"] = read_config(subject.denoiser_config)
    try:
        from diffuse.planner import config_draft

        draft = config_draft(subject)
    except RefusedModel as exc:
        return {**result, "verdict": REFUSED, "reason": exc.reason, "stacks": [],
                "seconds": time.perf_counter() - start}
    two, why = draft.get("two_stream", {}), draft.get("two_stream_evidence", {})
    stacks = [{
        "path": s.path, "length": s.length, "config_key": s.config_key, "block_class": s.block_class,
        "params_per_block": s.params_per_block, "width": draft.get("stack_widths", {}).get(s.path),
        "two_stream": bool(two.get(s.path)), "two_stream_evidence": why.get(s.path),
        "patch_policy": UNCUT_STEPS if two.get(s.path) else PATCHABLE,
    } for s in draft["stacks"]]
    return {
        **result,
        "verdict": SPLITTABLE,
        "reason": None,
        "stacks": stacks,
        "output_kind": draft.get("output_kind"),
        "output_evidence": draft.get("output_evidence"),
        "frame_rate": draft.get("frame_rate"),
        "sample_rate": draft.get("sample_rate"),
        "patches": UNCUT_STEPS if any(s["two_stream"] for s in stacks) else PATCHABLE,
        "other_lists": draft.get("other_lists", {}),
        "seconds": time.perf_counter() - start,
    }


def print_check(path: str, console=None, cache: bool = False) -> int:
    """Print the verdict (first line: "splittable" or "refused: <reason>") and what it rests on.

    Returns the exit status for ``diffuse check``: 0 splittable, 2 refused.
    """
    from rich.console import Console

    console = console or Console()
    r = check(path, cache=cache)
    when = f"checked in {r['seconds']:.2f} s" + (" (cached)" if r.get("cached") else "")
    if r["verdict"] == REFUSED:
        console.print(f"[bold red]refused[/]: {r['reason']}", highlight=False)
        console.print(f"model {path} ({r['denoiser']}), {when}", style="dim", highlight=False)
        _print_config(console, r)
        return EXIT_CODES[REFUSED]
    console.print("[bold green]splittable[/]", highlight=False)
    console.print(f"model {path} ({r['denoiser']}), {when} from config.json alone", style="dim", highlight=False)
    _print_config(console, r)
    console.print("block stacks, in call order:", highlight=False)
    for s in r["stacks"]:
        console.print(f"  [bold]{s['path']}[/]: {s['length']} x {s['block_class'].rpartition('.')[2]}, sized by "
                      f"{s['config_key'] or '(no config setting found)'}, width {s['width']}, "
                      f"{s['params_per_block']:,} params per block, {'two streams' if s['two_stream'] else 'one stream'}",
                      highlight=False)
        console.print(f"    {s['two_stream_evidence']}", style="dim", highlight=False)
    rates = ", ".join(x for x in (r["frame_rate"] and f"{r['frame_rate']} fps",
                                  r["sample_rate"] and f"{r['sample_rate']} Hz") if x)
    console.print(f"output: {r['output_kind']}{f' ({rates})' if rates else ''}  [dim]({r['output_evidence']})[/]",
                  highlight=False)
    if r["output_kind"] == "text":
        console.print("--patches: does not apply (a language model runs one pass per token)", highlight=False)
    elif r["patches"] == UNCUT_STEPS:
        two = ", ".join(s["path"] for s in r["stacks"] if s["two_stream"])
        console.print(f"--patches: steps run uncut (blocks of {two} carry two streams)", highlight=False)
    else:
        console.print("--patches: patchable (every stack carries one stream)", highlight=False)
    cfg = r.get("config") or {}
    if cfg.get("depth") is not None and cfg["depth"] not in [s["length"] for s in r["stacks"]]:
        console.print(f"note: config.json's {cfg['depth_key']} says {cfg['depth']}, but no stack found holds that many "
                      "blocks", highlight=False)
    for p, what in r["other_lists"].items():
        console.print(f"note: {p} holds {what}; it is not a stack and runs on the client", highlight=False)
    return EXIT_CODES[SPLITTABLE]


def _print_config(console, r: dict) -> None:
    """A transformers model's answers from config.json, each with the fields it rests on."""
    if not r.get("config"):
        return
    from diffuse.config_verdict import describe

    console.print("from config.json:", highlight=False)
    for line in describe(r["config"]):
        console.print(f"  {line}", highlight=False)
