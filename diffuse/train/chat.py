"""tiny-qwen-chat: a Qwen2-architecture chat model trained here on CPU, and its held-out evaluation.

commands (each takes --help):
  python -m diffuse.train chat [options]            train from scratch (the defaults made ``tiny-qwen-chat``)
  python -m diffuse.train chat evaluate [options]   held-out accuracy per task, against the same architecture untrained
  python -m diffuse.train chat card [options]       write the model card (README.md) from train_stats.json and eval.json

The model (``Qwen2ForCausalLM``, random seeded initialisation) learns from the
dialogues of ``diffuse.train.chat_data``, the loss on the assistant's turns only
(their text and the ``<|im_end|>`` that ends them). The folder it writes is a
plain transformers one: config.json, generation_config.json (greedy, stops at
``<|im_end|>``), model.safetensors and the tokenizer with its chat template.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import time
from dataclasses import asdict, dataclass

from diffuse.home import libraries_offline  # noqa: E402

libraries_offline()

from . import chat_data

CHAT_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "trained", "tiny-qwen-chat")
MAX_NEW_TOKENS = 48  # the generation config's default; the longest answer is 19 tokens

SIZES = {
    "full": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2),
    "wide": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=6,
                 num_key_value_heads=2),
    "quick": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1),
}


@dataclass
class ChatTrainConfig:
    out: str = CHAT_MODEL
    size: str = "full"
    steps: int = 2200
    batch: int = 48
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup: int = 200
    weight_decay: float = 0.01
    seed: int = 0
    threads: int = 1
    log_every: int = 100
    time_budget_min: float = 0.0  # wall-clock cap (0 = none); the LR schedule follows the clock


def build_model(vocab_size: int, size: str = "full", seed: int = 0, tokenizer=None):
    """The architecture with seeded random weights (the untrained baseline when not trained)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = tokenizer or chat_data.build_tokenizer()
    end, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen2Config(vocab_size=vocab_size, max_position_embeddings=512, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True,
                         bos_token_id=end, eos_token_id=end, pad_token_id=pad, dtype="float32", **SIZES[size])
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float()


def padded_vocab(tokenizer) -> int:
    return (len(tokenizer) + 63) // 64 * 64


def generation_config(tokenizer):
    from transformers import GenerationConfig

    end, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    return GenerationConfig(do_sample=False, eos_token_id=end, pad_token_id=pad, bos_token_id=end,
                            max_new_tokens=MAX_NEW_TOKENS)


def encode(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and its labels: the assistant's text and its ``<|im_end|>``, -100
    elsewhere. Each turn is tokenized alone: the template's turns meet at special tokens and newlines, where the
    pre-tokenizer cuts anyway (``check_encoding`` proves it on samples)."""
    ids: list[int] = []
    labels: list[int] = []
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for m in messages:
        head = tokenizer.encode(f"<|im_start|>{m['role']}\n", add_special_tokens=False)
        body = tokenizer.encode(m["content"], add_special_tokens=False)
        tail = tokenizer.encode("\n", add_special_tokens=False)
        ids += head + body + [end] + tail
        if m["role"] == "assistant":
            labels += [-100] * len(head) + body + [end] + [-100] * len(tail)
        else:
            labels += [-100] * (len(head) + len(body) + 1 + len(tail))
    return ids, labels


def check_encoding(tokenizer, n: int = 200) -> None:
    rng = random.Random("check encoding")
    for _ in range(n):
        messages = chat_data.training_dialogue(rng)
        ids, _ = encode(tokenizer, messages)
        whole = tokenizer.apply_chat_template(messages, tokenize=True)
        whole = whole["input_ids"] if isinstance(whole, dict) or hasattr(whole, "keys") else whole
        assert ids == list(whole), messages


def batches(tokenizer, rng: random.Random, batch: int, group: int = 4):
    """``group`` batches at a time, their dialogues sorted by length first so that little of each batch is
    padding; the batches come in a shuffled order."""
    import torch

    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    while True:
        rows = sorted((encode(tokenizer, chat_data.training_dialogue(rng)) for _ in range(batch * group)),
                      key=lambda r: len(r[0]))
        chunks = [rows[i:i + batch] for i in range(0, len(rows), batch)]
        rng.shuffle(chunks)
        for chunk in chunks:
            width = max(len(ids) for ids, _ in chunk)
            ids = torch.full((batch, width), pad, dtype=torch.long)
            labels = torch.full((batch, width), -100, dtype=torch.long)
            mask = torch.zeros((batch, width), dtype=torch.long)
            for i, (x, y) in enumerate(chunk):
                ids[i, :len(x)] = torch.tensor(x)
                labels[i, :len(y)] = torch.tensor(y)
                mask[i, :len(x)] = 1
            yield ids, labels, mask


def answer_loss(model, ids, labels, mask):
    """Next-token cross-entropy on the labelled positions, the output head run on those positions only (the
    mean over the same tokens as ``Qwen2ForCausalLM``'s own loss)."""
    import torch.nn.functional as F

    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
    target = labels[:, 1:]
    keep = target != -100
    return F.cross_entropy(model.lm_head(hidden[keep]), target[keep])


def train(cfg: ChatTrainConfig) -> dict:
    import torch

    torch.set_num_threads(cfg.threads)
    t0 = time.time()
    tok = chat_data.build_tokenizer()
    check_encoding(tok)
    chat_data.check_facts_trained()
    model = build_model(padded_vocab(tok), cfg.size, cfg.seed, tok)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.98))
    rng = random.Random(f"train {cfg.seed}")
    stream = batches(tok, rng, cfg.batch)
    budget = cfg.time_budget_min * 60
    curve, window, tokens_seen, loads = [], [], 0, []
    step = 0
    start = time.time()
    for step in range(1, cfg.steps + 1):
        progress = step / cfg.steps
        if budget:
            progress = max(progress, (time.time() - start) / budget)
            if progress >= 1.0:
                break
        lr = cfg.lr * min(1.0, step / cfg.warmup) * (
            cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
        for g in opt.param_groups:
            g["lr"] = lr
        ids, labels, mask = next(stream)
        loss = answer_loss(model, ids, labels, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens_seen += int(mask.sum())
        window.append(loss.item())
        if step % cfg.log_every == 0 or step == cfg.steps:
            loads.append(os.getloadavg()[0])
            avg = sum(window) / len(window)
            window = []
            curve.append([step, round(avg, 5)])
            el = time.time() - start
            print(f"step {step}/{cfg.steps}  loss {avg:.4f}  lr {lr:.2e}  {el / 60:.1f} min  "
                  f"{tokens_seen / el:.0f} tokens/s", flush=True)
    seconds = time.time() - start
    model.eval()
    save(model, tok, cfg.out)
    stats = {
        **asdict(cfg), "out": os.path.relpath(cfg.out), "steps_done": step if not budget or progress < 1.0 else step - 1,
        "train_seconds": round(seconds, 1), "total_seconds": round(time.time() - t0, 1),
        "tokens_seen": tokens_seen, "loss_curve": curve, "loss_first": curve[0][1] if curve else None,
        "loss_last": curve[-1][1] if curve else None, "params": sum(p.numel() for p in model.parameters()),
        "vocab": len(tok), "load_average": [round(min(loads), 1), round(max(loads), 1)] if loads else None,
        "machine": f"{platform.machine()}  {os.cpu_count()} cpus, torch {torch.__version__}",
    }
    with open(os.path.join(cfg.out, "train_stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
    return stats


def save(model, tokenizer, out: str) -> str:
    os.makedirs(out, exist_ok=True)
    model.generation_config = generation_config(tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out, save_jinja_files=False)  # the chat template inside tokenizer_config.json
    tokenizer.backend_tokenizer.model.save(out)  # vocab.json + merges.txt, which Qwen2Tokenizer reloads from
    return out


# ---- evaluation ------------------------------------------------------------------


def answer(model, tokenizer, messages: list[dict], max_new_tokens: int = MAX_NEW_TOKENS) -> str:
    """The model's greedy answer, as plain transformers gives it (the folder's generation config)."""
    import torch

    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def score(model, tokenizer, per_task: int, tasks=chat_data.TASKS) -> dict:
    result = {}
    for task in tasks:
        rows = []
        for turn in chat_data.held_out_turns(task, per_task):
            got = answer(model, tokenizer, [{"role": "user", "content": turn.user}])
            rows.append({"user": turn.user, "expected": turn.answer, "answer": got, "correct": got == turn.answer})
        result[task] = {"accuracy": sum(r["correct"] for r in rows) / max(1, len(rows)), "n": len(rows), "rows": rows}
    n = sum(result[t]["n"] for t in tasks)
    result["overall"] = {"accuracy": sum(result[t]["accuracy"] * result[t]["n"] for t in tasks) / max(1, n), "n": n}
    return result


def evaluate(model_dir: str = CHAT_MODEL, per_task: int = 100, baseline: bool = True, threads: int = 1,
             tasks=chat_data.TASKS) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    t0 = time.time()
    results = {"trained": score(model, tok, per_task, tasks)}
    results["trained"]["seconds"] = round(time.time() - t0, 1)
    if baseline:
        size = next(k for k, v in SIZES.items() if all(getattr(model.config, f) == n for f, n in v.items()))
        rnd = build_model(model.config.vocab_size, size, seed=1234, tokenizer=tok).eval()
        rnd.generation_config = generation_config(tok)
        results["untrained"] = score(rnd, tok, per_task, tasks)
    return results


def print_table(results: dict) -> None:
    """Exact-match accuracy per task and over every held-out dialogue (the overall row, each dialogue counted once)."""
    names = list(results)
    print(f"{'task':10s} " + " ".join(f"{n:>10s}" for n in names) + "   held-out dialogues")
    for t in [t for t in chat_data.TASKS if t in results[names[0]]] + ["overall"]:
        rates = " ".join(f"{results[n][t]['accuracy']:>10.1%}" for n in names)
        print(f"{t:10s} {rates}   {results[names[0]][t]['n']}")


def main(argv=None) -> int:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "evaluate":
        ap = argparse.ArgumentParser(prog="python -m diffuse.train chat evaluate",
                                     description="Held-out accuracy per task (exact answers, greedy), against the "
                                                 "same architecture with random weights.")
        ap.add_argument("--model", default=CHAT_MODEL)
        ap.add_argument("--per-task", type=int, default=100,
                        help="held-out dialogues per task (fewer where a task has fewer)")
        ap.add_argument("--task", action="append", choices=chat_data.TASKS, help="only this task (repeatable)")
        ap.add_argument("--threads", type=int, default=1)
        ap.add_argument("--no-baseline", action="store_true")
        ap.add_argument("--json", default=None, help="write the results here (default: eval.json in the model folder)")
        a = ap.parse_args(argv[1:])
        res = evaluate(a.model, a.per_task, not a.no_baseline, a.threads, tuple(a.task or chat_data.TASKS))
        print_table(res)
        with open(a.json or os.path.join(a.model, "eval.json"), "w") as f:
            json.dump(res, f, indent=1)
        return 0
    if argv and argv[0] == "card":
        from .chat_card import write_card

        ap = argparse.ArgumentParser(prog="python -m diffuse.train chat card")
        ap.add_argument("--model", default=CHAT_MODEL)
        a = ap.parse_args(argv[1:])
        print(write_card(a.model))
        return 0
    ap = argparse.ArgumentParser(prog="python -m diffuse.train chat", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    d = ChatTrainConfig()
    ap.add_argument("--out", default=d.out, help="model folder to write (default: the shipped model)")
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--batch", type=int, default=d.batch, help="dialogues per step")
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--threads", type=int, default=d.threads)
    ap.add_argument("--size", choices=sorted(SIZES), default=d.size)
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="stop after this many minutes (the LR schedule follows the clock)")
    ap.add_argument("--log-every", type=int, default=d.log_every, help="steps between loss lines")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, a few dozen steps (for tests)")
    a = ap.parse_args(argv)
    cfg = ChatTrainConfig(out=a.out, steps=a.steps, batch=a.batch, lr=a.lr, seed=a.seed, threads=a.threads,
                          size=a.size, time_budget_min=a.time_budget, log_every=a.log_every)
    if a.quick:
        cfg.size, cfg.steps, cfg.batch, cfg.warmup, cfg.log_every, cfg.lr = "quick", 30, 8, 5, 10, 1e-2
    train(cfg)
    return 0
