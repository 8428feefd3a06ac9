"""What the service keeps warm for each model: its client ends, the nodes that hold its blocks, and a
bounded queue of requests.

Every request is its own session on the nodes (``diffuse.split`` opens one per request, ~25 ms on
loopback), run in a worker thread on a copy of the model's client ends taken from a pool: a language
model has ``parallel`` copies (concurrent chats, which the nodes batch), a pipeline one (diffusion
requests take turns). A request beyond the pool waits; beyond ``max_waiting`` waiters it is refused
(``Busy``, which the service answers with 429). A request whose ``Cancel`` is set stops at its next
token or step: its split closes, and with it its sessions on the nodes.
"""

from __future__ import annotations

import os
import queue
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from diffuse.errors import DiffuseError


class Busy(DiffuseError):
    """Every worker of the model is taken and its waiting line is full."""

    def __init__(self, model: str, waiting: int, retry_after: int):
        super().__init__(f"{model} is busy: {waiting} requests already wait for it; retry in {retry_after} s")
        self.retry_after = retry_after


class Cancelled(Exception):
    """The request's client went away: its work stops at the next token or step."""


class BadRequest(DiffuseError):
    """What the request asks cannot be done with this model (answered with 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Cancel:
    """Set by the service when the request's client disconnects; checked between tokens and steps."""

    def __init__(self):
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def __bool__(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        if self._event.is_set():
            raise Cancelled()


# Loading a copy builds models under patches that are global to the process (weightless construction), and
# opening a split plans and installs stand-ins: both take turns, whatever model they are for.
LOADING = threading.RLock()


@dataclass
class Pool:
    """Copies of a model's client ends, made on first need, at most ``size``, lent one per request."""

    make: object  # () -> a fresh copy
    size: int
    max_waiting: int
    name: str
    _free: queue.Queue = field(default_factory=queue.Queue)
    _made: int = 0
    _waiting: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    busy: int = 0

    def take(self, cancel: Cancel, wait_s: float = 3600.0):
        with self._lock:
            if self._free.empty() and self._made < self.size:
                self._made += 1
                make_one = True
            else:
                make_one = False
                if self._free.empty() and self._waiting >= self.max_waiting:
                    raise Busy(self.name, self._waiting, retry_after=max(1, self.busy))
                self._waiting += 1
        if make_one:
            try:
                with LOADING:
                    copy = self.make()
            except BaseException:
                with self._lock:
                    self._made -= 1
                raise
            with self._lock:
                self.busy += 1
            return copy
        try:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    copy = self._free.get(timeout=0.2)
                    break
                except queue.Empty:
                    cancel.check()
                    if time.monotonic() > deadline:
                        raise Busy(self.name, self._waiting, retry_after=5) from None
        finally:
            with self._lock:
                self._waiting -= 1
        with self._lock:
            self.busy += 1
        return copy

    def prewarm(self) -> None:
        """Make the first copy now."""
        with self._lock:
            if self._made:
                return
            self._made = 1
        with LOADING:
            self._free.put(self.make())

    def give(self, copy) -> None:
        with self._lock:
            self.busy -= 1
        self._free.put(copy)

    @property
    def waiting(self) -> int:
        return self._waiting


@dataclass
class NodeSet:
    """The nodes that hold one model's blocks: started here, or given by address."""

    specs: list[str]  # "ADDRESS#KEY" (or bare addresses, keys pinned on first use)
    local: object = None  # a diffuse.local.nodes.LocalNodes when started here

    def stop(self) -> None:
        if self.local is not None:
            self.local.stop()
            self.local = None

    def health(self, timeout_s: float = 2.0) -> list[dict]:
        """Each node's answer to ``status`` (sessions, what it holds), or why it did not answer."""
        from diffuse.client.known_nodes import parse_nodes
        from diffuse.wire.transport import transport_for

        rows = []
        for address, _key in parse_nodes(self.specs):
            row: dict = {"address": address}
            try:
                st = transport_for(address).request(address, {"op": "status"}, timeout_s)
                row.update(alive=bool(st.get("ok")), sessions=st.get("sessions"), slices=st.get("slices"),
                           max_sessions=st.get("max_sessions"), batches=st.get("batches"))
            except Exception as exc:  # a dead or frozen node: said so, never raised
                row.update(alive=False, error=" ".join(str(exc).split())[:200] or type(exc).__name__)
            rows.append(row)
        return rows


class Engine:
    """One model the service answers for."""

    kind = "?"  # "chat" | "image" | "video" | "audio" | "transcription" | "speech"

    def __init__(self, name: str, info, nodes: NodeSet, split_options: dict, created: int):
        self.name, self.info, self.nodes = name, info, nodes
        self.split_options = split_options
        self.created = created
        self.pool: Pool | None = None

    @contextmanager
    def split(self, target, **extra):
        """One request's sessions on the nodes, open for the ``with`` block."""
        from diffuse.client.api import Split

        split = Split(target, nodes=list(self.nodes.specs), **self.split_options, **extra)
        with LOADING:
            split.__enter__()
        try:
            yield split
        except BaseException as exc:
            split.__exit__(type(exc), exc, exc.__traceback__)
            raise
        split.__exit__(None, None, None)

    def describe(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "diffuse",
                "kind": self.kind, "path": self.info.path}

    def load_status(self) -> dict:
        p = self.pool
        return {"busy": p.busy if p else 0, "waiting": p.waiting if p else 0, "workers": p.size if p else 0}


# ---------------------------------------------------------------------------------------------------------------
# language models


@dataclass
class TextResult:
    text: str
    tokens: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" | "length"


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
        self.tokens.extend(int(t) for t in value.reshape(-1).tolist())
        text = self.text()
        for s in self.stop:
            at = text.find(s)
            if at >= 0:
                self.stopped = True
                self._send(text[:at])
                raise _StopString()
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
                      on_delta=None) -> TextResult:
        import torch

        from diffuse.plan.devices import inputs_on, model_device

        model = self.pool.take(cancel)
        try:
            stream = TextStream(self.tokenizer, cancel, stop, on_delta)
            prompt_len = int(inputs["input_ids"].shape[1]) if "input_ids" in inputs else 0
            with self.split(model), seeded(gen, seed), torch.no_grad():
                try:
                    out = model.generate(**inputs_on(inputs, model_device(model)), **gen, streamer=stream,
                                         return_dict_in_generate=True)
                except _StopString:
                    out = None
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
        return TextResult(stream.final_text(), new, prompt_len, reason)

    def transcribe(self, audio_path: str, cancel: Cancel, max_tokens: int | None = None) -> TextResult:
        """The text ``diffuse query --audio FILE [--max-new-tokens N]`` prints for the same clip (greedy; without
        ``max_tokens`` the model's own generation config sets the length)."""
        from diffuse.lm.client_audio import build_audio_inputs

        if not self.listens:
            raise BadRequest(f"{self.name} does not transcribe audio", "model")
        inputs, _note = build_audio_inputs(self.info.path, audio_path)
        gen = {"do_sample": False, **({"max_new_tokens": max_tokens} if max_tokens else {})}
        return self.generate_text(inputs, gen, None, [], cancel)

    def speak(self, text: str, gen: dict, seed: int | None, cancel: Cancel) -> bytes:
        """A model that answers with sound (MusicGen): ``text`` describes it; the .wav bytes that ``diffuse
        query --out x.wav`` writes for the same request."""
        import torch

        from diffuse.plan.devices import inputs_on, model_device
        from diffuse.lm.client_media import build_inputs

        if not self.sample_rate:
            raise BadRequest(f"{self.name} does not make sound", "model")
        inputs, _note = build_inputs(self.info.path, text, [], [], False)
        model = self.pool.take(cancel)
        try:
            steps = _Steps(cancel)
            with self.split(model), seeded(gen, seed), torch.no_grad():
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


# ---------------------------------------------------------------------------------------------------------------
# diffusion pipelines


@dataclass
class Picture:
    data: bytes  # the file: .png, .mp4 or .wav
    suffix: str
    array: object  # the float32 array the pipeline returned
    seconds: float
    steps: int


@dataclass(frozen=True)
class Ask:
    """What one picture (image, video or sound) request asks of a ``PipelineEngine``: the flags of ``diffuse
    query`` of the same names (None: the model's default)."""

    prompt: str
    negative_prompt: str | None = None
    width: int | None = None
    height: int | None = None
    steps: int | None = None
    frames: int | None = None
    seed: int = 0
    patches: int = 1


class PipelineEngine(Engine):
    """A diffusers pipeline: images, videos or sound, one request at a time per copy (default one copy)."""

    def __init__(self, name, info, nodes, split_options, created, parallel: int, max_waiting: int):
        super().__init__(name, info, nodes, split_options, created)
        self.kind = info.output_kind
        self.pool = Pool(self._make, parallel, max_waiting, name)

    def _make(self):
        import diffuse

        return diffuse.from_pretrained(self.info.path)

    def describe(self) -> dict:
        d = super().describe()
        d["defaults"] = self.info.call_defaults()
        return d

    def run(self, ask: "Ask", cancel: Cancel, on_step=None) -> Picture:
        """The pipeline's call, as ``diffuse query`` makes it for the same flags; ``on_step(i, n)`` after
        each denoising step."""
        import torch

        from diffuse.client.request import PipelineCall
        from diffuse.client.dryrun import call_kwargs
        from diffuse.client.output import output_array

        if not isinstance(ask.prompt, str) or not ask.prompt.strip():
            raise BadRequest("prompt must be a non-empty string", "prompt")
        if ask.patches < 1:
            raise BadRequest("patches must be at least 1", "patches")
        patches = ask.patches
        call = PipelineCall(prompt=ask.prompt, negative_prompt=ask.negative_prompt, steps=ask.steps,
                            height=ask.height, width=ask.width, frames=ask.frames, seed=ask.seed)
        t0 = time.perf_counter()
        pipe = self.pool.take(cancel)
        try:
            try:
                kwargs = call_kwargs(call, pipe, self.info)
            except DiffuseError as exc:
                raise BadRequest(str(exc)) from None
            counter = {"steps": 0}
            sched = pipe.scheduler
            original = sched.step

            import functools

            @functools.wraps(original)
            def step(*args, **kw):
                cancel.check()
                out = original(*args, **kw)
                counter["steps"] += 1
                if on_step is not None:
                    total = len(sched.timesteps) if getattr(sched, "timesteps", None) is not None else None
                    on_step(counter["steps"], total)
                return out

            sched.step = step
            try:
                cancel.check()
                with self.split(pipe, patches=patches):
                    with torch.no_grad():
                        try:
                            result = pipe(**kwargs)
                        except ValueError as exc:  # the pipeline's own refusal of what was asked
                            raise BadRequest(f"{type(pipe).__name__} refuses this request: "
                                             f"{' '.join(str(exc).split())}") from None
            finally:
                del sched.step
        finally:
            self.pool.give(pipe)
        arr = output_array(result)
        rate = kwargs.get("frame_rate") or kwargs.get("fps") or self.info.draft.get("frame_rate")
        suffix = {"image": ".png", "video": ".mp4", "audio": ".wav"}[self.kind]
        sample_rate = self.info.draft.get("sample_rate")
        if self.kind == "audio" and not sample_rate:
            sample_rate = getattr(getattr(pipe, "vae", None), "config", {}).get("sampling_rate")
        data = write_bytes(arr, suffix, kind=self.kind, frame_rate=rate, sample_rate=sample_rate)
        return Picture(data, suffix, arr, time.perf_counter() - t0, counter["steps"])


def write_bytes(arr, suffix: str, kind: str, frame_rate=None, sample_rate=None) -> bytes:
    """The file the output writers make of ``arr`` (the same bytes ``diffuse query --out`` writes)."""
    from diffuse.plan.plugins import call_hook
    from diffuse.client.writers import OutputInfo

    with tempfile.TemporaryDirectory(prefix="diffuse-serve-") as tmp:
        path = os.path.join(tmp, "out" + suffix)
        info = OutputInfo(kind=kind, frame_rate=frame_rate, sample_rate=sample_rate)
        written = call_hook("diffuse_write_output", result=arr, path=path, info=info)
        if written is None:
            raise DiffuseError(f"no output writer takes {kind} to {suffix}")
        with open(written, "rb") as f:
            return f.read()


def preview_png(arr, variant: str) -> bytes:
    """A video's first frame ("thumbnail") or all its frames side by side ("spritesheet"), as PNG."""
    import io

    import numpy as np
    from PIL import Image

    from diffuse.client.writers import to_uint8

    frames = arr[0] if arr.ndim == 5 else arr
    frames = to_uint8(np.asarray(frames))
    img = frames[0] if variant == "thumbnail" else np.concatenate(list(frames), axis=1)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()
