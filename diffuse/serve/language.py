"""The language-model engine of ``diffuse serve``: a transformers model's chat, completions, transcription and
speech, each request a ``generate`` on a copy of the client ends taken from the pool, its text streamed token by
token and stopped at a stop string or a cancelled request.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from diffuse.serve.engines import BadRequest, Cancel, Engine, Pool, write_bytes


@dataclass
class TextResult:
    text: str
    tokens: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" | "length"
    figures: dict | None = None  # how it was made: trips around the ring, drafts, seconds (``figures_of``)


class TextStream:
    """``generate``'s streamer: collects the new tokens, hands text deltas to ``on_delta``, stops at a stop
    string (holding back text that may yet become one) and at a cancelled request."""

    def __init__(self, tokenizer, cancel: Cancel, stop: list[str], on_delta=None):
        self.tokenizer, self.cancel, self.stop, self.on_delta = tokenizer, cancel, stop, on_delta
        self.skip_prompt = True
        self.tokens: list[int] = []
        self.sent = ""
        self.stopped = False
        self.first_token_at: float | None = None

    def text(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def put(self, value) -> None:
        if self.skip_prompt:
            self.skip_prompt = False
            return
        self.cancel.check()
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        for token in value.reshape(-1).tolist():  # several at once where drafts were accepted
            self.tokens.append(int(token))
            if self.stop:  # the answer ends at the token that completes a stop string, however many came
                text = self.text()
                at = min((a for a in (text.find(s) for s in self.stop) if a >= 0), default=-1)
                if at >= 0:
                    self.stopped = True
                    self._send(text[:at])
                    raise _StopString()
        text = self.text()
        if text.endswith("\ufffd"):  # the rest of a character split over tokens is still to come
            return
        hold = max((len(s) - 1 for s in self.stop), default=0)
        self._send(text[:len(text) - hold] if hold else text)

    def end(self) -> None:
        if not self.stopped:
            self._send(self.text())

    def _send(self, upto: str) -> None:
        if len(upto) > len(self.sent) and upto.startswith(self.sent):
            delta = upto[len(self.sent):]
            self.sent = upto
            if self.on_delta is not None:
                self.on_delta(delta)

    def final_text(self) -> str:
        if self.stopped:
            return self.sent
        return self.text()


class _StopString(Exception):
    pass


def generation_kwargs(max_tokens: int | None, temperature: float | None, top_p: float | None,
                      default_max: int) -> dict:
    """``generate``'s sampling arguments by the rules of ``diffuse query``: greedy unless a temperature above 0
    (or a top_p below 1 without a temperature) asks for sampling."""
    if temperature is not None and not 0 <= temperature <= 2:
        raise BadRequest(f"temperature {temperature}: must be between 0 and 2", "temperature")
    if top_p is not None and not 0 < top_p <= 1:
        raise BadRequest(f"top_p {top_p}: must be in (0, 1]", "top_p")
    if max_tokens is not None and max_tokens < 1:
        raise BadRequest(f"max_tokens {max_tokens}: must be at least 1", "max_tokens")
    gen: dict = {"max_new_tokens": max_tokens or default_max}
    sample = (temperature is not None and temperature > 0) or (temperature is None and top_p not in (None, 1, 1.0))
    if sample:
        gen["do_sample"] = True
        if temperature is not None:
            gen["temperature"] = temperature
        if top_p is not None:
            gen["top_p"] = top_p
    else:
        gen["do_sample"] = False
    return gen


_RNG = threading.Lock()  # generate draws from torch's global generator: seeded sampling takes turns


@contextmanager
def seeded(gen: dict, seed: int | None):
    """Where ``gen`` samples: torch's global generator seeded with ``seed`` (0 if None) and held by this request
    alone for the ``with`` block, as ``diffuse query --seed`` seeds it; greedy decoding takes nothing."""
    if not gen.get("do_sample"):
        yield
        return
    import torch

    with _RNG:
        torch.manual_seed(0 if seed is None else seed)
        yield


class LanguageEngine(Engine):
    """A transformers model: chat and completions (text, images, audio parts), transcription for a model that
    listens, speech for a model whose ``generate`` returns sound."""

    def __init__(self, name, info, nodes, split_options, created, parallel: int, max_waiting: int,
                 default_max_tokens: int = 256):
        super().__init__(name, info, nodes, split_options, created)
        from diffuse.lm.client_media import load_config, load_tokenizer

        cls = info.subject.denoiser_class()
        self.listens = getattr(cls, "main_input_name", "input_ids") == "input_features"
        config = load_config(info.path)
        codec = getattr(config, "audio_encoder", None)
        self.sample_rate = int(getattr(codec, "sampling_rate", 0) or 0) or None
        from diffuse.lm.client_audio import takes_audio_in_chat

        self.hears_in_chat = takes_audio_in_chat(config)
        self.kind = "transcription" if self.listens else "speech" if self.sample_rate else "chat"
        self.tokenizer = load_tokenizer(info.path)
        from transformers import GenerationConfig

        try:  # what the model's own generation config allows, else the service's default
            own = GenerationConfig.from_pretrained(info.path).max_new_tokens
        except (OSError, ValueError):
            own = None
        self.default_max_tokens = own or default_max_tokens
        self.pool = Pool(self._make, parallel if self.kind == "chat" else 1, max_waiting, name)

    def _make(self):
        import diffuse

        return diffuse.from_pretrained(self.info.path)

    def describe(self) -> dict:
        d = super().describe()
        d["capabilities"] = {"vision": self._takes_images(), "audio_in": self.hears_in_chat or self.listens,
                             "audio_out": bool(self.sample_rate)}
        return d

    def _takes_images(self) -> bool:
        from diffuse.lm.client_media import _takes_images, load_config

        return bool(_takes_images(load_config(self.info.path)))

    # inputs ------------------------------------------------------------------------------------------------

    def chat_inputs(self, messages: list[dict], images: list, audio: str | None) -> dict:
        from diffuse.lm.client_media import chat_inputs

        if self.kind != "chat":
            raise BadRequest(f"{self.name} is a {self.kind} model: use "
                             f"{'/v1/audio/transcriptions' if self.listens else '/v1/audio/speech'}", "model")
        if audio is not None:
            if not self.hears_in_chat:
                raise BadRequest(f"{self.name} does not take audio", "messages")
            if images or len([m for m in messages if m["role"] != "system"]) != 1:
                raise BadRequest(f"{self.name} takes audio in one user turn (the audio, then the text), no images",
                                 "messages")
            from diffuse.lm.client_audio import build_audio_chat_inputs

            text = messages[-1]["content"]
            text = " ".join(p.get("text", "") for p in text) if isinstance(text, list) else text
            return build_audio_chat_inputs(self.info.path, audio, text)
        if images and not self._takes_images():
            raise BadRequest(f"{self.name} does not take images", "messages")
        inputs, _note = chat_inputs(self.info.path, messages, images)
        return inputs

    def prompt_inputs(self, prompt: str, template: bool = False) -> dict:
        from diffuse.lm.client_media import build_inputs

        if self.kind != "chat":
            raise BadRequest(f"{self.name} is a {self.kind} model", "model")
        inputs, _note = build_inputs(self.info.path, prompt, [], [], no_template=not template)
        return inputs

    # running -----------------------------------------------------------------------------------------------

    def generate_text(self, inputs: dict, gen: dict, seed: int | None, stop: list[str], cancel: Cancel,
                      on_delta=None, kind: str = "chat") -> TextResult:
        """One answer; counted in the engine's tally as a request of ``kind`` (chat, completion,
        transcription)."""
        with self.tally.request(kind) as t0:
            r, seconds, first = self._generate(inputs, gen, seed, stop, cancel, on_delta)
            self.tally.generated(r.prompt_tokens, len(r.tokens), seconds, first - t0 if first else None)
            return r

    def _generate(self, inputs: dict, gen: dict, seed: int | None, stop: list[str], cancel: Cancel, on_delta):
        """The answer, the seconds from its session's open to its end, and when its first token came."""
        import torch

        from diffuse.plan.devices import inputs_on, model_device

        model = self.pool.take(cancel)
        try:
            stream = TextStream(self.tokenizer, cancel, stop, on_delta)
            prompt_len = int(inputs["input_ids"].shape[1]) if "input_ids" in inputs else 0
            t0 = time.perf_counter()
            with self.split(model, request_id=cancel.request_id) as split, seeded(gen, seed), torch.no_grad():
                try:
                    out = model.generate(**inputs_on(inputs, model_device(model)), **gen, streamer=stream,
                                         return_dict_in_generate=True)
                except _StopString:
                    out = None
                trips, drafts = split.ring.channel_stats.passes, split.splitter.lm.generation.drafts
            seconds = time.perf_counter() - t0
        finally:
            self.pool.give(model)
        if out is not None and not model.config.is_encoder_decoder:
            new = out.sequences[0, prompt_len:].tolist()
        else:  # stopped at a stop string, or an encoder-decoder (its decoder prompt is not part of the answer)
            new = list(stream.tokens)
        eos = model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        if stream.stopped or (new and new[-1] in eos):
            reason = "stop"
        else:
            limit = gen.get("max_new_tokens") or model.generation_config.max_new_tokens
            reason = "length" if limit and len(new) >= limit else "stop"
        figures = figures_of(len(new), trips, drafts, seconds, stream.first_token_at - t0 if stream.first_token_at
                             else None)
        return TextResult(stream.final_text(), new, prompt_len, reason, figures), seconds, stream.first_token_at

    def transcribe(self, audio_path: str, cancel: Cancel, max_tokens: int | None = None) -> TextResult:
        """The text ``diffuse query --audio FILE [--max-new-tokens N]`` prints for the same clip (greedy; without
        ``max_tokens`` the model's own generation config sets the length)."""
        from diffuse.lm.client_audio import build_audio_inputs

        if not self.listens:
            raise BadRequest(f"{self.name} does not transcribe audio", "model")
        inputs, _note = build_audio_inputs(self.info.path, audio_path)
        gen = {"do_sample": False, **({"max_new_tokens": max_tokens} if max_tokens else {})}
        return self.generate_text(inputs, gen, None, [], cancel, kind="transcription")

    def speak(self, text: str, gen: dict, seed: int | None, cancel: Cancel) -> bytes:
        """A model that answers with sound (MusicGen): ``text`` describes it; the .wav bytes that ``diffuse
        query --out x.wav`` writes for the same request."""
        import torch

        from diffuse.lm.client_media import build_inputs
        from diffuse.plan.devices import inputs_on, model_device

        if not self.sample_rate:
            raise BadRequest(f"{self.name} does not make sound", "model")
        inputs, _note = build_inputs(self.info.path, text, [], [], False)
        with self.tally.request("speech"):
            model = self.pool.take(cancel)
            try:
                steps = _Steps(cancel)
                with self.split(model, request_id=cancel.request_id), seeded(gen, seed), torch.no_grad():
                    audio = model.generate(**inputs_on(inputs, model_device(model)), **gen, streamer=steps)
            finally:
                self.pool.give(model)
        arr = audio.detach().to(torch.float32).cpu().numpy()
        return write_bytes(arr, ".wav", kind="audio", sample_rate=self.sample_rate)


class _Steps:
    """A streamer that only checks for cancellation (MusicGen's codes are not text)."""

    def __init__(self, cancel: Cancel):
        self.cancel = cancel

    def put(self, value) -> None:
        self.cancel.check()

    def end(self) -> None:
        pass


def figures_of(tokens: int, trips: int, drafts, seconds: float, first_s: float | None) -> dict:
    """What an answer's request may ask to see of how it was made (``"figures": true``): its trips around the
    ring, the drafts verified on them (``diffuse.lm.client_drafts``), tokens per second after the first."""
    after = seconds - first_s if first_s is not None else None
    out = {"tokens": tokens, "trips": trips, "tokens_per_trip": round(tokens / trips, 3) if trips else None,
           "seconds": round(seconds, 4), "first_token_s": round(first_s, 4) if first_s is not None else None,
           "tokens_per_s": round((tokens - 1) / after, 2) if after and tokens > 1 else None,
           "drafted": drafts.drafted if drafts is not None else 0, "accepted": drafts.accepted if drafts else 0}
    return out
