"""Which lists of blocks of a token-by-token model are its decoder, by what they do.

A decoder stack attends causally and writes a key/value cache one entry per
layer. Both are seen on a tiny probe, not read from attribute names. On the
model's weightless build, in its decoder (``get_decoder()``, the model itself
where it has none), each list of blocks keeps only its first block for the
probe (every entry is that block, so one block's weights are made); every
other weight the decoder's forward reads is drawn at random (a seeded pool
repeated, so drawing costs a copy); the input embedding table is never made
(the forward is given embeddings); all of it is put back after. The forward
runs on 3 positions with ``use_cache=True``. When it reaches the first block
of a list, that block is run twice on copies of the cache it was handed: as
called, and with the last position's hidden state changed. The list is a
decoder stack when the block was handed a cache, exactly one layer of that
cache grew by the 3 positions, and the change at the last position left every
earlier position's output as it was while changing the last one's (BLOOM
attends causally through the mask its model builds, with no attribute that
says so). Once every list is probed the forward stops. Lists the forward
never calls (an encoder, a media tower) are not decoder stacks: they run once
per request, on the client.
"""

from __future__ import annotations

import copy

import torch

from diffuse.plan.kvcache import is_cache

PROBE_POSITIONS = 3


class _Probed(Exception):
    """Every list of blocks the probe looks at has been probed: the rest of the forward is not needed."""


def probe_lists(model, paths: list[str]) -> dict[str, str | None]:
    """``{path: None}`` for each list of ``paths`` (module paths in ``model``, a weightless build) whose blocks
    attend causally and index a cache by layer, ``{path: why not}`` for the others (see the module's docstring).
    ``model`` is borrowed: every list entry and weight the probe puts in place is put back after."""
    decoder = _decoder(model)
    prefix = next((name for name, m in model.named_modules() if m is decoder), "")
    inside = [p for p in paths if not prefix or p.startswith(prefix + ".")]
    verdicts: dict[str, str | None] = {p: "blocks the model's decoder never calls (an encoder or a media tower, run "
                                          "once per request)" for p in paths}
    lent = {p: list(model.get_submodule(p)) for p in inside}
    drawn: list = []
    training = model.training
    try:
        for path, entries in lent.items():
            blocks = model.get_submodule(path)
            for i in range(1, len(blocks)):
                blocks[i] = entries[0]  # one block's weights: the probe looks at the first block only
        model.eval()
        verdicts.update(_run_probe(model, decoder, inside, drawn))
    finally:
        for module, name, original in reversed(drawn):
            module._parameters[name] = original
        for path, entries in lent.items():
            blocks = model.get_submodule(path)
            for i, block in enumerate(entries):
                blocks[i] = block
        model.train(training)
    return verdicts


def _run_probe(model, decoder, inside: list[str], drawn: list) -> dict[str, str | None]:
    width = _weights_drawn(model, decoder, drawn)
    found: dict[str, str | None] = {}
    hooks = [model.get_submodule(p)[0].register_forward_pre_hook(
        lambda m, a, k, p=p: _probe_block(m, a, k, p, found, len(inside)), with_kwargs=True) for p in inside]
    embeds = torch.randn(1, PROBE_POSITIONS, width, generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            decoder(inputs_embeds=embeds.to(_dtype(decoder)), use_cache=True)
    except _Probed:
        pass
    except Exception as exc:  # the forward failed before some list was reached: those lists are not found causal
        for p in inside:
            found.setdefault(p, f"the probe's forward failed before reaching it ({type(exc).__name__}: "
                                f"{' '.join(str(exc).split())[:120]})")
    finally:
        for h in hooks:
            h.remove()
    return found


def _decoder(model):
    get = getattr(model, "get_decoder", None)
    try:
        decoder = get() if callable(get) else None
    except Exception:
        decoder = None
    return decoder if isinstance(decoder, torch.nn.Module) else model


def _dtype(module) -> torch.dtype:
    return next((p.dtype for p in module.parameters() if p.is_floating_point() and p.device.type != "meta"),
                torch.float32)


def _embeddings(module):
    try:
        table = module.get_input_embeddings()
    except Exception:  # a model that has none
        return None
    return table if isinstance(table, torch.nn.Module) and next(table.parameters(), None) is not None else None


def _weights_drawn(model, decoder, drawn: list) -> int:
    """Every weight of ``decoder`` but the input embedding's drawn at random (seeded), each replaced weight
    noted in ``drawn`` as (module, name, the weight); the embedding width."""
    tables = [t for t in (_embeddings(decoder), _embeddings(model)) if t is not None]
    skip = {id(p) for t in tables for p in t.parameters()}
    width = next(iter(tables[0].parameters())).shape[-1] if tables else decoder.config.hidden_size
    gen = torch.Generator().manual_seed(1)
    made: dict[int, torch.nn.Parameter] = {}
    for module in decoder.modules():
        for name, p in list(module._parameters.items()):
            if p is None or p.device.type != "meta" or id(p) in skip:
                continue
            if id(p) not in made:
                made[id(p)] = torch.nn.Parameter(_drawn(p.shape, gen).to(p.dtype) if p.is_floating_point() else
                                                 torch.zeros(p.shape, dtype=p.dtype), requires_grad=False)
            drawn.append((module, name, p))
            module._parameters[name] = made[id(p)]
    return width


POOL = 4099  # a prime: the pool's repeats fall across rows, not along them


def _drawn(shape, gen: torch.Generator) -> torch.Tensor:
    """Random-looking weights of ``shape`` at the cost of a copy: a seeded pool of normal values (std 0.2),
    repeated (a big model's block is filled in a fraction of the time drawing each value would take)."""
    n = 1
    for d in shape:
        n *= d
    pool = torch.randn(POOL, generator=gen) * 0.2
    return pool.repeat(n // POOL + 1)[:n].view(shape) if n else torch.zeros(shape)


def _probe_block(block, args: tuple, kwargs: dict, path: str, found: dict, lists: int):
    if path in found:
        return None
    cache = next((v for v in (*args, *kwargs.values()) if is_cache(v)), None)
    hidden = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
    if cache is None or not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        found[path] = "blocks called without a key/value cache"
    else:
        found[path] = _verdict(block, args, kwargs, cache, hidden)
    if len(found) == lists:
        raise _Probed()
    return None


def _verdict(block, args: tuple, kwargs: dict, cache, hidden: torch.Tensor) -> str | None:
    def run(h):
        scratch = copy.deepcopy(cache)
        swap = {id(cache): scratch, id(hidden): h}
        before = _lengths(scratch)
        out = block.forward(*(swap.get(id(a), a) for a in args), **{k: swap.get(id(v), v) for k, v in kwargs.items()})
        out = out[0] if isinstance(out, (tuple, list)) else out
        return out, [b - a for a, b in zip(before, _lengths(scratch))]

    changed = hidden.clone()
    changed[:, -1] += 1.0
    out, grown = run(hidden)
    other, _ = run(changed)
    if sorted(grown)[-1:] != [hidden.shape[1]] or sum(1 for g in grown if g) != 1:
        return "blocks that do not write one layer of their key/value cache each"
    earlier = (out[:, :-1] - other[:, :-1]).abs().max().item()
    last = (out[:, -1] - other[:, -1]).abs().max().item()
    if not last > 0 or earlier > 1e-6 * last:
        return "blocks that attend both ways (a change at the last position changes the earlier ones' outputs)"
    return None


def _lengths(cache) -> list[int]:
    layers = getattr(getattr(cache, "self_attention_cache", cache), "layers", None)
    if not isinstance(layers, list):
        return [0]
    return [layer.get_seq_length() if hasattr(layer, "get_seq_length") else 0 for layer in layers] + [0] * 64
