"""The client's inputs for a transformers language model: prompt, images and videos
turned into the tensors ``generate`` takes, by the model's own tokenizer and processor.

Nothing about a model family is written here. A text-only model (no
``vision_config``) gets its tokenizer's chat template; a model that takes
images gets its processor, called as a user would call it: the chat template
through ``processor.apply_chat_template``, then ``processor(text=..., images=...)``.

When ``AutoProcessor`` does not build only because torchvision is missing (the
video processors of SmolVLM and Qwen2-VL import it, and their processors refuse
to build without one), the model's own processor class is built without its
video processor: a subclass made here drops the video attribute from the list
of sub-processors the class loads and checks (``get_attributes``) and hands
``None`` to the class's ``__init__`` for it; in its place the subclass holds a
``_NoVideoProcessor``, whose settings read as unset (None) -- SmolVLM's
``apply_chat_template`` reads ``video_processor.num_frames`` and ``.fps`` even
for a chat without video, to pass on to video loading -- and which refuses to
process a video. Everything else -- loading the tokenizer (AutoTokenizer) and
image processor (AutoImageProcessor), the processor config (``image_seq_len``...),
the chat template, and every step of the processing -- is the class's own code.
Nothing in transformers is patched. Images then work exactly as with the full
processor; videos are refused before they reach it.
"""

from __future__ import annotations

import functools
import json
import mimetypes
import os
import re

from diffuse.errors import DiffuseError

_TEMPLATE_FILES = (".json", ".jinja", ".txt", ".model")


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

def _stamp(model_dir: str) -> tuple:
    """What a cached tokenizer/processor depends on: the folder's small config files."""
    try:
        entries = sorted(os.scandir(model_dir), key=lambda e: e.name)
    except OSError as exc:
        raise DiffuseError(f"cannot read model folder {model_dir}: {exc.strerror or exc}") from None
    out = []
    for e in entries:
        if e.name.endswith(_TEMPLATE_FILES) and e.is_file():
            st = e.stat()
            out.append((e.name, st.st_mtime_ns, st.st_size))
    return tuple(out)


def _key(model_dir) -> tuple[str, tuple]:
    path = os.path.realpath(os.fspath(model_dir))
    return path, _stamp(path)


@functools.lru_cache(maxsize=8)
def _config(path: str, stamp: tuple):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except Exception as exc:
        raise DiffuseError(f"cannot read the config of {path}: {_first_line(exc)}") from None


@functools.lru_cache(maxsize=8)
def _tokenizer(path: str, stamp: tuple):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise DiffuseError(f"cannot load the tokenizer of {path}: {_first_line(exc)}") from None


def load_config(model_dir):
    """The model's config (``AutoConfig``), read once per folder state."""
    return _config(*_key(model_dir))


def load_tokenizer(model_dir):
    """The model's tokenizer (``AutoTokenizer``), for decoding and streaming."""
    return _tokenizer(*_key(model_dir))


def _takes_images(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _missing_package(exc: BaseException) -> str | None:
    """The package an ImportError says is missing, lower case, else None."""
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return exc.name.split(".")[0].lower()
    text = str(exc)
    for pattern in (r"requires the ([\w-]+) library", r"[Pp]ackage `([\w-]+)`", r"pip install ([\w-]+)"):
        m = re.search(pattern, text)
        if m:
            return m.group(1).lower()
    return None


def _processor_class(path: str, config):
    """The model's processor class: ``processor_class`` from the folder's
    processor/preprocessor/tokenizer config, else transformers' processor for
    the config's model type (as AutoProcessor looks it up)."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES, processor_class_from_name
    from transformers.processing_utils import ProcessorMixin

    name = None
    for fname in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        file = os.path.join(path, fname)
        if os.path.isfile(file):
            try:
                with open(file) as f:
                    name = json.load(f).get("processor_class")
            except (OSError, ValueError):
                name = None
            if name:
                break
    if not name:
        name = PROCESSOR_MAPPING_NAMES.get(config.model_type)
    cls = processor_class_from_name(name) if name else None
    if not (isinstance(cls, type) and issubclass(cls, ProcessorMixin)):
        return None
    return cls


class _NoVideoProcessor:
    """Stands where a processor built without its video processor would hold one:
    every setting reads as unset (None), and processing a video raises."""

    def __init__(self, why: str):
        self._why = why

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None

    def __call__(self, *args, **kwargs):
        raise DiffuseError(self._why)

    def __repr__(self):
        return f"<no video processor: {self._why}>"


_NO_VIDEO_WHY = "videos need torchvision, which is not installed: the video processor cannot be built without it"


@functools.lru_cache(maxsize=None)
def _without_video(cls):
    """``cls`` as a subclass that neither loads nor checks a video processor.

    ``ProcessorMixin`` loads one sub-processor per name in ``get_attributes()``
    (read off ``__init__``'s signature) and checks each one's class -- a video
    processor that is None included. The subclass leaves the video attributes out
    of that list, and its loader hands ``None`` for them to ``cls.__init__`` (which
    still takes the argument), where ``ProcessorMixin.__init__`` drops it since it
    is past the attributes listed. The class attribute ``video_processor`` (a
    ``_NoVideoProcessor``) answers what the class's own methods read from it."""
    full = list(cls.get_attributes())
    video = [a for a in full if "video" in a]
    keep = [a for a in full if "video" not in a]
    if not video or full[len(keep):] != video:  # the dropped argument must come last to be dropped
        return None

    def get_attributes(sub):
        return list(keep)

    def _get_arguments_from_pretrained(sub, pretrained_model_name_or_path, processor_dict=None, **kwargs):
        args = super(new, sub)._get_arguments_from_pretrained(pretrained_model_name_or_path, processor_dict, **kwargs)
        return list(args) + [None] * len(video)

    new = type(cls.__name__, (cls,), {
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": f"{cls.__name__} without its video processor (built by diffuse.lm.client_media).",
        "get_attributes": classmethod(get_attributes),
        "_get_arguments_from_pretrained": classmethod(_get_arguments_from_pretrained),
        **{name: _NoVideoProcessor(_NO_VIDEO_WHY) for name in video},
    })
    return new


@functools.lru_cache(maxsize=8)
def _processor(path: str, stamp: tuple):
    """(processor, note): ``note`` is None when AutoProcessor built it as is."""
    from transformers import AutoProcessor

    config = _config(path, stamp)
    try:
        processor = AutoProcessor.from_pretrained(path)
        note = None
    except ImportError as exc:
        missing = _missing_package(exc)
        if missing != "torchvision":
            raise DiffuseError(f"the {config.model_type} processor needs the package "
                               f"{missing or '?'} ({_first_line(exc)}): pip install {missing or 'it'}") from None
        cls = _processor_class(path, config)
        sub = _without_video(cls) if cls is not None else None
        if sub is None:
            raise DiffuseError(f"the {config.model_type} processor needs torchvision, which is not installed, "
                               f"and cannot be built without its video processor") from None
        try:
            processor = sub.from_pretrained(path)
        except ImportError as exc2:
            missing = _missing_package(exc2) or "?"
            raise DiffuseError(f"the {cls.__name__} needs the package {missing}, which is not installed: "
                               f"pip install {missing}") from None
        except Exception as exc2:
            raise DiffuseError(f"cannot build {cls.__name__} for {path}: {_first_line(exc2)}") from None
        note = (f"{cls.__name__} built without its video processor, which needs torchvision (not installed): "
                f"images work as with the full processor, videos do not")
    except Exception as exc:
        raise DiffuseError(f"cannot build the processor of {path}: {_first_line(exc)}") from None
    if not hasattr(processor, "image_processor") or not hasattr(processor, "tokenizer"):
        raise DiffuseError(f"the processor of {path} is a {type(processor).__name__}, not one that takes images")
    return processor, note


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
