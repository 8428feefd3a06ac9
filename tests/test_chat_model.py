"""The shipped chat model, tiny-qwen-chat: split it answers token for token as plain transformers run whole;
its card's held-out results are what ``python -m diffuse.train chat evaluate`` gives; the training command runs.

The reference is tests/lm_reference.py in a fresh process (transformers alone); the split runs go through
``diffuse query --model tiny-qwen-chat`` and ``diffuse chat`` (no --model: the embedded chat model) with real
node processes on loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, TESTS, THREADS, run_cli, subprocess_env

from diffuse.plan.shipped import CHAT_MODEL_NAME, default_chat_model_dir, default_model_dir, shipped_models
from diffuse.train import chat_data

CHAT = default_chat_model_dir()


def _eval_json() -> dict:
    with open(os.path.join(CHAT, "eval.json")) as f:
        return json.load(f)


def _a_right_sum() -> dict:
    """A held-out sum the card says the model gets right (eval.json's first)."""
    return next(r for r in _eval_json()["trained"]["add"]["rows"] if r["correct"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("chat-reference") / "ref.json"
    cmd = [sys.executable, os.path.join(TESTS, "lm_reference.py"), "--model", CHAT, "--prompt", _a_right_sum()["user"],
           "--max-new-tokens", "24", "--threads", str(THREADS), "--out", str(out)]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as f:
        return json.load(f)


def test_the_chat_model_ships_beside_the_default_pipeline_and_resolves_by_name():
    from diffuse.plan.resolve import resolve_model

    shipped = shipped_models()
    assert list(shipped)[0] == "tiny-wan-shapes" and shipped["tiny-wan-shapes"] == default_model_dir()
    assert resolve_model(CHAT_MODEL_NAME) == CHAT == shipped[CHAT_MODEL_NAME]
    assert not os.path.isfile(os.path.join(CHAT, "model_index.json"))  # a transformers folder, not a pipeline
    with open(os.path.join(CHAT, "generation_config.json")) as f:
        gen = json.load(f)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(CHAT)
    assert gen["do_sample"] is False and gen["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # text outside its words still tokenizes, to pieces down to single bytes, and decodes back
    odd = "Zqxj ü 日本 😀"
    assert tok.decode(tok(odd)["input_ids"]) == odd


def test_split_answers_token_for_token_as_transformers_whole(reference, tmp_path, diffuse_home):
    tokens, report = tmp_path / "tokens.json", tmp_path / "report.json"
    run = run_cli(["query", "--model", CHAT_MODEL_NAME, "--prompt", _a_right_sum()["user"], "--max-new-tokens", "24",
                   "--threads", str(THREADS), "--local-nodes", "2", "--save-tokens", str(tokens), "--report",
                   str(report), "--quiet", "--timeout", "120"], diffuse_home)
    assert run.returncode == 0, run.stderr[-3000:]
    saved, rep = json.loads(tokens.read_text()), json.loads(report.read_text())
    assert saved["input_ids"] == reference["input_ids"]
    assert saved["new_tokens"] == reference["new_tokens"]
    assert rep["top"] == reference["top"]  # the exact float32 bits of each step's best 8 logits
    assert rep["client_layer_params"] == 0 and rep["mode"] == "split"
    # it stopped at <|im_end|>, well before the limit, with the right held-out answer
    assert len(saved["new_tokens"][0]) < 24 and run.stdout.strip() == _a_right_sum()["expected"]


def test_diffuse_chat_talks_to_the_embedded_model_by_default(reference, tmp_path, diffuse_home):
    """``diffuse chat`` with no --model, its own code in this process, two turns read as from stdin."""
    import io

    from rich.console import Console

    from diffuse.cli.language import chat, chat_parser

    report = tmp_path / "chat.json"
    args = chat_parser().parse_args(["--threads", str(THREADS), "--local-nodes", "2", "--report", str(report)])
    turns = io.StringIO(_a_right_sum()["user"] + "\nthank you\n")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        chat(args, Console(file=io.StringIO()), lines=turns)
    rep = json.loads(report.read_text())
    assert rep["model"] == CHAT
    first, second = rep["turns"]
    assert first["answer"] == _a_right_sum()["expected"] and first["new_tokens"] == len(reference["new_tokens"][0])
    # the second turn comes after the first in the history, and is answered as the data says
    thanks = next(answer for answer, asked in chat_data.GREETINGS.items() if "thank you" in asked)
    assert second["answer"] == thanks and second["cached_before"] > first["input_tokens"]
    assert printed.getvalue().split("\n")[:2] == [first["answer"], second["answer"]]


def test_evaluate_gives_what_the_card_claims(tmp_path):
    """The first held-out dialogues of every task, answered again by the evaluation command: the same answers
    as eval.json, whose rates are the card's."""
    per_task = 3
    out = tmp_path / "eval.json"
    cmd = [sys.executable, "-m", "diffuse.train", "chat", "evaluate", "--per-task", str(per_task), "--no-baseline",
           "--json", str(out)]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    again, claimed = json.loads(out.read_text())["trained"], _eval_json()
    for task in chat_data.TASKS:
        assert again[task]["rows"] == claimed["trained"][task]["rows"][:per_task], task
    with open(os.path.join(CHAT, "README.md")) as f:
        card = f.read()
    for name in ("trained", "untrained"):
        row = (f"| {name} | " + " | ".join(f"{claimed[name][t]['accuracy']:.0%}" for t in chat_data.TASKS)
               + f" | {claimed[name]['overall']['accuracy']:.1%} |")
        assert row in card, row
    overall = claimed["trained"]["overall"]
    assert overall["n"] == sum(claimed["trained"][t]["n"] for t in chat_data.TASKS)
    assert f"**Overall: {overall['accuracy']:.1%} of {overall['n']} held-out dialogues answered exactly**" in card


def test_the_held_out_score_reaches_the_goal():
    """Issue 38's goal for a newcomer's first questions: at least 95% of the held-out dialogues answered exactly,
    and no task far below it (subtraction of a number pair never trained is the weakest, 88%)."""
    claimed = _eval_json()["trained"]
    assert claimed["overall"]["accuracy"] >= 0.95, claimed["overall"]
    per_task = {t: claimed[t]["accuracy"] for t in chat_data.TASKS}
    assert min(per_task.values()) >= 0.85, per_task


def test_a_newcomers_first_questions_are_answered_right():
    """What a newcomer types first, answered by plain transformers as the card says (before issue 38 the first
    of these got "2 + 3 = 1.")."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from diffuse.train.chat import answer

    tok, model = AutoTokenizer.from_pretrained(CHAT), AutoModelForCausalLM.from_pretrained(CHAT).eval()
    replies = {asked: reply for reply, phrasings in chat_data.GREETINGS.items() for asked in phrasings}
    first = {
        "what is 2 plus 3?": "2 + 3 = 5.",
        "What's seven minus four?": "7 - 4 = 3.",
        "what is the capital of France?": "The capital of France is Paris.",
        "Hello": replies["hello"],
        "who are you?": replies["who are you?"],
        "What can you do?": replies["what can you do?"],
        "thanks!": replies["thanks"],
    }
    got = {asked: answer(model, tok, [{"role": "user", "content": asked}]) for asked in first}
    assert got == first


def test_the_training_command_trains_a_model_transformers_loads(tmp_path):
    out = tmp_path / "m"
    proc = subprocess.run([sys.executable, "-m", "diffuse.train", "chat", "--quick", "--out", str(out)],
                          env=subprocess_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    stats = json.loads((out / "train_stats.json").read_text())
    assert stats["loss_last"] < 0.8 * stats["loss_first"], stats["loss_curve"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from diffuse.train.chat import answer

    tok, model = AutoTokenizer.from_pretrained(out), AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 2 and len(tok) == stats["vocab"]
    assert isinstance(answer(model, tok, [{"role": "user", "content": "what is 2 plus 2?"}], 4), str)
