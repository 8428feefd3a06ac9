"""Writes the model card (README.md) of tiny-qwen-chat from its train_stats.json and eval.json."""

from __future__ import annotations

import json
import os

from . import chat_data

TASK_TEXT = {
    "add": "adding two whole numbers from 0 to 99 (`what is 23 plus 45?` -> `23 + 45 = 68.`)",
    "subtract": "subtracting a smaller number from one up to 99 (`subtract 12 from 96.` -> `96 - 12 = 84.`)",
    "reverse": "reversing the order of 2-6 words from a list of "
               f"{len(chat_data.WORDS)} (`reverse: cat sun egg` -> `egg sun cat`)",
    "sort": "sorting 2-6 of those words alphabetically (`sort: pear fox milk` -> `fox milk pear`)",
    "letters": "counting the letters of a word: a made-up word of 3-9 letters (three times in four) or one of the "
               "listed words (`how many letters are in zorbit?` -> `It has 6 letters.`)",
    "capitals": f"the capitals of {len(chat_data.CAPITALS)} countries, both ways "
                "(`what's the capital of Peru?` -> `The capital of Peru is Lima.`; "
                "`Lima is the capital of which country?` -> `Lima is the capital of Peru.`)",
    "colours": f"the colours of {len(chat_data.COLOURS)} things (`what colour is a plum?` -> `A plum is purple.`)",
    "unknown": "a fixed reply to text it cannot read: made-up words and characters outside its words "
               f"(`zorp ü日 blick?` -> `{chat_data.UNKNOWN_ANSWER}`)",
}


def _examples(ev: dict, per_task: int = 1) -> list[str]:
    lines = []
    for task, r in ev["trained"].items():
        if not isinstance(r, dict):
            continue
        right = [row for row in r["rows"] if row["correct"]][:per_task]
        wrong = [row for row in r["rows"] if not row["correct"]][:1]
        for row in right + wrong:
            mark = "right" if row["correct"] else f"wrong; expected `{row['expected']}`"
            lines.append(f"| {task} | `{row['user']}` | `{row['answer']}` | {mark} |")
    return lines


def _error_notes(ev: dict) -> list[str]:
    """Where the trained model goes wrong, measured on eval.json's rows."""
    import re

    rows = ev["trained"]
    notes = []
    for task in ("reverse", "sort"):
        by_len: dict[int, list[bool]] = {}
        for r in rows[task]["rows"]:
            by_len.setdefault(len(r["expected"].split()), []).append(r["correct"])
        notes.append(f"{task}: " + ", ".join(f"{n} words {sum(v)}/{len(v)}" for n, v in sorted(by_len.items())))
    for task in ("add", "subtract"):
        offs = []
        for r in rows[task]["rows"]:
            got, want = re.findall(r"= (\d+)", r["answer"]), re.findall(r"= (\d+)", r["expected"])
            if not r["correct"] and got and want:
                offs.append(abs(int(got[0]) - int(want[0])))
        wrong = sum(not r["correct"] for r in rows[task]["rows"])
        notes.append(f"{task}: {wrong} wrong, {sum(o == 1 for o in offs)} of them off by 1 and "
                     f"{sum(o == 10 for o in offs)} by 10")
    return notes


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
        lines += ["Trained for the budget of about half an hour on one loaded CPU thread, it has not learned its tasks "
                  "to the end; its mistakes on the held-out dialogues:", "",
                  *(f"- {n}" for n in _error_notes(ev)), ""]
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
        "ids = tok.apply_chat_template([{'role': 'user', 'content': 'What is 23 plus 45?'}], add_generation_prompt=True,",
        "                              return_tensors='pt', return_dict=True)",
        "print(tok.decode(model.generate(**ids)[0, ids['input_ids'].shape[1]:], skip_special_tokens=True))",
        "```",
        "",
        "Split over a ring: `diffuse chat` (this model by default), or "
        "`diffuse query --model tiny-qwen-chat --prompt 'What is 23 plus 45?'`.",
        "",
        "## What it knows",
        "",
        *(f"- {TASK_TEXT[t]}" for t in chat_data.TASKS),
        "- greetings, `what can you do?` and thanks, each with a fixed reply",
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
        f"each dialogue's key holds out {chat_data.HELD_OUT_PERCENT}% of the number pairs (for sums and differences), "
        "of the word lists and of the made-up words, and "
        f"{chat_data.FACT_HELD_OUT_PERCENT}% of the (fact, phrasing) pairs: training never sees them, evaluation "
        "sees nothing else. A held-out fact question asks a fact the model learned, in a phrasing it never saw for "
        "that fact; every fact keeps at least one phrasing in training.",
        "",
        "## Training",
        "",
        f"- command: `python -m diffuse.train chat` (seed {st['seed']}, {st['threads']} torch thread)",
        f"- machine: {st['machine']}, shared with other jobs"
        + (f" (load average {load[0]}-{load[1]} during the run)" if load else ""),
        f"- {st['steps_done']} steps of {st['batch']} dialogues, {st['tokens_seen'] / 1e6:.1f} M tokens; AdamW "
        f"(lr {st['lr']}, betas 0.9/0.98, weight decay {st['weight_decay']}), {st['warmup']} warmup steps, cosine "
        f"decay to {st['min_lr_ratio']} of the peak; cross-entropy on the assistant's turns only (their text and the "
        "`<|im_end|>` that ends them); dialogues of similar length batched together",
        f"- loss {st['loss_first']} (first {st['log_every']} steps) -> {st['loss_last']} (last {st['log_every']})",
        f"- wall time: {st['train_seconds'] / 60:.1f} min of training, {st['total_seconds'] / 60:.1f} min in all",
        "",
    ]


def _evaluation(ev: dict) -> list[str]:
    """The held-out dialogues' accuracy per task, and some of the exchanges."""
    names = [n for n in ev]
    tasks = [t for t in ev["trained"] if isinstance(ev["trained"][t], dict)]
    lines = [
        "## Evaluation (held-out dialogues)",
        "",
        "`python -m diffuse.train chat evaluate`: each held-out question alone in one user turn, answered greedily "
        "by plain transformers; an answer counts when it is exactly the expected text. The untrained row is the "
        "same architecture and tokenizer with seeded random weights.",
        "",
        "| model | " + " | ".join(tasks) + " |",
        "|---|" + "---|" * len(tasks),
    ]
    for n in names:
        lines.append(f"| {n} | " + " | ".join(f"{ev[n][t]['accuracy']:.0%}" for t in tasks) + " |")
    return lines + ["", "Held-out dialogues per task: " + ", ".join(f"{t} {ev['trained'][t]['n']}" for t in tasks)
                    + ".", "", "Some held-out exchanges (the first right and the first wrong answer of each task):",
                    "", "| task | user | model | |", "|---|---|---|---|", *_examples(ev), ""]


LIMITS = [
    "## Limits",
    "",
    "A toy: it knows the tasks above and nothing else. A question of another kind gets an answer of one of "
    "these kinds, or the fixed reply, whatever was asked; numbers past 99, facts outside the table and words "
    "outside the list are beyond it. It exists to give `diffuse` a real, small, trained language model to split, "
    "chat with and serve.",
    "",
]
