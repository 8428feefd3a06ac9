"""What a language model's run reports (``diffuse.cli.language``, ``diffuse.cli.compose``): the best candidates of each step
bit for bit (``top_candidates``), the parameters the client still holds (``held_parameters``, the head's and
the embedding's), what a split run adds (``text_split_report``: the wire's figures per token, each node's, the
links of its route, the draws where tokens were drawn on the last node, what drafting did), and the summary
lines (``summarize``)."""

from __future__ import annotations


TOP_SAVED = 8  # candidates per step written to --report: ids and exact values


def top_candidates(logits_row, k: int = TOP_SAVED) -> dict:
    """The ``k`` largest raw logits of one step, by value then lowest id (as argmax picks), values as the
    hex of their float32 bytes, so two runs can be compared bit for bit."""
    import numpy as np

    values = logits_row.detach().float().cpu().numpy()
    order = np.lexsort((np.arange(values.shape[0]), -values))[:k]
    return {"ids": [int(i) for i in order], "values_hex": [v.tobytes().hex() for v in values[order].astype("<f4")]}


def held_parameters(model) -> int:
    """Elements of the model's parameters that are real here (handed-out layers are on meta), the modules
    that stand-ins replaced (embedding, head) included, each parameter once."""
    splitter = getattr(model, "_diffuse_splitter", None)
    originals = [m for m in (getattr(splitter, "embed", None), getattr(splitter, "head", None)) if m is not None]
    params = {id(p): p for p in model.parameters()}
    params.update({id(p): p for _, m in originals for p in m.parameters()})
    return sum(p.numel() for p in params.values() if p.device.type != "meta")


def head_params_held(splitter) -> int | None:
    """Elements of the output head's weights still held here: 0 once the last node runs it; None where the
    head shares its weights with an input embedding the client keeps (tied weights)."""
    if splitter.head is None:
        return None
    if splitter.head_tied and splitter.embed is None:
        return None
    return sum(p.numel() for p in splitter.head[1].parameters() if p.device.type != "meta")


def embedding_report(splitter) -> dict:
    """Where the input embedding table lives, the parameters of it held here, and why it stays here if it does."""
    if splitter.embed is None:
        return {"embedding": "client", "embedding_kept_because": splitter.embed_kept}
    return {"embedding": "first node", "embed_passes": splitter.embed_passes,
            "client_embedding_params": sum(p.numel() for p in splitter.embed[1].parameters()
                                           if p.device.type != "meta")}


def text_split_report(split, new_tokens: int) -> dict:
    """What a split language-model run adds to the report: the wire's figures per token, what the client still
    holds, each node's figures, the links of its route and, where tokens were drawn on the last node, the draws."""
    st = split.ring.channel_stats
    per_token = max(1, new_tokens)
    report = dict(
        transport=split.ring.scheme, calls=st.passes, bytes_sent=st.bytes_sent, bytes_received=st.bytes_received,
        last_hop_bytes_per_token=st.bytes_received / per_token,
        last_hop_max_bytes=st.max_return_bytes,
        client_layer_params=split.splitter.held_block_parameters(),
        tail_passes=split.splitter.tail_passes,
        client_head_params=head_params_held(split.splitter),
        **embedding_report(split.splitter),
        node_stats=[dict(r, address=s.address, bytes_per_token_in=r.get("bytes_in", 0) / per_token)
                    for s, r in zip(split.plan.route, split.node_reports)],
        links=split.repair.heard.route_lines([s.address for s in split.plan.route]), messages=st.messages)
    drafting = split.splitter.drafting
    if drafting is not None and drafting.last is not None:  # drafts verified by the ring (diffuse.lm.client_drafts)
        report["speculation"] = {"drafter": drafting.name, **drafting.last.report(new_tokens)}
    draw = split.splitter.last_draw
    if draw is not None:  # the tokens were drawn on the last node (diffuse.lm.sampling)
        report["sampling"] = {"draws": draw.draws, "generator_states_sent": draw.states_sent,
                              "processors": draw.described}
    return report


def summarize(r: dict, console) -> None:
    rate = r["new_tokens"] / r["times"]["generate"] if r["times"].get("generate") else 0.0
    first = f", first token {r['first_token_s']:.2f} s" if r.get("first_token_s") is not None else ""
    console.print(f"[bold green]{r['new_tokens']} tokens[/] after a prompt of {r['prompt_tokens']} in "
                  f"{r['times']['generate']:.1f} s ({rate:.1f} tokens/s{first}); start-up "
                  f"{r['times']['load'] + r['times'].get('nodes', 0):.1f} s", soft_wrap=True)
    if r.get("calls"):
        head = ("shares the input embedding's weights (tied), kept here" if r.get("client_head_params") is None
                else f"{r['client_head_params']} parameters of it held here")
        console.print(f"  {r['calls']} ring passes, {r.get('tail_passes', 0)} ending in the final norm and output head "
                      f"on the last node (head: {head}); last hop {r['last_hop_bytes_per_token']:.0f} B per token; "
                      f"client holds {r['client_layer_params']} decoder-layer parameters", soft_wrap=True)
        if r.get("embedding") == "first node":
            console.print(f"  embedding table on the first node: {r.get('embed_passes', 0)} passes sent token ids, "
                          f"{r.get('client_embedding_params', 0)} parameters of it held here", soft_wrap=True)
        elif r.get("embedding"):
            console.print(f"  embedding table kept here: {r.get('embedding_kept_because')}", soft_wrap=True)
        if r.get("sampling"):
            sm = r["sampling"]
            console.print(f"  {sm['draws']} tokens drawn on the last node after "
                          f"{', '.join(name for name, _ in sm['processors']) or 'no processor'}; the client's "
                          f"generator state sent {sm['generator_states_sent']} time(s)", soft_wrap=True)
        if r.get("speculation"):
            console.print(f"  {speculation_line(r['speculation'])}", soft_wrap=True)
        for i, ns in enumerate(r.get("node_stats") or [], 1):
            console.print(f"  node {i}: {ns.get('messages', 0)} messages, {ns.get('bytes_in', 0) / 1024:.1f} KiB in, "
                          f"{ns.get('bytes_out', 0) / 1024:.1f} KiB out, cache {ns.get('cache_bytes', 0) / 1024:.1f} KiB, "
                          f"busy {ns.get('busy_s', 0.0):.2f} s", soft_wrap=True)
        for line in r.get("links") or []:
            console.print(f"  link {line}", soft_wrap=True)


def speculation_line(sp: dict) -> str:
    """One line of what drafting did: tokens per trip, drafts and how many of their tokens were accepted."""
    rate = f"{100 * sp['acceptance']:.0f}%" if sp.get("acceptance") is not None else "-"
    per = f"{sp['tokens_per_trip']:.2f}" if sp.get("tokens_per_trip") is not None else "-"
    return (f"drafts by {sp['drafter']}: {per} tokens per trip over {sp['passes']} passes; {sp['drafts']} drafts "
            f"of {sp['drafted']} tokens, {sp['accepted']} accepted ({rate})")
