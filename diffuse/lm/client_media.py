"""The client's inputs for a transformers language model: prompt, images and videos
turned into the tensors ``generate`` takes, by the model's own tokenizer and processor.

Nothing about a model family is written here. A text-only model (no
``vision_config``) gets its tokenizer's chat template; a model that takes
images gets its processor, called as a user would call it: the chat template
through ``processor.apply_chat_template``, then ``processor(text=..., images=...)``.

The model's config, tokenizer and processor are loaded by
``diffuse.lm.client_loading``.
"""

from __future__ import annotations

import functools
import mimetypes
import os

from diffuse.errors import DiffuseError
from diffuse.lm.client_loading import _NoVideoProcessor, _config, _first_line, _key, _processor, _tokenizer


# ---------------------------------------------------------------- media kind

def media_kind(path) -> str:
    """``"image"``, ``"video"`` or ``"audio"``, by the file's content: an image when
    PIL can open it, else by magic bytes (mp4/mov/m4a, webm/mkv, avi/wav, flac,
    mp3, ogg), else a video or audio mime type guessed from the name."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DiffuseError(f"no such file: {path}")
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path):
            return "image"
    except (UnidentifiedImageError, OSError, ValueError):
        pass
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as exc:
        raise DiffuseError(f"cannot read {path}: {exc.strerror or exc}") from None
    kind = _kind_from_magic(head)
    if kind is None:
        mime = mimetypes.guess_type(path)[0] or ""
        kind = next((k for k in ("video", "audio") if mime.startswith(k + "/")), None)
    if kind is None:
        raise DiffuseError(f"cannot tell what {path} holds: not an image PIL can read, nor a known video or audio format")
    return kind


def _kind_from_magic(head: bytes) -> str | None:
    if head[4:8] == b"ftyp":  # ISO base media: mp4, mov, m4a, 3gp
        brand = head[8:12]
        return "audio" if brand in (b"M4A ", b"M4B ", b"M4P ", b"F4A ") else "video"
    if head[4:8] in (b"moov", b"mdat", b"wide", b"free", b"skip"):  # old QuickTime
        return "video"
    if head[:4] == b"\x1a\x45\xdf\xa3":  # EBML: webm, mkv
        return "video"
    if head[:4] == b"RIFF":
        if head[8:12] == b"AVI ":
            return "video"
        if head[8:12] == b"WAVE":
            return "audio"
    if head[:4] in (b"fLaC", b"OggS") or head[:3] == b"ID3" or head[:4] == b"FORM":
        return "audio"
    if len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0:  # mp3/aac frame sync
        return "audio"
    return None


# ---------------------------------------------------------------- loading (cached per folder state)

def load_config(model_dir):
    """The model's config (``AutoConfig``), read once per folder state."""
    return _config(*_key(model_dir))


def load_tokenizer(model_dir):
    """The model's tokenizer (``AutoTokenizer``), for decoding and streaming."""
    return _tokenizer(*_key(model_dir))


def _takes_images(config) -> bool:
    return getattr(config, "vision_config", None) is not None


# ---------------------------------------------------------------- media

def _open_image(image):
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        return image
    if not isinstance(image, (str, os.PathLike)):
        raise DiffuseError(f"an image must be a file path or a PIL image, not {type(image).__name__}")
    path = os.fspath(image)
    try:
        with Image.open(path) as f:
            f.load()
            return f.copy()
    except FileNotFoundError:
        raise DiffuseError(f"no such image file: {path}") from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        kind = None
        try:
            kind = media_kind(path)
        except DiffuseError:
            pass
        if kind in ("video", "audio"):
            raise DiffuseError(f"{path} is {'a video' if kind == 'video' else 'audio'}, not an image") from None
        raise DiffuseError(f"cannot read image {path}: {_first_line(exc)}") from None


def _check_video(video):
    if isinstance(video, (str, os.PathLike)) and not os.path.isfile(os.fspath(video)):
        raise DiffuseError(f"no such video file: {os.fspath(video)}")
    return os.fspath(video) if isinstance(video, os.PathLike) else video


# ---------------------------------------------------------------- text

def _tokenize(tokenizer, text: str) -> dict:
    """As the processors tokenize a rendered chat: special tokens off when the text already starts with bos."""
    kwargs = {}
    if tokenizer.bos_token is not None and text.startswith(tokenizer.bos_token):
        kwargs["add_special_tokens"] = False
    enc = tokenizer([text], return_tensors="pt", **kwargs)
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def _has_template(obj) -> bool:
    return bool(getattr(obj, "chat_template", None))


def _renders_chats_itself(tokenizer) -> bool:
    """A tokenizer with no Jinja template whose class renders conversations by its own code (Mistral's tekken
    tokenizer: its chat format lives in mistral-common, and only its token ids are safe, not a rendered text
    tokenized again)."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    own = getattr(type(tokenizer), "apply_chat_template", None)
    return not _has_template(tokenizer) and own is not None and own is not PreTrainedTokenizerBase.apply_chat_template


def _chat_ids(tokenizer, messages: list[dict]) -> dict:
    import torch

    try:
        enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    except Exception as exc:
        raise DiffuseError(f"the {type(tokenizer).__name__} could not render the conversation: {_first_line(exc)}") from None
    ids = torch.tensor([list(enc["input_ids"])], dtype=torch.long)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _media_token(processor, kind: str) -> str | None:
    token = getattr(processor, f"{kind}_token", None) or getattr(processor.tokenizer, f"{kind}_token", None)
    return token if isinstance(token, str) and token else None


@functools.lru_cache(maxsize=32)
def _placeholder_cached(processor, kind: str) -> str | None:
    """What the processor's chat template writes for one image (or video): the text
    that a second entry adds to a user turn holding one."""
    token = _media_token(processor, kind)
    if token is None:
        return None
    if _has_template(processor):
        mark = "\u2063q"
        try:
            one, two = (
                processor.apply_chat_template(
                    [{"role": "user", "content": [{"type": kind}] * n + [{"type": "text", "text": mark}]}],
                    add_generation_prompt=False, tokenize=False)
                for n in (1, 2)
            )
        except Exception:
            one = two = None
        if isinstance(one, str) and isinstance(two, str) and len(two) > len(one):
            start = 0
            while start < len(one) and one[start] == two[start]:
                start += 1
            end = 0
            while end < len(one) - start and one[-1 - end] == two[-1 - end]:
                end += 1
            added = two[start:len(two) - end]
            if added.count(token) == 1 and two == one[:start] + added + one[start:]:
                return added
    return token


def _with_placeholders(processor, prompt: str, kind: str, n: int) -> str:
    """``no_template``: the prompt as given when it holds the placeholders; one put in
    front per item when it holds none."""
    if n == 0:
        return prompt
    token = _media_token(processor, kind)
    if token is None:
        raise DiffuseError(f"the {type(processor).__name__} has no {kind} placeholder token")
    found = prompt.count(token)
    if found == 0:
        return (_placeholder_cached(processor, kind) or token) * n + prompt
    if found != n:
        raise DiffuseError(f"the prompt has {found} {token} placeholder{'s' if found != 1 else ''} "
                           f"for {n} {kind}{'s' if n != 1 else ''}")
    return prompt


def _call_processor(processor, text: str, images: list, videos: list) -> dict:
    import torch

    kwargs = {}
    bos = processor.tokenizer.bos_token
    if bos is not None and text.startswith(bos):
        kwargs["add_special_tokens"] = False
    try:
        out = processor(text=[text], images=images or None, videos=videos or None, return_tensors="pt", **kwargs)
    except DiffuseError:
        raise
    except Exception as exc:
        raise DiffuseError(f"the {type(processor).__name__} could not process the input: {_first_line(exc)}") from None
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}


def _media(path: str, stamp: tuple, images, videos):
    """(config, processor or None, note, opened images, videos), with the refusals."""
    config = _config(path, stamp)
    images, videos = list(images or ()), list(videos or ())
    if not _takes_images(config):
        if images or videos:
            kind = "images" if images else "videos"
            raise DiffuseError(f"{config.model_type} is a text-only model: it takes no {kind}")
        return config, None, None, [], []
    processor, note = _processor(path, stamp)
    if videos:
        held = getattr(processor, "video_processor", None)
        if isinstance(held, _NoVideoProcessor):
            raise DiffuseError(f"videos need torchvision, which is not installed: the {type(processor).__name__}'s "
                               f"video processor cannot be built without it (pip install torchvision)")
        if held is None:
            raise DiffuseError(f"{config.model_type} takes no videos")
        videos = [_check_video(v) for v in videos]
    images = [_open_image(i) for i in images]
    return config, processor, note, images, videos


def build_inputs(model_dir: str, prompt: str, images: list = (), videos: list = (),
                 no_template: bool = False) -> tuple[dict, str | None]:
    """(inputs for ``generate`` as a dict of tensors, batch 1; a one-line note when the
    processor could not be built as is, else None).

    A text-only model: its tokenizer's chat template (one user turn, generation
    prompt added) when it has one, else the prompt as is. A model that takes images:
    its processor's chat template with one user turn holding the images, the videos,
    then the text; then the processor itself. ``no_template``: the prompt as given
    (with images, one placeholder put in front per image when it holds none).
    ``images``: file paths or PIL images; ``videos``: file paths."""
    path, stamp = _key(model_dir)
    config, processor, note, images, videos = _media(path, stamp, images, videos)
    if processor is None:
        tokenizer = _tokenizer(path, stamp)
        chat = [{"role": "user", "content": prompt}]
        if not no_template and _renders_chats_itself(tokenizer):
            return _chat_ids(tokenizer, chat), None
        if no_template or not _has_template(tokenizer):
            text = prompt
        else:
            text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        return _tokenize(tokenizer, text), None

    if no_template or not _has_template(processor):
        text = _with_placeholders(processor, prompt, "image", len(images))
        text = _with_placeholders(processor, text, "video", len(videos)) if videos else text
    else:
        content = [{"type": "image"} for _ in images] + [{"type": "video"} for _ in videos]
        content.append({"type": "text", "text": prompt})
        text = processor.apply_chat_template([{"role": "user", "content": content}],
                                             add_generation_prompt=True, tokenize=False)
    return _call_processor(processor, text, images, videos), note


def _content_parts(content) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list):
        return [dict(part) if isinstance(part, dict) else {"type": "text", "text": str(part)} for part in content]
    raise DiffuseError(f"a message's content must be a string or a list of parts, not {type(content).__name__}")


def chat_inputs(model_dir, messages: list[dict], images=()) -> tuple[dict, str | None]:
    """``build_inputs`` for a whole conversation: ``messages`` (``{"role", "content"}``,
    content a string or a list of parts) rendered by the chat template, with the
    generation prompt added. ``images`` fill the conversation's ``{"type": "image"}``
    parts in order (a part may also carry its own, as ``"image"`` or ``"path"``);
    when the messages hold no image part, they go in front of the last user turn."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise DiffuseError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    path, stamp = _key(model_dir)
    config = _config(path, stamp)
    images = list(images or ())
    if not _takes_images(config):
        _media(path, stamp, images, ())  # refuses images
        tokenizer = _tokenizer(path, stamp)
        if _renders_chats_itself(tokenizer):
            return _chat_ids(tokenizer, messages), None
        if not _has_template(tokenizer):
            raise DiffuseError(f"{config.model_type} has no chat template: a conversation cannot be rendered "
                               f"(give one prompt instead)")
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return _tokenize(tokenizer, text), None

    rendered = [{**m, "content": _content_parts(m["content"])} for m in messages]
    parts = [p for m in rendered for p in m["content"] if p.get("type") == "image"]
    own = [p.get("image", p.get("path")) for p in parts]
    if parts and not images and all(x is not None for x in own):
        images = own
    for p in parts:
        p.pop("image", None)
        p.pop("path", None)
    if not parts and images:
        users = [m for m in rendered if m.get("role") == "user"]
        if not users:
            raise DiffuseError("images need a user turn to go in")
        users[-1]["content"] = [{"type": "image"} for _ in images] + users[-1]["content"]
    elif len(parts) != len(images):
        raise DiffuseError(f"the messages have {len(parts)} image part{'s' if len(parts) != 1 else ''} "
                           f"for {len(images)} image{'s' if len(images) != 1 else ''}")
    config, processor, note, images, _ = _media(path, stamp, images, ())
    if not _has_template(processor):
        raise DiffuseError(f"the {type(processor).__name__} has no chat template: a conversation cannot be rendered")
    text = processor.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
    return _call_processor(processor, text, images, []), note
