"""Ground truth for the first-block cache: a Wan pipeline run whole by plain diffusers, its blocks wrapped.

    python tests/cache_reference.py --model DIR --kwargs JSON --threshold T --out OUT.npy [--threshold T2 --out OUT2.npy]

The rule, written here against plain diffusers and nothing of the ``diffuse``
package: at each call into the transformer's blocks, block 0 runs and its
residual r (output minus input) is compared with the one kept at the last call
of the same branch (the same text conditioning) that ran every block:
mean|r - r_prev| / mean|r_prev|. Below T the other blocks do not run and the
output is block 0's output plus what they added at that last full call; else
they run, and r and what they added are kept. Threshold 0 never skips: the
pipeline as it is. For each threshold (the pipeline loaded once, the cache
started anew) prints a JSON line with the calls and the skipped ones, and saves
the pipeline's array as float32.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch


class FirstBlockCache:
    def __init__(self, threshold: float, length: int):
        self.threshold, self.length = threshold, length
        self.conditioning: list[torch.Tensor] = []  # one per branch
        self.first: dict[int, torch.Tensor] = {}
        self.rest: dict[int, torch.Tensor] = {}
        self.branch = 0
        self.skip = False
        self.after_first = None
        self.calls = self.skipped = 0

    def branch_of(self, encoder_hidden_states: torch.Tensor) -> int:
        for b, c in enumerate(self.conditioning):
            if c.shape == encoder_hidden_states.shape and torch.equal(c, encoder_hidden_states):
                return b
        self.conditioning.append(encoder_hidden_states.clone())
        return len(self.conditioning) - 1


class Wrapped(torch.nn.Module):
    def __init__(self, index: int, block: torch.nn.Module, cache: FirstBlockCache):
        super().__init__()
        self.index, self.block, self.cache = index, block, cache

    def forward(self, hidden_states, encoder_hidden_states, *args):
        c = self.cache
        last = self.index == c.length - 1
        if self.index == 0:
            c.calls += 1
            c.branch = c.branch_of(encoder_hidden_states)
            out = self.block(hidden_states, encoder_hidden_states, *args)
            r = out - hidden_states
            prev = c.first.get(c.branch)
            c.skip = prev is not None and float((r.float() - prev.float()).abs().mean() / prev.float().abs().mean()) \
                < c.threshold
            if c.skip:
                c.skipped += 1
            else:
                c.first[c.branch] = r
            c.after_first = out
            return out
        if c.skip:
            return hidden_states + c.rest[c.branch] if last else hidden_states
        out = self.block(hidden_states, encoder_hidden_states, *args)
        if last:
            c.rest[c.branch] = out - c.after_first
        return out


def main(argv: list[str] | None = None) -> int:
    from diffusers import DiffusionPipeline

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--kwargs", default="{}")
    ap.add_argument("--threshold", type=float, action="append", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", action="append", required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    pipe = DiffusionPipeline.from_pretrained(a.model)
    pipe.set_progress_bar_config(disable=True)
    if len(a.threshold) != len(a.out):
        ap.error("give one --out per --threshold")
    blocks = list(pipe.transformer.blocks)
    for threshold, out_file in zip(a.threshold, a.out):
        cache = FirstBlockCache(threshold, len(blocks))
        pipe.transformer.blocks = torch.nn.ModuleList([Wrapped(i, b, cache) for i, b in enumerate(blocks)])
        with torch.no_grad():
            out = pipe(**json.loads(a.kwargs), generator=torch.Generator("cpu").manual_seed(a.seed), output_type="np")
        np.save(out_file, np.asarray(out[0], dtype=np.float32))
        print(json.dumps({"threshold": threshold, "calls": cache.calls, "skipped": cache.skipped}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
