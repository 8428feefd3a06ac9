"""The text endpoints of ``diffuse serve``: chat completions (text, image and audio parts, the images and audio
sent as data URLs) and text completions, whole or streamed token by token (an event carries several where drafts
were accepted), over a ``LanguageEngine``; a request with ``"figures": true`` also gets how its answer was made
(trips around the ring, drafts, tokens per second: ``diffuse.serve.language.figures_of``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
import tempfile
import time
import uuid
from dataclasses import dataclass, replace

from fastapi import Request
from fastapi.responses import StreamingResponse

from diffuse.serve.engines import BadRequest, Cancel, Cancelled
from diffuse.serve.language import LanguageEngine, generation_kwargs
from diffuse.serve.plumbing import (_as_api_error, _float, _int, _quiet, _sse, cancel_for, find_engine, json_body, log,
                                    run_in_thread)


def decode_data_url(url: str, what: str) -> bytes:
    if not isinstance(url, str) or not url.startswith("data:") or "," not in url:
        raise BadRequest(f"{what} must be a data URL (data:...;base64,...): this service fetches nothing", "messages")
    head, _, payload = url.partition(",")
    try:
        return base64.b64decode(payload, validate=True) if head.endswith(";base64") else payload.encode()
    except (binascii.Error, ValueError):
        raise BadRequest(f"{what}: the data URL's base64 does not decode", "messages") from None


class Messages:
    """OpenAI chat messages as ``diffuse.lm.client_media.chat_inputs`` takes them: images decoded from data URLs
    into the parts they came in, audio written to a file for the model's processor."""

    def __init__(self, raw, tmp: str):
        if not isinstance(raw, list) or not raw:
            raise BadRequest("messages must be a non-empty list", "messages")
        self.images: list = []
        self.audio: str | None = None
        self.messages: list[dict] = []
        for m in raw:
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
                raise BadRequest("each message needs a role of system, user or assistant", "messages")
            role = "system" if m["role"] == "developer" else m["role"]
            content = m.get("content")
            if isinstance(content, str):
                self.messages.append({"role": role, "content": content})
                continue
            if not isinstance(content, list):
                raise BadRequest("a message's content is a string or a list of parts", "messages")
            parts = []
            for p in content:
                kind = p.get("type") if isinstance(p, dict) else None
                if kind == "text" and isinstance(p.get("text"), str):
                    parts.append({"type": "text", "text": p["text"]})
                elif kind == "image_url":
                    url = p.get("image_url", {}).get("url") if isinstance(p.get("image_url"), dict) else p.get("image_url")
                    self.images.append(_image(decode_data_url(url, "image_url")))
                    parts.append({"type": "image"})
                elif kind == "input_audio" and isinstance(p.get("input_audio"), dict):
                    a = p["input_audio"]
                    try:
                        data = base64.b64decode(a.get("data", ""), validate=True)
                    except (binascii.Error, ValueError):
                        raise BadRequest("input_audio.data is not base64", "messages") from None
                    fmt = str(a.get("format") or "wav").lower()
                    if fmt not in ("wav", "mp3", "flac", "ogg"):
                        raise BadRequest(f"input_audio.format {fmt!r}: wav, mp3, flac or ogg", "messages")
                    if self.audio is not None:
                        raise BadRequest("one audio part per request", "messages")
                    self.audio = os.path.join(tmp, "audio." + fmt)
                    with open(self.audio, "wb") as f:
                        f.write(data)
                else:
                    raise BadRequest(f"unsupported content part {kind!r} (text, image_url, input_audio)", "messages")
            if not self.images and all(p["type"] == "text" for p in parts):
                self.messages.append({"role": role, "content": "".join(p["text"] for p in parts)})
            else:
                self.messages.append({"role": role, "content": parts})
        if self.audio is not None:  # the model's processor takes the audio and the text of the one user turn
            self.messages = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
                              "".join(p.get("text", "") for p in m["content"])} for m in self.messages]


def _image(data: bytes):
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (UnidentifiedImageError, OSError):
        raise BadRequest("image_url: not an image this service can read (PNG, JPEG, WebP, GIF)", "messages") from None
    return img.convert("RGB")


def _text_routes(app, service) -> None:
    """Chat and text completions."""

    def _text_request(body: dict, kinds=("chat",), what="chat"):
        e = find_engine(service, body.get("model"), kinds, what)
        max_tokens = _int(body, "max_completion_tokens") or _int(body, "max_tokens")
        if _int(body, "n", 1) != 1:
            raise BadRequest("n: one answer per request", "n")
        gen = generation_kwargs(max_tokens, _float(body, "temperature"), _float(body, "top_p"),
                                e.default_max_tokens)
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
            raise BadRequest("stop: up to 4 non-empty strings", "stop")
        return TextAsk(e, gen, _int(body, "seed"), stop)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await json_body(request)
        ask = _text_request(body)
        e = ask.engine
        with tempfile.TemporaryDirectory(prefix="diffuse-serve-") as tmp:
            msgs = Messages(body.get("messages"), tmp)
            loop = asyncio.get_running_loop()
            inputs = await loop.run_in_executor(None, e.chat_inputs, msgs.messages, msgs.images, msgs.audio)
        return await answer_text(request, body, replace(ask, inputs=inputs), "chat.completion")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await json_body(request)
        ask = _text_request(body, what="completions")
        e = ask.engine
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise BadRequest("prompt: one non-empty string", "prompt")
        loop = asyncio.get_running_loop()
        inputs = await loop.run_in_executor(None, e.prompt_inputs, prompt)
        return await answer_text(request, body, replace(ask, inputs=inputs, kind="completion"), "text_completion")


@dataclass(frozen=True)
class TextAsk:
    """What one chat or completion request asks: its engine, the generation's arguments, seed and stop strings,
    and the model's inputs once made."""

    engine: LanguageEngine
    gen: dict
    seed: int | None
    stop: list
    inputs: dict | None = None
    kind: str = "chat"  # or "completion": how its request is counted (diffuse.serve.metrics)

    def generate(self, cancel: Cancel, on_delta=None):
        return self.engine.generate_text(self.inputs, self.gen, self.seed, self.stop, cancel, on_delta, self.kind)


async def answer_text(request, body, ask: TextAsk, obj: str):
    """A chat ("chat.completion") or text completion ("text_completion"), whole or streamed."""
    e = ask.engine
    rid = f"{'chatcmpl' if obj == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunks = "chat.completion.chunk" if obj == "chat.completion" else obj
        return stream_text(request, ask, rid, chunks, include_usage, body.get("figures") is True)
    cancel = cancel_for(request)
    r = await run_in_thread(request, lambda: ask.generate(cancel), cancel)
    choice = {"index": 0, "finish_reason": r.finish_reason, "logprobs": None}
    if obj == "chat.completion":
        choice["message"] = {"role": "assistant", "content": r.text}
    else:
        choice["text"] = r.text
    out = {"id": rid, "object": obj, "created": int(time.time()), "model": e.name, "choices": [choice],
           "usage": _usage(r)}
    if body.get("figures") is True:  # how it was made (diffuse.serve.language.figures_of), when asked
        out["figures"] = r.figures
    return out


def stream_text(request, ask: TextAsk, rid: str, obj: str, include_usage: bool, figures: bool = False):
    e = ask.engine
    cancel = cancel_for(request)
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    created = int(time.time())

    def on_delta(text):
        loop.call_soon_threadsafe(q.put_nowait, ("delta", text))

    def work():
        try:
            r = ask.generate(cancel, on_delta)
            loop.call_soon_threadsafe(q.put_nowait, ("done", r))
        except BaseException as exc:  # reported in the stream, never raised into the loop
            loop.call_soon_threadsafe(q.put_nowait, ("error", exc))

    def chunk(delta=None, finish=None, usage=None, made=None):
        if obj == "text_completion":
            choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "delta": delta if isinstance(delta, dict) else
                      ({"content": delta} if delta else {}), "finish_reason": finish, "logprobs": None}
        c = {"id": rid, "object": obj, "created": created, "model": e.name, "choices": [choice] if usage is None
             else []}
        if usage is not None:
            c["usage"] = usage
        if made is not None:
            c["figures"] = made
        return _sse(c)

    async def events():
        worker = loop.run_in_executor(None, work)
        try:
            if obj != "text_completion":
                yield chunk({"role": "assistant", "content": ""})
            while True:
                kind, value = await q.get()
                if kind == "delta":
                    yield chunk(value)
                elif kind == "done":
                    yield chunk(finish=value.finish_reason, made=value.figures if figures else None)
                    if include_usage:
                        yield chunk(usage=_usage(value))
                    break
                else:
                    err = _as_api_error(value)
                    if not isinstance(value, Cancelled):
                        log.error("%s stream failed: %s", request.url.path, err.message)
                    yield _sse({"error": {"message": err.message, "type": err.type, "param": err.param,
                                          "code": err.code}})
                    break
            yield _sse("[DONE]")
        finally:  # the stream ended or its client went away: the work stops at its next token, closing its sessions
            cancel.set()
            worker.add_done_callback(_quiet)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _usage(r) -> dict:
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": len(r.tokens),
            "total_tokens": r.prompt_tokens + len(r.tokens)}
