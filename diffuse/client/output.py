"""What a diffusion run writes and says at its end (``finish``): the pipeline's result as an array
(``output_array``) written by the writers' hook (``write_output``, ``diffuse.client.writers``, which checked the
path before anything loaded: ``check_output_path``), what a split run adds to the report (``split_report``),
and the summary lines (``summarize``)."""

from __future__ import annotations

import json
import os
import time

import numpy as np

from diffuse.errors import DiffuseError

def output_array(result) -> np.ndarray:
    arr = result[0] if not isinstance(result, (np.ndarray,)) else result
    if hasattr(arr, "detach"):
        arr = arr.detach().cpu().float().numpy()
    return np.asarray(arr)


def write_output(arr: np.ndarray, out: str | None, draft: dict, pipe) -> str:
    from diffuse.plan.plugins import call_hook
    from diffuse.client.writers import DEFAULT_SUFFIX, OutputInfo

    kind = draft.get("output_kind", "image")
    out = out or "out"
    if not os.path.splitext(out)[1]:
        out += DEFAULT_SUFFIX[kind]
    info = OutputInfo(kind=kind, frame_rate=draft.get("frame_rate"), sample_rate=draft.get("sample_rate"))
    if kind == "audio" and not info.sample_rate:
        info.sample_rate = getattr(getattr(pipe, "vae", None), "config", {}).get("sampling_rate")
    written = call_hook("diffuse_write_output", result=arr, path=out, info=info)
    if written is None:
        raise DiffuseError(f"no output writer takes {kind} to {out!r}; use {DEFAULT_SUFFIX[kind]}")
    return written


def finish(result, q, pipe, kwargs: dict, split, times: dict, console) -> dict:
    """The end of a diffusion run of request ``q``: its ``result`` written (and saved as an array where asked),
    its report made (``times``: the phases' seconds, ``steps`` and the start ``t0``; ``split`` the run's
    ``diffuse.client.api.Split``, None when it ran whole), summarized and written where asked; returns the report."""
    info, out = pipe._diffuse, q.output
    arr = output_array(result)
    t0, steps = times.pop("t0"), times.pop("steps")
    report: dict = {"model": info.path, "mode": "whole" if split is None else "split",
                    "seconds": time.perf_counter() - t0, "steps": steps, "shape": list(arr.shape),
                    "kind": info.output_kind, "times": times}
    if out.save_array:
        np.save(out.save_array, arr.astype(np.float32, copy=False))
    rate = kwargs.get("frame_rate") or kwargs.get("fps")
    report["out"] = write_output(arr, out.out, dict(info.draft, frame_rate=rate) if rate else info.draft, pipe)
    if split is not None:
        report.update(split_report(split, q.ring.options))
    summarize(report, console)
    if out.report:
        with open(out.report, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return report


def split_report(split, options) -> dict:
    """What a split run adds to the report: the wire's figures, the return maps, what each side held, the links
    of its routes, and the figures of branch groups, the first-block cache and patches where ``options`` (the
    split's ``SplitOptions``) used them."""
    st = split.ring.channel_stats
    report = dict(
        transport=split.ring.scheme, calls=st.passes, bytes_sent=st.bytes_sent, bytes_received=st.bytes_received,
        per_stack=st.per_stack, return_maps={k: v.to_dict() for k, v in split.splitter.plan.return_maps.items()},
        client_block_params=split.splitter.held_block_parameters(), client_reused=split.splitter.reused,
        node_params=[r.get("params") for r in split.node_reports], node_stats=split.node_reports,
        messages=st.messages, returns=st.returns,
        links=[line for r in split.rings for line in split.repair.heard.route_lines([s.address for s in r.plan.route])])
    if len(split.rings) > 1:
        ring = split.ring
        report["branches"] = {"groups": len(split.rings), "ahead_used": ring.ahead_used,
                              "ahead_dropped": ring.ahead_dropped, "batches_cut": ring.batches_cut}
    if options.cache_threshold:
        report["first_block_cache"] = {"threshold": options.cache_threshold, "skipped": split.cache_skipped,
                                       "calls": split.cache_calls, "per_stack": split.cache}
    if options.patches > 1:
        report.update(patches=options.patches, patcher_calls=split.patch_calls, patches_used=split.patches_used,
                      patches_ahead=split.patch_ahead,
                      uncut={k: v for k, v in split.uncut.items() if k not in split.ring.uncut},
                      attention=split.attention_paths())
    return report


def summarize(r: dict, console) -> None:
    line = f"[bold green]wrote[/] {r['out']}  ({r['kind']}, shape {tuple(r['shape'])}) in {r['seconds']:.1f} s"
    console.print(line)
    t = r.get("times") or {}
    if t:
        console.print(f"  start-up {t['load'] + t.get('nodes', 0):.1f} s (analysis and loading {t['load']:.1f} s, "
                      f"nodes and session {t.get('nodes', 0):.1f} s); pipeline {t['pipeline']:.1f} s "
                      f"(through the last step {t['denoising']:.1f} s, decoding {t['pipeline'] - t['denoising']:.1f} s)",
                      soft_wrap=True)
    if r.get("calls"):
        steps = max(1, r.get("steps") or 1)
        wire = r["bytes_sent"] + r["bytes_received"]
        console.print(f"  {r['calls']} ring passes, {wire / steps / 1024:.1f} KiB on the client's wire per step "
                      f"({wire / 1024:.1f} KiB in all)", soft_wrap=True)
        for i, ns in enumerate(r.get("node_stats") or [], 1):
            if ns:
                console.print(f"  node {i}: {ns.get('messages', 0)} messages, {ns.get('bytes_in', 0) / 1024:.1f} KiB in, "
                              f"{ns.get('bytes_out', 0) / 1024:.1f} KiB out, busy {ns.get('busy_s', 0.0):.1f} s",
                              soft_wrap=True)
        for line in r.get("links") or []:
            console.print(f"  link {line}", soft_wrap=True)
        fbc = r.get("first_block_cache")
        if fbc:
            from diffuse.firstblock.client import summary_line

            console.print(f"  {summary_line(fbc['per_stack'], fbc['threshold'])}", soft_wrap=True)
        b = r.get("branches")
        if b:
            console.print(f"  {b['groups']} groups of nodes: {b['batches_cut']} calls cut between them by batch, "
                          f"{b['ahead_used']} answered by a pass sent ahead ({b['ahead_dropped']} sent ahead unused)",
                          soft_wrap=True)
        if r.get("patches", 1) > 1:
            from diffuse.pipefusion.client import describe_paths

            for stack, used in (r.get("patches_used") or {}).items():
                why = f" ({used['why']})" if used.get("why") else ""
                console.print(f"  {stack}: patches used {used['used']} of {used['asked']} asked{why}", soft_wrap=True)
            for stack, why in r.get("uncut", {}).items():
                console.print(f"  {stack}: uncut steps ({why})", soft_wrap=True)
            ahead = r.get("patches_ahead") or {}
            if ahead.get("used") or ahead.get("dropped"):
                console.print(f"  calls sent ahead while the one before finished: {ahead['used']} used, "
                              f"{ahead['dropped']} dropped", soft_wrap=True)
            for line in describe_paths(r.get("attention", {})):
                console.print(f"  {line}", soft_wrap=True)
