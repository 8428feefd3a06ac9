"""``python -m diffuse.bench quant``: what each ``--quantize`` mode saves and what it costs, side by side in one run.

Three parts (``--parts``, default all three), each mode beside the unquantized model, one torch thread everywhere:

- ``memory``, at a real model's geometry: Qwen2.5-1.5B's (``diffuse.bench.memory.QWEN25_15B``), seeded random
  bf16 weights, built into a temp folder. Per mode, two nodes holding a half of the layers each (``--blocks 1/2``
  and ``2/2``, ``--dtype bfloat16 --quantize MODE``), processes of their own (forked from the pre-imported
  launcher, as local nodes are; the floor below counts the libraries alike), and two tokens generated through
  them from this process (so that every weight a node holds has been read: an unquantized node's weights are
  pages of the file until then); then the first node's peak resident memory (VmHWM). The floor is the same on a
  2-layer model of the same class (the libraries and the runtime, which any node holds whatever its slice). Printed per mode: the slice as the planner
  counts it (``block_costs``), the peak, the peak above the floor, and that against the unquantized node's.
  Goals: int8 <= 0.55x, int4 <= 0.35x.
- ``diffusion``, on the shipped trained tiny-wan-shapes: the held-out prompts run whole and unquantized in this
  process (the baseline), then each prompt through one ring of two local nodes per mode, the modes taking turns
  prompt by prompt so that load on the machine falls on each alike. Per mode: seconds a run (mean +- standard
  error) and the ratio to unquantized, the mean and largest difference from the baseline in 8-bit levels, how
  often the prompt's colour and motion still measure as asked (``diffuse.train.props``), and the nodes' peak.
- ``lm``, on the shipped chat model: per mode, the model whole in this process with its layers quantized as its
  nodes hold them (tests/test_quant.py proves a split run says exactly this), read teacher-forced over the
  assistant's answers of held-out dialogues: how often its top token is the unquantized model's, and the
  perplexity of the answers. Then the same questions answered greedily through a ring of two local nodes per mode,
  modes taking turns: tokens/s (mean +- standard error over questions) and the ratio to unquantized, and how many
  answers are exactly right.

``--modes`` picks the modes (default int8,int4,fp8; the unquantized model always runs beside them). ``--quick``:
tiny geometries and few prompts, for a smoke test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time

import numpy as np

from diffuse.bench.kit import mean_se
from diffuse.home import libraries_offline
from diffuse.text import plain

libraries_offline()

GIB = 1 << 30
GOALS = {"int8": 0.55, "int4": 0.35}
PARTS = ("memory", "diffusion", "lm")


def _label(mode: str) -> str:
    return mode or "none"


# --------------------------------------------------------------------------- memory at a real geometry


def _node(path: str, blocks: str, mode: str, dtype: str = "bfloat16"):
    """A node of ``path`` holding ``blocks`` in ``mode``, started and ready: (process, its pinned address)."""
    from diffuse.local.launcher import POOL

    args = ["-m", "diffuse.node", "--model", path, "--blocks", blocks, "--dtype", dtype, "--ephemeral-key",
            "--threads", "1", "--log-level", "WARNING", *(["--quantize", mode] if mode else [])]
    # forked from the pre-imported launcher, as local nodes are: a process of its own, its libraries imported once
    proc = POOL.spawn(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, DIFFUSE_DEVICE="cpu"))
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"the {_label(mode)} node did not start: {proc.stderr.read()[-2000:]}")
    ready = json.loads(line)
    return proc, f"{ready['address']}#{ready['key']}"


def _after_a_pass(path: str, client, mode: str, tokens: int = 2) -> tuple[int, int]:
    """The peak and the present resident bytes of the node holding the first half of ``path``'s layers in
    ``mode``, after a generation of ``tokens`` through it and the node holding the second half (every weight it
    holds read)."""
    import torch

    import diffuse
    from diffuse.bench.kit import peak_bytes
    from diffuse.bench.memory import _prompt

    with open(os.path.join(path, "config.json")) as f:
        ids = _prompt(json.load(f)["vocab_size"])
    first, second = _node(path, "1/2", mode), _node(path, "2/2", mode)
    try:
        with diffuse.split(client, nodes=[first[1], second[1]], quantize=mode or None, timeout=600,
                           speculate="off"), torch.no_grad():
            client.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                            do_sample=False)
        return peak_bytes(first[0].pid), peak_bytes(first[0].pid, "VmRSS")
    finally:
        for proc, _ in (first, second):
            proc.terminate()
            proc.wait(60)


def memory_part(quick: bool, modes: list[str], console) -> None:
    import diffuse
    from diffuse.bench.memory import QUICK, QWEN25_15B, build
    from diffuse.plan.analysis import ModelSubject
    from diffuse.plan.needs import block_costs
    from diffuse.plan.planner import analyze

    tmp = tempfile.mkdtemp(prefix="diffuse-bench-quant-")
    try:
        big, small = os.path.join(tmp, "model"), os.path.join(tmp, "floor")
        geometry = dict(QUICK, hidden_size=128, intermediate_size=384) if quick else QWEN25_15B
        t0 = time.perf_counter()
        build(big, geometry)
        build(small, dict(QUICK, num_hidden_layers=2))
        console.print(f"memory: {'a tiny model' if quick else 'Qwen2.5-1.5B'}'s geometry ({geometry['num_hidden_layers']} "
                      f"layers, hidden {geometry['hidden_size']}), bf16 random weights, built in "
                      f"{time.perf_counter() - t0:.0f} s; the node holding layers 1/2 of two, after 2 tokens through "
                      "both", highlight=False)
        subject, draft = ModelSubject.from_path(big), analyze(big)[1]
        half = draft["stacks"][0].length // 2
        floor, floor_now = _after_a_pass(small, diffuse.from_pretrained(small), "")
        console.print(f"  floor (the same on a 2-layer model): {floor / GIB:.2f} GiB", highlight=False)
        client = diffuse.from_pretrained(big)
        rows, base = [], None
        for mode in ["", *modes]:
            slice_bytes = sum(b.weight_bytes for b in block_costs(subject, draft["stacks"], "bfloat16",
                                                                  quantize=mode)[:half])
            peak, now = _after_a_pass(big, client, mode)
            above, held = max(peak - floor, 1), max(now - floor_now, 1)
            base = base or (above, held)
            rows.append((mode, slice_bytes, peak, above, above / base[0], held / base[1]))
        console.print(f"  {'mode':<6} {'slice (planned)':>16} {'node peak':>10} {'above floor':>12} {'vs none':>8} "
                      f"{'held after, vs none':>20}", highlight=False)
        for mode, slice_bytes, peak, above, ratio, after in rows:
            goal = GOALS.get(mode)
            verdict = f"  goal (peak) <= {goal:.2f}x: {'met' if ratio <= goal else 'not met'}" if goal else ""
            console.print(f"  {_label(mode):<6} {slice_bytes / GIB:>12.3f} GiB {peak / GIB:>6.2f} GiB "
                          f"{above / GIB:>8.2f} GiB {ratio:>7.2f}x {after:>19.2f}x{verdict}", highlight=False)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- the shipped models


def _rings(model: str, modes: list[str]) -> dict:
    """Two local nodes per mode (the unquantized ring first), started side by side."""
    from diffuse.local.nodes import start_local_nodes

    rings = {}
    try:
        for mode in ["", *modes]:
            rings[mode] = start_local_nodes(model, 2, threads=1, extra=["--quantize", mode] if mode else [])
    except BaseException:
        _stop(rings)
        raise
    return rings


def _stop(rings: dict) -> None:
    for nodes in rings.values():
        nodes.stop(hurry=True)


def _peaks(nodes) -> float:
    from diffuse.bench.kit import peak_bytes

    return max(peak_bytes(n.proc.pid) for n in nodes) / GIB


def _pinned(nodes) -> list[str]:
    return [f"{n.address}#{n.key}" for n in nodes]


def diffusion_part(quick: bool, modes: list[str], steps: int, n_prompts: int | None, console) -> None:
    import torch

    import diffuse
    from diffuse.bench.quality import _diff, _generate, _holds
    from diffuse.client.api import ModelInfo
    from diffuse.plan.planner import load_pipeline
    from diffuse.plan.shipped import default_model_dir
    from diffuse.train.data import heldout_prompts

    model = default_model_dir()
    prompts = heldout_prompts()[: n_prompts or (1 if quick else 4)]
    steps = 2 if quick else steps
    whole_pipe = load_pipeline(model)
    whole_pipe._diffuse = ModelInfo.of(model, "whole")
    whole = {p: _generate(whole_pipe, p, steps, 0) for p in prompts}
    pipe = diffuse.from_pretrained(model)
    rings = _rings(model, modes)
    seconds = {m: [] for m in rings}
    diffs, holds = {m: [] for m in rings}, {m: 0 for m in rings}
    try:
        for prompt in prompts:
            for mode, nodes in rings.items():  # the modes take turns, prompt by prompt
                with diffuse.split(pipe, nodes=_pinned(nodes), quantize=mode or None):
                    t0 = time.perf_counter()
                    out = _generate(pipe, prompt, steps, 0)
                    seconds[mode].append(time.perf_counter() - t0)
                diffs[mode].append(_diff(out, whole[prompt]))
                holds[mode] += _holds(prompt, out)
        peaks = {m: _peaks(n) for m, n in rings.items()}
    finally:
        _stop(rings)
    del torch
    console.print(f"diffusion: {os.path.basename(model)}, {len(prompts)} held-out prompt(s), {steps} steps, 2 nodes; "
                  "against the whole unquantized run (8-bit levels)", highlight=False)
    console.print(f"  {'mode':<6} {'s a run':>14} {'vs none':>8} {'mean |diff|':>12} {'max':>5} {'colour+motion':>14} "
                  f"{'node peak':>10}", highlight=False)
    base = mean_se(seconds[""])[0]
    for mode in rings:
        m, se = mean_se(seconds[mode])
        d = np.stack(diffs[mode])
        console.print(f"  {_label(mode):<6} {m:>8.2f} +- {se:.2f} {base / m:>7.2f}x {d.mean():>12.3f} {int(d.max()):>5} "
                      f"{holds[mode]:>9}/{len(prompts):<4} {peaks[mode]:>6.2f} GiB", highlight=False)


def _teacher_forced(model, tokenizer, dialogues) -> tuple[list, list]:
    """Per dialogue: the logits at each position that predicts an answer token, and those tokens."""
    import torch

    from diffuse.train.chat import encode

    logits, targets = [], []
    for messages in dialogues:
        ids, labels = encode(tokenizer, messages)
        with torch.no_grad():
            out = model(torch.tensor([ids])).logits[0, :-1].float()
        want = torch.tensor(labels[1:])
        keep = want != -100
        logits.append(out[keep])
        targets.append(want[keep])
    return logits, targets


def lm_part(quick: bool, modes: list[str], n_questions: int | None, console) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import diffuse
    from diffuse.plan.planner import analyze
    from diffuse.plan.quantize import quantize_blocks
    from diffuse.plan.shipped import default_chat_model_dir
    from diffuse.train import chat_data

    model_dir = default_chat_model_dir()
    per_task = n_questions or (1 if quick else 6)
    turns = [t for task in chat_data.TASKS for t in chat_data.held_out_turns(task, per_task)]
    dialogues = [[{"role": "user", "content": t.user}, {"role": "assistant", "content": t.answer}] for t in turns]
    tok = AutoTokenizer.from_pretrained(model_dir)
    stacks = analyze(model_dir)[1]["stacks"]
    read = {}
    for mode in ["", *modes]:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        quantize_blocks(model, [st.path for st in stacks], mode)
        read[mode] = _teacher_forced(model, tok, dialogues)
    rings = _rings(model_dir, modes)
    rate = {m: [] for m in rings}
    right = {m: 0 for m in rings}
    split_model = diffuse.from_pretrained(model_dir)
    try:
        for t in turns:
            ids = tok.apply_chat_template([{"role": "user", "content": t.user}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)
            for mode, nodes in rings.items():
                with diffuse.split(split_model, nodes=_pinned(nodes), quantize=mode or None,
                                   speculate="off"), torch.no_grad():
                    t0 = time.perf_counter()
                    out = split_model.generate(**ids, max_new_tokens=4 if quick else 32, do_sample=False)
                    spent = time.perf_counter() - t0
                new = out[0, ids["input_ids"].shape[1]:]
                rate[mode].append(len(new) / spent)
                right[mode] += tok.decode(new, skip_special_tokens=True).strip() == t.answer
        peaks = {m: _peaks(n) for m, n in rings.items()}
    finally:
        _stop(rings)
    base_logits, targets = read[""]
    n_tokens = sum(len(t) for t in targets)
    console.print(f"lm: {os.path.basename(model_dir)}, {len(turns)} held-out dialogues ({n_tokens} answer tokens "
                  f"read teacher-forced), answers of up to {4 if quick else 32} tokens through 2 nodes", highlight=False)
    console.print(f"  {'mode':<6} {'top-1 = none':>12} {'perplexity':>11} {'tokens/s':>16} {'vs none':>8} "
                  f"{'answers right':>14} {'node peak':>10}", highlight=False)
    base = mean_se(rate[""])[0]
    for mode in rings:
        logits, _ = read[mode]
        agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(logits, base_logits)) / n_tokens
        nll = sum(float(torch.nn.functional.cross_entropy(lg, tg, reduction="sum")) for lg, tg in zip(logits, targets))
        m, se = mean_se(rate[mode])
        console.print(f"  {_label(mode):<6} {agree:>12.3f} {float(np.exp(nll / n_tokens)):>11.3f} {m:>9.1f} +- {se:<4.1f} "
                      f"{m / base:>7.2f}x {right[mode]:>8}/{len(turns):<5} {peaks[mode]:>6.2f} GiB", highlight=False)


def main(argv: list[str] | None = None) -> int:
    import torch
    from rich.console import Console

    from diffuse.flags import Parser, positive, quiet_libraries
    from diffuse.plan.quantize import MODES, check_mode

    quiet_libraries()
    ap = Parser(prog="diffuse bench quant", description=plain(__doc__.split("\n")[0]))
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated --quantize modes beside none")
    ap.add_argument("--steps", type=positive, default=20, help="denoising steps of the diffusion part (default 20)")
    ap.add_argument("--prompts", type=positive, default=None, help="held-out prompts of the diffusion part "
                    "(default 4), and questions per task of the lm part (default 6)")
    ap.add_argument("--quick", action="store_true", help="tiny geometries, few prompts: a smoke test")
    a = ap.parse_args(argv)
    parts = [p for p in a.parts.split(",") if p]
    modes = [m for m in a.modes.split(",") if m and m != "none"]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"--parts {bad[0]}: choose from {', '.join(PARTS)}")
    from diffuse.errors import DiffuseError

    try:
        for m in modes:
            check_mode(m)
    except DiffuseError as exc:
        ap.exit(2, f"{ap.prog}: error: {exc}\n")
    torch.set_num_threads(1)
    console = Console(width=160)
    for part in parts:
        t0 = time.perf_counter()
        if part == "memory":
            memory_part(a.quick, modes, console)
        elif part == "diffusion":
            diffusion_part(a.quick, modes, a.steps, a.prompts, console)
        else:
            lm_part(a.quick, modes, a.prompts, console)
        console.print(f"  ({part}: {time.perf_counter() - t0:.0f} s; load {os.getloadavg()[0]:.2f})\n", highlight=False)
    return 0
