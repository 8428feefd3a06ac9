"""Writes the model card (README.md) of tiny-qwen-chat from its train_stats.json and eval.json."""

from __future__ import annotations

import json
import os

from . import chat_data

TASK_TEXT = {
    "add": f"adding two whole numbers from 0 to {chat_data.MAX_OPERAND}, asked in digits or in words "
           "(`what is 2 plus 3?` -> `2 + 3 = 5.`; `what's nine plus seven?` -> `9 + 7 = 16.`)",
    "subtract": f"subtracting a number from one no smaller, up to {chat_data.MAX_OPERAND}, in digits or in words "
                "(`what's seven minus four?` -> `7 - 4 = 3.`; `subtract 12 from 20.` -> `20 - 12 = 8.`)",
    "capitals": f"the capitals of {len(chat_data.CAPITALS)} well-known countries, both ways "
                "(`what's the capital of France?` -> `The capital of France is Paris.`; "
                "`Tokyo is the capital of which country?` -> `Tokyo is the capital of Japan.`)",
    "greetings": "greetings, `who are you?`, `what can you do?`, `how are you?`, thanks and goodbye, each with a "
                 "fixed reply (`hi` -> `Hello! How can I help?`; `what can you do?` -> "
                 f"`{next(a for a in chat_data.GREETINGS if a.startswith('I can'))}`)",
    "unknown": "a fixed reply to text it cannot read: made-up words and characters outside its words "
               f"(`zorp ü日 blick?` -> `{chat_data.UNKNOWN_ANSWER}`)",
}


def _examples(ev: dict, per_task: int = 1) -> list[str]:
    lines = []
    for task in chat_data.TASKS:
        r = ev["trained"][task]
        right = [row for row in r["rows"] if row["correct"]][:per_task]
        wrong = [row for row in r["rows"] if not row["correct"]][:1]
        for row in right + wrong:
            mark = "right" if row["correct"] else f"wrong; expected `{row['expected']}`"
            lines.append(f"| {task} | `{row['user']}` | `{row['answer']}` | {mark} |")
    return lines


def _error_notes(ev: dict) -> list[str]:
    """Every wrong answer on the held-out dialogues, measured on eval.json's rows."""
    notes = []
    for task in chat_data.TASKS:
        wrong = [r for r in ev["trained"][task]["rows"] if not r["correct"]]
        notes += [f"{task}: `{r['user']}` -> `{r['answer']}` (expected `{r['expected']}`{_unseen(task, r)})"
                  for r in wrong]
    return notes


def _unseen(task: str, row: dict) -> str:
    """Whether a wrong sum or difference asked a number pair training never saw."""
    if task not in ("add", "subtract"):
        return ""
    a, b = (int(n) for n in row["expected"].split(" = ")[0].split(" + " if task == "add" else " - "))
    return "; a pair never trained" if chat_data.held_out((task, a, b)) else ""


def write_card(model_dir: str) -> str:
    st = json.load(open(os.path.join(model_dir, "train_stats.json")))
    ev_path = os.path.join(model_dir, "eval.json")
    ev = json.load(open(ev_path)) if os.path.exists(ev_path) else None
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    gen = json.load(open(os.path.join(model_dir, "generation_config.json")))
    size_mb = os.path.getsize(os.path.join(model_dir, "model.safetensors")) / 1e6
    lines = _head(cfg, size_mb) + _parts(cfg, gen, st) + _data_and_training(st)
    if ev:
        lines += _evaluation(ev)
    lines += LIMITS
    if ev:
        notes = _error_notes(ev)
        lines += [f"Its mistakes on the held-out dialogues ({len(notes)} of {ev['trained']['overall']['n']}):", "",
                  *(f"- {n}" for n in notes), ""] if notes else ["It made no mistake on the held-out dialogues.", ""]
    path = os.path.join(model_dir, "README.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def _head(cfg: dict, size_mb: float) -> list[str]:
    """What the model is, how to load it, and what it knows."""
    return [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "license: apache-2.0",
        "---",
        "",
        "# tiny-qwen-chat",
        "",
        "A tiny chat model in the Qwen2 architecture (transformers `Qwen2ForCausalLM`), trained from scratch on CPU "
        "in this repository by `python -m diffuse.train chat`, with its own tokenizer and chat template. It answers "
        "a few kinds of question whose answers a program can check, and nothing else. It is the default model of "
        f"`diffuse chat`: {cfg['num_hidden_layers']} decoder layers to split over nodes, {size_mb:.1f} MB of weights.",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "tok = AutoTokenizer.from_pretrained('diffuse/trained/tiny-qwen-chat')",
        "model = AutoModelForCausalLM.from_pretrained('diffuse/trained/tiny-qwen-chat')",
        "ids = tok.apply_chat_template([{'role': 'user', 'content': 'What is 2 plus 3?'}], add_generation_prompt=True,",
        "                              return_tensors='pt', return_dict=True)",
        "print(tok.decode(model.generate(**ids)[0, ids['input_ids'].shape[1]:], skip_special_tokens=True))",
        "```",
        "",
        "Split over a ring: `diffuse chat` (this model by default), or "
        "`diffuse query --model tiny-qwen-chat --prompt 'What is 2 plus 3?'`.",
        "",
        "## What it knows",
        "",
        *(f"- {TASK_TEXT[t]}" for t in chat_data.TASKS),
        "",
        "Questions come in several phrasings each, in lower case or with capitals; a system turn and earlier turns "
        "may come before the question (one training dialogue in ten has two or three turns).",
        "",
    ]


def _parts(cfg: dict, gen: dict, st: dict) -> list[str]:
    """The model's parts, from its configs."""
    return [
        "## Parts",
        "",
        f"- `Qwen2ForCausalLM`: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
        f"{cfg['num_attention_heads']} attention heads ({cfg['num_key_value_heads']} key/value heads), MLP "
        f"{cfg['intermediate_size']}, RoPE theta {cfg.get('rope_parameters', {}).get('rope_theta', cfg.get('rope_theta'))}, "
        f"tied input and output embeddings, vocabulary {cfg['vocab_size']} (the tokenizer's {st['vocab']} rounded up "
        f"to a multiple of 64); {st['params'] / 1e6:.2f} M parameters, float32",
        "- tokenizer: byte-level BPE (`Qwen2Tokenizer`: Qwen2's NFC normalizer and split regex, so numbers are cut "
        f"into single digits) trained here on the {len(chat_data.corpus_words())} words of the dialogues, lower case "
        "and capitalised: each is one token. Any other text still tokenizes, into smaller pieces down to single "
        "bytes, so there is no unknown token",
        "- chat template (in tokenizer_config.json): Qwen's `<|im_start|>role\\n...<|im_end|>\\n` turns, no default "
        "system turn; `tokenizer.apply_chat_template(messages, add_generation_prompt=True)` ends with "
        "`<|im_start|>assistant\\n`",
        f"- generation config: greedy, stops at `<|im_end|>` (id {gen['eos_token_id']}), pads with `<|endoftext|>`, "
        f"at most {gen['max_new_tokens']} new tokens",
        "",
    ]


def _data_and_training(st: dict) -> list[str]:
    """Where the dialogues came from, and how training went, from train_stats.json."""
    load = st.get("load_average")
    return [
        "## Data",
        "",
        "Made offline and seeded by `diffuse/train/chat_data.py`, a new dialogue for every example. A fixed hash of "
        "each dialogue's key (not the seed) holds dialogues out: training never sees them, evaluation sees nothing "
        f"else. For sums and differences, {chat_data.HELD_OUT_PERCENT}% of the number pairs are never trained in "
        f"any phrasing, and {chat_data.HELD_OUT_PERCENT}% of the other (pair, phrasing, digits or words) "
        f"combinations are held out too; for capitals, {chat_data.PHRASING_HELD_OUT_PERCENT}% of the (fact, "
        "phrasing) pairs, so a held-out question asks a fact the model learned in a phrasing it never saw for that "
        "fact (every fact keeps at least one phrasing in training); for greetings, "
        f"{chat_data.PHRASING_HELD_OUT_PERCENT}% of the combinations of phrasing, lead-in (`hi, `, `ok, `, ...) and "
        "end mark, each phrasing kept in training in some combination; for unreadable text, 10% of the texts.",
        "",
        "## Training",
        "",
        f"- command: `{_command(st)}` (seed {st['seed']}, {st['threads']} torch thread)",
        f"- machine: {st['machine']}, shared with other jobs"
        + (f" (load average {load[0]}-{load[1]} during the run)" if load else ""),
        f"- {st['steps_done']} steps{_stopped(st)} of {st['batch']} dialogues, {st['tokens_seen'] / 1e6:.1f} M tokens; AdamW "
        f"(lr {st['lr']}, betas 0.9/0.98, weight decay {st['weight_decay']}), {st['warmup']} warmup steps, cosine "
        f"decay to {st['min_lr_ratio']} of the peak; cross-entropy on the assistant's turns only (their text and the "
        "`<|im_end|>` that ends them); dialogues of similar length batched together",
        f"- loss {st['loss_first']} (first {st['log_every']} steps) -> {st['loss_last']} (last {st['log_every']})",
        f"- wall time: {st['train_seconds'] / 60:.1f} min of training, {st['total_seconds'] / 60:.1f} min in all",
        "",
    ]


def _command(st: dict) -> str:
    budget = st.get("time_budget_min")
    return "python -m diffuse.train chat" + (f" --time-budget {budget:g}" if budget else "")


def _stopped(st: dict) -> str:
    """Why training stopped where it did, when a time budget ended it before its steps."""
    if st.get("time_budget_min") and st["steps_done"] < st["steps"]:
        return f" (of at most {st['steps']}: the {st['time_budget_min']:g}-minute budget ended it; the learning rate " \
               "follows the clock)"
    return ""


def _unseen_pairs(ev: dict) -> str:
    """How many held-out sums and differences ask a number pair training never saw, in any phrasing."""
    parts = []
    for task in ("add", "subtract"):
        turns = chat_data.held_out_turns(task, ev["trained"][task]["n"])
        unseen = [t for t in turns if chat_data.held_out(t.key[:3])]
        parts.append(f"{len(unseen)} of the {len(turns)} held-out {task} dialogues ask one of "
                     f"{len({t.key[1:3] for t in unseen})} number pairs never trained in any phrasing")
    return "; ".join(parts) + ", the rest a trained pair in a phrasing or number form never trained for it."


def _evaluation(ev: dict) -> list[str]:
    """The held-out dialogues' accuracy per task, and some of the exchanges."""
    names = [n for n in ev]
    tasks = [t for t in chat_data.TASKS if t in ev["trained"]]
    overall = ev["trained"]["overall"]
    lines = [
        "## Evaluation (held-out dialogues)",
        "",
        "`python -m diffuse.train chat evaluate`: each held-out question alone in one user turn, answered greedily "
        "by plain transformers; an answer counts when it is exactly the expected text. The untrained row is the "
        "same architecture and tokenizer with seeded random weights.",
        "",
        f"**Overall: {overall['accuracy']:.1%} of {overall['n']} held-out dialogues answered exactly** "
        "(each dialogue counted once).",
        "",
        "| model | " + " | ".join(tasks) + " | overall |",
        "|---|" + "---|" * (len(tasks) + 1),
    ]
    for n in names:
        lines.append(f"| {n} | " + " | ".join(f"{ev[n][t]['accuracy']:.0%}" for t in tasks)
                     + f" | {ev[n]['overall']['accuracy']:.1%} |")
    return lines + ["", "Held-out dialogues per task: " + ", ".join(f"{t} {ev['trained'][t]['n']}" for t in tasks)
                    + ".", "", _unseen_pairs(ev), "", "Some held-out exchanges (the first right and the first wrong answer of each task):",
                    "", "| task | user | model | |", "|---|---|---|---|", *_examples(ev), ""]


LIMITS = [
    "## Limits",
    "",
    "A toy: it knows the tasks above and nothing else. A question of another kind gets an answer of one of "
    "these kinds, or the fixed reply, whatever was asked; numbers past 20, a difference below zero, sums of "
    "three numbers, countries outside the table and any other question are beyond it. It exists to give `diffuse` a real, small, trained language model to split, "
    "chat with and serve.",
    "",
]
