"""The client's loaders for a transformers language model: its config, tokenizer and
processor, each read once per folder state (the folder's small config files).

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
import os
import re

from diffuse.errors import DiffuseError

_TEMPLATE_FILES = (".json", ".jinja", ".txt", ".model")


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
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise DiffuseError(f"cannot load the tokenizer of {path}: {_first_line(exc)}") from None
    if len(tokenizer) < 2:  # transformers builds an empty one from the config alone: every prompt would be no tokens
        raise DiffuseError(f"{path} has no tokenizer files (tokenizer.json, tokenizer_config.json, or the "
                           "vocabulary they name): copy them in beside config.json")
    return tokenizer


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
        "__doc__": f"{cls.__name__} without its video processor (built by diffuse.lm.client_loading).",
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
