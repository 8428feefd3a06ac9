"""Generating text with a transformers model split over a ring: ``diffuse query`` / ``python -m
diffuse.run`` on a folder whose config.json names its architectures.

The model's own ``generate`` runs here, unmodified; its decoder layers are
stand-ins (``diffuse.client.standin``) and each node keeps the key/value cache of the
layers it holds (``diffuse.plan.kvcache``). The tokenizer, the processor and any
vision tower stay here, where the prompt and the media are. The answer is
printed as it streams, token by token.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

from diffuse.cli import command
from diffuse.cli import parsing
from diffuse.client import progress
from diffuse.errors import DiffuseError
from diffuse.client.request import QueryRequest, TextCall

def generation_kwargs(text: TextCall) -> dict:
    """``generate``'s arguments from the request's ``text``; sampling is on when a sampling flag is given (or
    ``--arg do_sample=true``), and what is not given is left to the model's generation config."""
    kwargs: dict = {}
    if text.max_new_tokens is not None:
        kwargs["max_new_tokens"] = text.max_new_tokens
    for key in ("temperature", "top_p", "top_k"):
        if getattr(text, key) is not None:
            kwargs[key] = getattr(text, key)
            kwargs["do_sample"] = True
    kwargs.update(text.args)
    kwargs.setdefault("do_sample", False)
    for key in ("num_beams", "num_beam_groups"):
        if kwargs.get(key) not in (None, 1, False):
            raise DiffuseError(f"--arg {key}: beam search reorders the cache, which lives on the nodes; Diffuse runs "
                               "greedy decoding and sampling, with drafts (--speculate)")
    for key in ("assistant_model", "prompt_lookup_num_tokens"):
        if key in kwargs:
            raise DiffuseError(f"--arg {key}: drafting is --speculate lookup|MODEL (and --draft-tokens K)")
    return kwargs


class Streamer:
    """Prints the answer as it is generated (``generate``'s streamer protocol: ``put`` then ``end``)."""

    def __init__(self, tokenizer, out=None):
        self.tokenizer = tokenizer
        self.out = out or sys.stdout  # looked up now, not when the module loaded (stdout may be redirected)
        self.skip_prompt = True
        self.tokens: list[int] = []
        self.printed = ""
        self.first_token_s: float | None = None
        self.started = time.perf_counter()

    prompt_len = 0

    def put(self, value) -> None:
        if self.skip_prompt:  # the first call hands the prompt (an encoder-decoder's: its decoder prompt)
            self.skip_prompt = False
            self.prompt_len = int(value.shape[-1])
            return
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter() - self.started
        self.tokens.extend(int(t) for t in value.reshape(-1).tolist())
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # wait for the rest of a character split over tokens
            self.out.write(text[len(self.printed):])
            self.out.flush()
            self.printed = text

    def end(self) -> None:
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        self.out.write(text[len(self.printed):] + "\n")
        self.out.flush()
        self.printed = text


def refuse_draws_on_device(gen: dict, whole: bool, device) -> None:
    """A split sampled run whose client computes on an accelerator, refused before anything loads or starts:
    the last node's draw would not be the one ``generate`` makes whole there (``diffuse.lm.sampling``)."""
    if gen.get("do_sample") and not whole and device.type != "cpu":
        from diffuse.lm.sampling import draw_on_device_refusal

        raise DiffuseError(draw_on_device_refusal(device))


def generate_text(q: QueryRequest, console, info, compute) -> dict:
    """One run of a language model (or a model that listens or composes), whole or split, as request ``q``
    asks (``diffuse.client.request``), its model read (``diffuse.cli.modelread``: ``info``, and ``compute``, where the
    client's ends compute); prints the answer as it comes, writes the outputs asked for, returns the report."""
    import torch

    from diffuse.client.api import load_whole_or_shell
    from diffuse.cli.ringopen import open_split
    from diffuse.cli.compose import audio_rate, compose_audio
    from diffuse.cli.modelread import quantize_client
    from diffuse.plan.devices import inputs_on
    from diffuse.lm.client_report import held_parameters, summarize, text_split_report, top_candidates
    from diffuse.lm.client_media import load_config, load_tokenizer

    t0 = time.perf_counter()
    gen = generation_kwargs(q.text)  # the flags were checked against the model in diffuse.cli.command
    refuse_draws_on_device(gen, q.model.whole, compute.device)
    inputs, note = read_inputs(q.text, info)
    if note:
        console.print(note, highlight=False, soft_wrap=True)
    if "input_ids" in inputs:  # a prompt beyond the model's positions: refused before anything loads or starts
        from diffuse.plan.kvcache import check_prompt

        check_prompt(load_config(info.path), inputs["input_ids"])
    tokenizer = load_tokenizer(info.path)
    model = load_whole_or_shell(info, compute, shell=not q.model.whole, quantize=q.ring.options.quantize or "")
    quantize_client(model, info, q.model.quantize_client)
    inputs = inputs_on(inputs, compute.device)
    times = {"load": time.perf_counter() - t0}
    if audio_rate(model) is not None:  # it composes: text in, audio out (diffuse.cli.compose)
        return compose_audio(q, console, info, model, inputs, gen, times, t0)
    # a decoder-only model's sequences start with the prompt; an encoder-decoder's with its decoder prompt
    prompt_len = inputs["input_ids"].shape[1] if "input_ids" in inputs and not model.config.is_encoder_decoder else 0
    streamer = Streamer(tokenizer)
    with contextlib.ExitStack() as held:
        t1 = time.perf_counter()
        split = None if q.model.whole else open_split(q.ring, model, held, console, q.output.quiet)
        times["nodes"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        streamer.started = t2
        if gen.get("do_sample"):
            torch.manual_seed(q.text.seed)  # generate draws from torch's global generator
        with torch.no_grad():
            out = model.generate(**inputs, **gen, streamer=streamer, output_logits=True, return_dict_in_generate=True)
        times["generate"] = time.perf_counter() - t2
    new = out.sequences[:, prompt_len:]
    if model.config.is_encoder_decoder:  # the decoder prompt generate put in front is not part of the answer
        new = out.sequences[:, streamer.prompt_len:]
    report: dict = {
        "model": info.path, "mode": "whole" if q.model.whole else "split", "seconds": time.perf_counter() - t0,
        "times": times, "prompt_tokens": prompt_len, "new_tokens": int(new.shape[1]),
        "first_token_s": streamer.first_token_s, "text": streamer.printed,
        "top": [top_candidates(step[0]) for step in out.logits],
        "client_params": held_parameters(model),
    }
    if split is not None:
        report.update(text_split_report(split, int(new.shape[1])))
    out = q.output
    if out.out:
        with open(out.out, "w") as f:
            f.write(streamer.printed + "\n")
        report["out"] = out.out
    if out.save_tokens:
        with open(out.save_tokens, "w") as f:
            json.dump({**({"input_ids": inputs["input_ids"].tolist()} if "input_ids" in inputs else {}),
                       "new_tokens": new.tolist()}, f)
    summarize(report, console)
    if out.report:
        with open(out.report, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return report


def read_inputs(text: TextCall, info):
    """The model's inputs from the request's ``text``, as the model takes them (audio to transcribe, audio with a
    question, or a prompt with images and videos), and a note to print, if any."""
    from diffuse.lm.client_audio import takes_audio_in_chat
    from diffuse.lm.client_media import build_inputs, load_config, media_kind

    cls = info.subject.denoiser_class()
    if getattr(cls, "main_input_name", "input_ids") == "input_features":  # it listens: audio in, text out
        from diffuse.lm.client_audio import build_audio_inputs

        if not text.audio:
            raise DiffuseError(f"--audio FILE is needed: {cls.__name__} transcribes audio")
        if text.image or text.video or text.media or text.prompt is not None or text.no_template:
            raise DiffuseError(f"{cls.__name__} takes audio only (--audio); no prompt, images or video")
        inputs, note = build_audio_inputs(info.path, text.audio)
    elif text.audio and takes_audio_in_chat(load_config(info.path)):  # it listens through its prompt: audio + question
        from diffuse.lm.client_audio import build_audio_chat_inputs

        if text.no_template:
            raise DiffuseError(f"--no-template: {cls.__name__} takes audio only through its chat template (one user "
                               f"turn: the audio, then the text); leave the flag out")
        if text.image or text.video or text.media:
            raise DiffuseError(f"{cls.__name__} takes audio and text; no images or video")
        if text.prompt is None:
            raise DiffuseError("--prompt is needed: the question about the audio")
        inputs, note = build_audio_chat_inputs(info.path, text.audio, text.prompt), None
    else:
        if text.audio:
            raise DiffuseError(f"--audio: {cls.__name__} does not take audio")
        if text.prompt is None:
            raise DiffuseError("--prompt is needed: the text to answer")
        images, videos = list(text.image), list(text.video)
        for path in text.media:
            (videos if media_kind(path) == "video" else images).append(path)
        inputs, note = build_inputs(info.path, text.prompt, images, videos, text.no_template)
    return inputs, note


def chat_parser() -> argparse.ArgumentParser:
    return parsing.chat_parser()


def chat(a: argparse.Namespace, console, lines=None) -> dict:
    """Turns read from ``lines`` (default: stdin, with a prompt when it is a terminal); the answers stream
    to stdout. One session per node for the whole chat: the cache object is kept across turns."""
    import torch
    from transformers import DynamicCache

    from diffuse.client.api import load_whole_or_shell
    from diffuse.cli.ringopen import open_split
    from diffuse.plan.devices import inputs_on, model_device
    from diffuse.lm.client_media import chat_inputs, load_tokenizer
    from diffuse.cli.modelread import read_model

    q, (info, _, compute) = read_model(parsing.chat_request(a), console, "diffuse chat", language=True)
    progress.status(console, f"{info.subject.denoiser_class_name}: loading it without the layers the nodes will hold")
    model = load_whole_or_shell(info, compute, shell=True)
    tokenizer = load_tokenizer(info.path)
    interactive = lines is None and sys.stdin.isatty()
    lines = lines if lines is not None else sys.stdin
    turns: list[dict] = []
    messages: list[dict] = []
    with contextlib.ExitStack() as held:
        split = open_split(q.ring, model, held, console, False)
        progress.status(console, "ready: type a message (an empty line at end of input, or Ctrl-C, ends the chat)"
                        if interactive else "ready: reading turns from standard input")
        cache = DynamicCache(config=model.config)
        images = list(q.text.image)
        while True:
            if interactive:
                console.print("[bold]you>[/] ", end="")
            line = lines.readline()
            if not line:
                break
            line = line.rstrip("\n")
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            inputs, note = chat_inputs(info.path, messages, images)
            inputs = inputs_on(inputs, model_device(model))
            if note and not turns:
                console.print(note, highlight=False, soft_wrap=True)
            cached = cache.get_seq_length()
            sent_before = _stream_rows(split)
            streamer = Streamer(tokenizer)
            with torch.no_grad():
                out = model.generate(**inputs, past_key_values=cache, max_new_tokens=q.text.max_new_tokens,
                                     do_sample=False, streamer=streamer, return_dict_in_generate=True)
            new = out.sequences[0, inputs["input_ids"].shape[1]:]
            messages.append({"role": "assistant", "content": streamer.printed})
            drafts = split.splitter.drafting.last if split.splitter.drafting is not None else None
            turns.append({"input_tokens": int(inputs["input_ids"].shape[1]), "cached_before": cached,
                          "new_tokens": int(new.shape[0]), "rows_sent": _stream_rows(split) - sent_before,
                          "answer": streamer.printed, "drafted": drafts.drafted if drafts else 0,
                          "accepted": drafts.accepted if drafts else 0})
    report = {"model": info.path, "turns": turns, "node_stats": split.node_reports,
              "passes": split.ring.channel_stats.passes}
    if q.output.report:
        with open(q.output.report, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return report


def _stream_rows(split) -> int:
    """Hidden-state rows sent into the ring so far (the stream slot of every pass)."""
    return split.ring.channel_stats.stream_rows


def chat_main(argv: list[str] | None = None) -> int:
    """``diffuse chat``: 0 at the end of input, 2 for an expected failure (one line), 130 after Ctrl-C."""
    console = progress.console()
    a = parsing.chat_parser().parse_args(argv)

    return parsing.run_guarded(lambda: chat(a, console), console, interrupted="chat ended")
