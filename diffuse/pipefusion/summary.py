"""What the run summary says about PipeFusion's attention, from the nodes' close reports."""

from __future__ import annotations

from diffuse.pipefusion.buffers import QUICK_TOLERANCE


def attention_paths(node_stats: list[dict]) -> dict[str, dict]:
    """Per stack, the attention path its blocks took, merged over the nodes' close reports:
    ``{"path": "quick" | "plain" | "mixed" | "none", "blocks": {i: ...}, "branches", "patches",
    "agreement": worst measured}``.

    >>> r = {"stale": {"blocks": {"paths": {"0": {"path": "quick", "agreement": 1e-6, "why": ""}},
    ...                           "branches": 2, "patches": 4, "buffer_bytes": 1}}}
    >>> m = attention_paths([r, None])["blocks"]; (m["path"], m["branches"], m["agreement"])
    ('quick', 2, 1e-06)
    """
    merged: dict[str, dict] = {}
    for ns in node_stats:
        for stack, rep in ((ns or {}).get("stale") or {}).items():
            m = merged.setdefault(stack, {"blocks": {}, "branches": 0, "patches": 0})
            m["blocks"].update({int(k): v for k, v in rep["paths"].items()})
            m["branches"] = max(m["branches"], rep["branches"])
            m["patches"] = max(m["patches"], rep["patches"])
    for m in merged.values():
        kinds = {b["path"] for b in m["blocks"].values()}
        m["path"] = kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else "none")
        errs = [b["agreement"] for b in m["blocks"].values() if b.get("agreement") is not None]
        m["agreement"] = max(errs) if errs else None
        m["blocks"] = dict(sorted(m["blocks"].items()))
    return merged


def describe_paths(paths: dict[str, dict]) -> list[str]:
    """One line per stack for the run summary (``paths`` from ``attention_paths``)."""
    lines = []
    for stack, m in paths.items():
        n = len(m["blocks"])
        agree = ("" if m["agreement"] is None
                 else f", quick vs plain {m['agreement']:.1e} (relative; kept under {QUICK_TOLERANCE:g})")
        if m["path"] == "mixed":
            quick = sum(b["path"] == "quick" for b in m["blocks"].values())
            lines.append(f"{stack}: quick attention in {quick} of {n} blocks, plain in the rest{agree}")
        else:
            why = next((b["why"] for b in m["blocks"].values() if b.get("why")), "")
            lines.append(f"{stack}: {m['path']} attention in all {n} blocks{agree}"
                         + (f" ({why})" if why and m["path"] == "plain" else ""))
    return lines
