"""`diffuse check MODEL`: the verdict and its reasons, from config.json files and the safetensors headers
(names and shapes: no tensor data is read).

Nearly all of a first check is Python importing torch and diffusers' model
code (a few seconds); the analysis itself takes milliseconds. So ``diffuse
check`` keeps its verdicts (``cache=True``) under ``$DIFFUSE_HOME/cache/``, keyed
by everything they rest on: a repeated check of an unchanged model with
unchanged code imports neither.

A model folder may also carry its verdict (``diffuse_verdict.json``, written by
``python -m diffuse.cli.check keep DIR``; the shipped models do): the check's answer
and the largest sizes its denoiser takes (``diffuse.client.dryrun.largest_sizes``),
keyed by the folder's files, the libraries' versions and the installed analyzer
plugins (``model_key``; not by the code's file times, so it holds in a fresh install).
A first check, or a refused size, then answers from it without importing torch.
tests/test_quick_answers.py compares each shipped verdict with one made afresh.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

from diffuse.plan.analysis import ModelSubject
from diffuse.errors import DiffuseError, RefusedModel
from diffuse.plan.contracts import PATCHABLE, UNCUT_STEPS

SPLITTABLE, REFUSED = "splittable", "refused"
EXIT_CODES = {SPLITTABLE: 0, REFUSED: 2}
_SMALL = 1 << 20  # bytes: configs and shipped code are small; a weights index is not read
_LIBRARIES = ("diffusers", "transformers", "torch", "accelerate")
VERDICT_FILE = "diffuse_verdict.json"  # a model folder's kept verdict: see the module's docstring


def check(path: str, cache: bool = False) -> dict:
    """Run the config-phase analyzers on a local pipeline folder and sum up what they found.

    Returns a plain dict: ``verdict`` ("splittable" or "refused"), ``reason``
    (the refusal, or None), ``denoiser``, ``stacks`` (path, length, config key,
    block class, params per block, width, two-stream and why), ``output_kind``,
    ``frame_rate``, ``sample_rate``, ``patches`` (how ``--patches P>1`` will run),
    ``other_lists`` and ``seconds``; for a transformers model, ``config``: what config.json alone says
    (``analyzers.config_reader.read_config``: decoder depth and its key, generates, media, encoder, recurrent
    state). With ``cache``, a verdict found before for the same model and code, or the one the folder
    carries (``kept``), is reused (``cached``: its file) and a new one kept.
    """
    start = time.perf_counter()
    if not cache:
        return _check(path, start)
    file = os.path.join(_cache_dir(), f"check-{cache_key(path)}.json")
    found, verdict = stored(path, file)
    if verdict:
        return {**verdict, "model": path, "seconds": time.perf_counter() - start, "cached": found}
    result = _check(path, start)
    try:
        os.makedirs(os.path.dirname(file), exist_ok=True)
        with open(f"{file}.{os.getpid()}", "w") as f:
            json.dump(result, f)
        os.replace(f"{file}.{os.getpid()}", file)  # whole or absent, even with two checks at once
    except OSError:  # a read-only home: the verdict stands without it
        pass
    return result


def _read(file: str) -> dict | None:
    try:
        with open(file) as f:
            return json.load(f)
    except (OSError, ValueError):  # none yet, or unreadable: check afresh
        return None


def stored(path: str, file: str | None = None) -> tuple[str | None, dict | None]:
    """(where, the check's verdict) kept for this model without working it out: under ``$DIFFUSE_HOME/cache/``
    (``file``, else found by ``cache_key``) for this code, else in the folder (``kept``); (None, None) if neither."""
    file = file or os.path.join(_cache_dir(), f"check-{cache_key(path)}.json")
    verdict = _read(file)
    if verdict:
        return file, verdict
    folder = kept(path)
    return (os.path.join(path, VERDICT_FILE), folder["check"]) if folder else (None, None)


def kept(path: str) -> dict | None:
    """The verdict the folder carries (``VERDICT_FILE``: ``check``, the check's answer; ``sizes``, see
    ``diffuse.client.dryrun.largest_sizes``), when it was made from these very files, libraries and plugins; else None."""
    verdict = _read(os.path.join(path, VERDICT_FILE))
    if not isinstance(verdict, dict) or verdict.get("key") != model_key(path):
        return None
    return verdict


def keep(path: str) -> dict:
    """Work out the folder's verdict afresh (the check, and for a pipeline the largest sizes its denoiser
    takes, which loads the pipeline without its blocks) and write it into the folder as ``VERDICT_FILE``."""
    result = _check(path, time.perf_counter())
    verdict = {"key": model_key(path), "libraries": library_versions(),  # said for people: the key holds them
               "check": {k: v for k, v in result.items() if k not in ("model", "seconds")}}
    if result["verdict"] == SPLITTABLE and result.get("output_kind") != "text":
        from diffuse.client.dryrun import largest_sizes

        verdict["sizes"] = largest_sizes(path)
    with open(os.path.join(path, VERDICT_FILE), "w") as f:
        json.dump(verdict, f, indent=1, sort_keys=True)
        f.write("\n")
    return verdict


def cache_key(path: str) -> str:
    """A fingerprint of what a verdict rests on: the model and libraries (``model_key``) and the code that
    judges it: the size and time of every file of the installed plugins and of the component libraries
    model_index.json names (an edited analyzer is new code)."""
    from importlib.metadata import entry_points
    from importlib.util import find_spec

    h = hashlib.blake2b(model_key(path).encode(), digest_size=16)
    tops = {ep.value.split(".")[0].split(":")[0] for ep in entry_points(group="diffuse")} | set(_named_libraries(path))
    for top in sorted(tops - {"", *_LIBRARIES}):
        spec = find_spec(top)
        roots = list(spec.submodule_search_locations or []) if spec else []
        files = [spec.origin] if spec and spec.origin and not roots else []
        files += [os.path.join(d, n) for r in roots for d, _, ns in os.walk(r) for n in ns if n.endswith(".py")]
        for f in sorted(files):
            st = os.stat(f)
            h.update(f"{f}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def library_versions() -> dict[str, str]:
    """The installed versions of the libraries a verdict rests on (those installed, by name)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for lib in _LIBRARIES:
        try:
            found[lib] = version(lib)
        except PackageNotFoundError:
            pass
    return found


def model_key(path: str) -> str:
    """A fingerprint of the model and what reads it, not of the code's files: the checkpoint's small files
    (model_index.json, every config, any .py; its kept verdict left out) and weight layouts (``content_hash``)
    in its top two levels, the versions of the libraries, and the installed analyzer plugins by name."""
    from importlib.metadata import entry_points

    from diffuse.plan.modelfiles import content_hash

    h = hashlib.blake2b(digest_size=16)
    for folder in ["", *sorted(e.name for e in os.scandir(path) if e.is_dir())]:
        here = os.path.join(path, folder)
        for name in sorted(os.listdir(here)):
            full = os.path.join(here, name)
            if not folder and name == VERDICT_FILE:
                continue
            h.update(f"{folder}/{name}\0".encode())
            if name.endswith((".json", ".py")) and os.path.isfile(full) and os.path.getsize(full) <= _SMALL:
                with open(full, "rb") as f:
                    h.update(f.read())
        if folder and os.path.isfile(os.path.join(here, "config.json")):
            h.update(content_hash(here).encode())
    for lib, v in library_versions().items():
        h.update(f"{lib}={v}".encode())
    for ep in sorted(f"{e.name}={e.value}" for e in entry_points(group="diffuse") if _analyzes(e.value)):
        h.update(f"plugin {ep}\0".encode())
    return h.hexdigest()


def _analyzes(target: str) -> bool:
    """Whether the plugin module an entry point names implements the analyzer hook, read from its source
    without importing it (a transport or an output writer leaves every verdict as it is)."""
    from importlib.util import find_spec

    top, *rest = target.split(":")[0].split(".")
    try:
        spec = find_spec(top)  # a top-level name: found, not imported (a submodule's spec would import its package)
        file = spec.origin
        for part in rest:
            folder = os.path.join(os.path.dirname(file), part)
            file = os.path.join(folder, "__init__.py") if os.path.isdir(folder) else f"{folder}.py"
        with open(file, encoding="utf-8") as f:
            return "diffuse_analyzers" in f.read()
    except Exception:  # no source to read: counted, to be safe
        return True


def _named_libraries(path: str) -> list[str]:
    """The top-level packages of the component libraries model_index.json names (a transformers model folder has
    none: its library is among ``_LIBRARIES``)."""
    index = os.path.join(path, "model_index.json")
    if not os.path.isfile(index):
        return []
    with open(index) as f:
        named = [e[0] for e in json.load(f).values() if isinstance(e, list) and e and isinstance(e[0], str)]
    return [n.split(".")[0] for n in named]


def _cache_dir() -> str:
    from diffuse.home import config_home

    return os.path.join(config_home(), "cache")


def _check(path: str, start: float) -> dict:
    subject = ModelSubject.from_path(path)
    result = {"model": path, "denoiser": (subject.denoiser_label if subject.denoiser or subject.autoregressive
                                          else None)}
    if subject.autoregressive:  # a transformers model: the five answers config.json gives, refused or not
        from diffuse.plan.verdicts import read_config

        result["config"] = read_config(subject.denoiser_config)
    try:
        from diffuse.plan.planner import config_draft

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
        "weights": draft.get("stack_weights", {}).get(s.path),
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
        "mode_bytes": mode_sizes(path, stacks),  # read here, where torch is loaded: a kept verdict answers without it
        "seconds": time.perf_counter() - start,
    }


def refuse_early(path: str, label: str, call) -> None:
    """What can be refused before torch and the model's library are imported (most of a first run's
    seconds): a folder that is no model, a model whose stored check refused it (``stored``), and a size of
    ``call`` (a ``diffuse.client.request.PipelineCall``) above what its kept verdict says its denoiser takes
    (``kept_refusal``; not with ``--arg``, which may change what the call's shapes are)."""
    ModelSubject.from_path(path)
    _, verdict = stored(path)
    if verdict and verdict["verdict"] == REFUSED:
        raise RefusedModel(path, verdict["reason"])
    if verdict is None or call.args or verdict.get("output_kind") == "text":
        return
    line = kept_refusal((kept(path) or {}).get("sizes"), call.sizes(), label)
    if line:
        raise DiffuseError(line)


def kept_refusal(sizes: dict | None, asked: dict, label: str) -> str | None:
    """The refusal of ``asked`` (size argument -> value) from a kept verdict's ``largest_sizes``, or None
    where it does not decide: a call no smaller than the size made for in any of them, and above the largest
    taken in one, is refused (a size that fits means every smaller one does: the rule ``largest_taken``
    searches by)."""
    from diffuse.client.dryrun import SIZE_WORDS

    if not sizes or not asked:
        return None
    made_for, largest = sizes["made_for"], sizes["largest"]
    call = dict(made_for, **{k: v for k, v in asked.items() if k in made_for})
    if any(call[k] < v for k, v in made_for.items()):
        return None
    over = [k for k, v in largest.items() if v is not None and call[k] > v]
    if not over:
        return None
    what = ", ".join(f"{v} {SIZE_WORDS[k]}" for k, v in asked.items())
    above = " and ".join(f"{k.replace('num_', '')} above {largest[k]}" for k in over)
    takes = ", ".join(f"{k.replace('num_', '')} up to {largest[k]}" for k in over)
    return (f"{label} cannot make {what}: the denoiser's own forward refuses {above} (the model's kept verdict, "
            f"found by running it weightless); it takes {takes}; nothing was started")


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
    console.print(f"model {path} ({r['denoiser']}), {when} from config.json and the weights' headers",
                  style="dim", highlight=False)
    _print_config(console, r)
    console.print("block stacks, in call order:", highlight=False)
    for s in r["stacks"]:
        console.print(f"  [bold]{s['path']}[/]: {s['length']} x {s['block_class'].rpartition('.')[2]}, sized by "
                      f"{s['config_key'] or '(no config setting found)'}, width {s['width']}, "
                      f"{s['params_per_block']:,} params per block, {'two streams' if s['two_stream'] else 'one stream'}",
                      highlight=False)
        console.print(f"    {s['two_stream_evidence']}", style="dim", highlight=False)
        if s.get("weights"):
            console.print(f"    weights: {s['weights']}, each found in the checkpoint with its shape", style="dim",
                          highlight=False)
    sizes = r.get("mode_bytes")
    if sizes:
        console.print("blocks held, by --quantize mode: " + ", ".join(f"{m} {n / (1 << 30):.3g} GiB" for m, n in sizes),
                      highlight=False)
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


def mode_sizes(path: str, stacks: list[dict]) -> list[list]:
    """What every block of ``stacks`` takes held in the dtype a plain load computes in and in each ``--quantize``
    mode (int4 as a CPU node stores it), from the weights' headers; [] where they cannot be read."""
    from types import SimpleNamespace

    from diffuse.plan.analysis import ModelSubject
    from diffuse.plan.ggufread import gguf_parts
    from diffuse.plan.needs import block_costs, load_dtype
    from diffuse.plan.prequant import quant_method, quantize_modes

    try:
        subject = ModelSubject.from_path(path)
        dtype = load_dtype(subject)
        plan = [SimpleNamespace(path=s["path"], length=s["length"]) for s in stacks]
        plain = "gguf" if gguf_parts(subject) else quant_method(subject.path) or dtype  # held as the files hold it
        return [[m or plain, sum(b.weight_bytes for b in block_costs(subject, plan, dtype, quantize=m))]
                for m in quantize_modes(subject)]
    except (DiffuseError, OSError, ValueError, KeyError):
        return []


def _print_config(console, r: dict) -> None:
    """A transformers model's answers from config.json, each with the fields it rests on."""
    if not r.get("config"):
        return
    from diffuse.plan.verdicts import describe

    console.print("from config.json:", highlight=False)
    for line in describe(r["config"]):
        console.print(f"  {line}", highlight=False)


def main(argv: list[str] | None = None) -> int:
    """``python -m diffuse.cli.check keep MODEL...``: write each model folder's kept verdict (``keep``)."""
    import argparse

    from diffuse.plan.resolve import resolve_model

    ap = argparse.ArgumentParser(prog="python -m diffuse.cli.check", description=main.__doc__.split("\n")[0])
    ap.add_argument("action", choices=["keep"])
    ap.add_argument("models", nargs="+", metavar="MODEL", help="a model folder or a shipped model's name")
    a = ap.parse_args(argv)
    for model in a.models:
        path = resolve_model(model, "headers")
        verdict = keep(path)
        print(f"{os.path.join(path, VERDICT_FILE)}: {verdict['check']['verdict']}"
              f"{'; sizes ' + json.dumps(verdict['sizes']['largest']) if verdict.get('sizes') else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
