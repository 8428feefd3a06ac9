"""Ground truth for language models: run a saved model whole, in plain transformers.

    python tests/lm_reference.py --model DIR --prompt TEXT [--image FILE]...
        [--max-new-tokens N] [--threads N]
        [--do-sample --seed S --temperature T --top-p P --top-k K]
        [--arg KEY=JSON]... [--no-template] --out OUT.json

Loads the model with ``AutoModelForImageTextToText`` when its config has a
``vision_config``, ``AutoModelForSeq2SeqLM`` when it is an encoder-decoder, else
``AutoModelForCausalLM`` (float32 unless ``--dtype`` names another, on the CPU unless ``--device`` names
another, sdpa where the class has it), sets the torch
thread count when ``--threads`` > 0, builds the inputs (``build_inputs``) and
calls ``generate(**inputs, max_new_tokens=N, do_sample=..., output_logits=True,
return_dict_in_generate=True)``; with ``--do-sample``, ``torch.manual_seed(S)``
runs right before ``generate``, and only the sampling options given are
passed (the others come from the model's generation_config); ``--arg`` passes
any other ``generate`` argument (VALUE is JSON). Writes::

    {"input_ids": [[...]], "new_tokens": [[...]],
     "top": [{"ids": [8 ids], "values_hex": [8 x float32 bytes as hex]}, ...]}

``top`` has one entry per generated token, from the raw logits of batch row 0
(``output_logits``, before any logits processor): the 8 highest, ordered by
value then by id (lowest id first among equal values, as ``argmax`` picks);
``values_hex`` is each float32's little-endian bytes as hex, so a split run is
compared bit for bit.

Inputs: one user turn holding the images, then the text, through the chat
template with ``add_generation_prompt=True`` -- the processor's when the
processor builds, else the tokenizer's. SmolVLMProcessor and Qwen2VLProcessor do
not build without torchvision (and SmolVLM's also wants num2words); then the
inputs are built exactly as those processors build them: the tokenizer plus the
saved image processor, each image placeholder expanded (Qwen2-VL: one
``<|image_pad|>`` per ``image_grid_thw.prod() // merge_size**2``; SmolVLM /
Idefics3: the row/column tiling prompt around ``image_seq_len`` ``<image>``
tokens), plus ``mm_token_type_ids`` for Qwen2-VL. A line on stderr says so.
With ``--no-template`` the prompt is tokenized as given; images then need their
placeholder in it, and one is put in front of the prompt for each image when
it has none.

Imports only torch, numpy, PIL and transformers: nothing from ``diffuse`` or
tests/, so the reference cannot share a bug with what it checks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch
from PIL import Image
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSeq2SeqLM,
    AutoProcessor,
    AutoTokenizer,
)

TOP_K = 8

# What a chat template writes for one image, per model type: the text the
# processor then expands (also put in front of a --no-template prompt).
_IMAGE_PLACEHOLDER = {
    "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "smolvlm": "<image>",
    "idefics3": "<image>",
}
# The token inside the placeholder that the processor expands.
_IMAGE_TOKEN = {"qwen2_vl": "<|image_pad|>", "smolvlm": "<image>", "idefics3": "<image>"}


def takes_images(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def load_model(model_dir: str, dtype: str = "float32", device: str | None = None):
    """The model, float32 (or ``dtype``) and sdpa (eager for a class that has no sdpa path, as ``from_pretrained``
    itself falls back), in eval mode, with the Auto class its config calls for; moved to ``device`` if given."""
    config = AutoConfig.from_pretrained(model_dir)
    auto = AutoModelForImageTextToText if takes_images(config) else \
        AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM
    try:
        model = auto.from_pretrained(model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    except ValueError as exc:
        if "scaled_dot_product_attention" not in str(exc):
            raise
        model = auto.from_pretrained(model_dir, dtype=getattr(torch, dtype), attn_implementation="eager")
    return model.eval() if device is None else model.eval().to(device)


def _open_images(images) -> list:
    out = []
    for image in images or []:
        if isinstance(image, (str, os.PathLike)):
            with Image.open(image) as f:
                f.load()
                image = f.copy()
        out.append(image)
    return out


def _messages(prompt: str, n_images: int, multimodal: bool) -> list[dict]:
    if not multimodal:
        return [{"role": "user", "content": prompt}]
    content = [{"type": "image"} for _ in range(n_images)]
    content.append({"type": "text", "text": prompt})
    return [{"role": "user", "content": content}]


def _try_processor(model_dir: str):
    """(processor, None), or (None, why) when it will not build."""
    try:
        processor = AutoProcessor.from_pretrained(model_dir)
    except Exception as exc:  # ImportError (torchvision, num2words), ValueError, ...
        first = str(exc).strip().split(". ")[0].splitlines()[0] if str(exc).strip() else ""
        return None, f"{type(exc).__name__}: {first}"
    if not hasattr(processor, "image_processor") or not hasattr(processor, "tokenizer"):
        return None, f"AutoProcessor gave a {type(processor).__name__}, not a multimodal processor"
    return processor, None


def _tokenize(tokenizer, text: str):
    """Tokenize one prompt as the processors do: ``add_special_tokens`` left at the
    tokenizer's default, except off when the text already starts with bos (as
    ``ProcessorMixin.apply_chat_template`` does)."""
    kwargs = {}
    if tokenizer.bos_token is not None and text.startswith(tokenizer.bos_token):
        kwargs["add_special_tokens"] = False
    enc = tokenizer([text], return_tensors="pt", **kwargs)
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def _with_placeholders(text: str, placeholder: str, token: str, n_images: int) -> str:
    """--no-template with images: one placeholder per image in front of the text
    unless the text already has them."""
    found = text.count(token)
    if found == 0:
        return placeholder * n_images + text
    if found != n_images:
        raise ValueError(f"the prompt has {found} {token} placeholders for {n_images} images")
    return text


def _expand(text: str, token: str, replacements: list[str]) -> str:
    """Replace the i-th ``token`` in ``text`` by ``replacements[i]`` (in one pass,
    as ``ProcessorMixin.get_text_with_replacements`` does)."""
    pieces = text.split(token)
    if len(pieces) - 1 != len(replacements):
        raise ValueError(f"{len(pieces) - 1} {token} in the prompt for {len(replacements)} images")
    out = [pieces[0]]
    for replacement, piece in zip(replacements, pieces[1:]):
        out.append(replacement)
        out.append(piece)
    return "".join(out)


def _image_seq_len(model_dir: str, config) -> int:
    """SmolVLM/Idefics3 ``<image>`` tokens per tile: processor_config.json's
    ``image_seq_len``, else what the model computes from its config."""
    path = os.path.join(model_dir, "processor_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            value = json.load(f).get("image_seq_len")
        if value is not None:
            return int(value)
    vision = config.vision_config
    return int(((vision.image_size // vision.patch_size) ** 2) / (config.scale_factor**2))


def _tiling_prompt(rows: int, cols: int, image_seq_len: int) -> str:
    """The string SmolVLMProcessor/Idefics3Processor put in place of one ``<image>``."""
    fake, image, global_image = "<fake_token_around_image>", "<image>", "<global-img>"
    if rows == 0 and cols == 0:
        return f"{fake}{global_image}" + image * image_seq_len + fake
    text = ""
    for r in range(rows):
        for c in range(cols):
            text += f"{fake}<row_{r + 1}_col_{c + 1}>" + image * image_seq_len
        text += "\n"
    return text + f"\n{fake}{global_image}" + image * image_seq_len + fake


def _by_hand(model_dir: str, config, text: str, images: list) -> dict:
    """Inputs for ``text`` (template applied, placeholders not yet expanded) as
    the model's processor would build them."""
    model_type = config.model_type
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if model_type == "qwen2_vl":
        # Qwen2VLProcessor returns mm_token_type_ids even for text alone.
        pixels = {}
        if images:
            image_processor = AutoImageProcessor.from_pretrained(model_dir)
            pixels = image_processor(images, return_tensors="pt")
            merge = image_processor.merge_size**2
            counts = [int(grid.prod()) // merge for grid in pixels["image_grid_thw"]]
            token = _IMAGE_TOKEN[model_type]
            text = _expand(text, token, [token * n for n in counts])
        inputs = _tokenize(tokenizer, text)
        ids = inputs["input_ids"]
        types = torch.zeros_like(ids)
        types[ids == config.image_token_id] = 1
        types[ids == config.video_token_id] = 2
        inputs["mm_token_type_ids"] = types
        if images:
            inputs["pixel_values"] = pixels["pixel_values"]
            inputs["image_grid_thw"] = pixels["image_grid_thw"]
        return inputs
    if not images:
        return _tokenize(tokenizer, text)
    image_processor = AutoImageProcessor.from_pretrained(model_dir)
    if model_type in ("smolvlm", "idefics3"):
        pixels = image_processor([images], return_tensors="pt", return_row_col_info=True)
        rows = [r for row in pixels["rows"] for r in row]
        cols = [c for col in pixels["cols"] for c in col]
        seq_len = _image_seq_len(model_dir, config)
        text = _expand(text, _IMAGE_TOKEN[model_type], [_tiling_prompt(r, c, seq_len) for r, c in zip(rows, cols)])
        inputs = _tokenize(tokenizer, text)
        inputs["pixel_values"] = pixels["pixel_values"]
        if "pixel_attention_mask" in pixels:
            inputs["pixel_attention_mask"] = pixels["pixel_attention_mask"]
        return inputs
    raise NotImplementedError(f"no hand-built inputs for model type {model_type!r}; install what its processor needs")


def build_inputs_with_note(model_dir: str, prompt: str, images=(), no_template: bool = False):
    """(inputs, note): the model inputs as a dict of tensors (batch 1), and a
    line saying how they were built when not by the processor (else None)."""
    config = AutoConfig.from_pretrained(model_dir)
    images = _open_images(images)
    multimodal = takes_images(config)
    if images and not multimodal:
        raise ValueError(f"{config.model_type} takes no images")
    model_type = config.model_type

    if not multimodal:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if no_template:
            text = prompt
        else:
            text = tokenizer.apply_chat_template(
                _messages(prompt, 0, False), add_generation_prompt=True, tokenize=False
            )
        return _tokenize(tokenizer, text), None

    if no_template and images:
        prompt = _with_placeholders(prompt, _IMAGE_PLACEHOLDER[model_type], _IMAGE_TOKEN[model_type], len(images))
    messages = _messages(prompt, len(images), True)

    processor, why = _try_processor(model_dir)
    if processor is not None:
        if no_template:
            text = prompt
        else:
            text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        kwargs = {}
        bos = processor.tokenizer.bos_token
        if bos is not None and text.startswith(bos):
            kwargs["add_special_tokens"] = False
        out = processor(text=[text], images=images or None, return_tensors="pt", **kwargs)
        return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}, None

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if no_template:
        text = prompt
    else:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    note = (
        f"lm_reference: inputs built by hand ({'tokenizer + image processor' if images else 'tokenizer'}, "
        f"as the processor builds them): the {config.model_type} processor does not build here ({why})"
    )
    return _by_hand(model_dir, config, text, images), note


def build_inputs(model_dir: str, prompt: str, images=(), no_template: bool = False) -> dict:
    """The inputs ``generate`` gets: ``input_ids`` and ``attention_mask`` (1, L),
    plus ``pixel_values`` and the model's image extras (``image_grid_thw`` and
    ``mm_token_type_ids`` for Qwen2-VL; ``pixel_attention_mask`` for SmolVLM).
    ``images`` are file paths or PIL images, placed before the text."""
    return build_inputs_with_note(model_dir, prompt, images, no_template)[0]


def _top(logits: torch.Tensor) -> dict:
    """The TOP_K largest of one row of raw logits, by value then lowest id."""
    values = logits.detach().to(torch.float32).cpu().numpy()
    order = np.lexsort((np.arange(values.shape[0]), -values))[:TOP_K]
    picked = values[order].astype("<f4")
    return {"ids": [int(i) for i in order], "values_hex": [v.tobytes().hex() for v in picked]}


# how a split run's assistant drafts (diffuse.lm.client_drafts.Drafting.arguments, --draft-tokens 8), written out here
_ASSISTANT_SCHEDULE = {"num_assistant_tokens": 8, "num_assistant_tokens_schedule": "heuristic",
                       "assistant_confidence_threshold": 0}


def run(model_dir: str, prompt: str, images=(), max_new_tokens: int = 8, threads: int = 0, do_sample: bool = False,
        seed: int = 0, temperature=None, top_p=None, top_k=None, no_template: bool = False,
        generate_args: dict | None = None, dtype: str = "float32", device: str | None = None,
        assistant: str | None = None) -> dict:
    if threads > 0:
        torch.set_num_threads(threads)
    model = load_model(model_dir, dtype, device)
    inputs, note = build_inputs_with_note(model_dir, prompt, images, no_template)
    if device is not None:
        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in dict(inputs).items()}
    if note:
        print(note, file=sys.stderr)
    kwargs = dict(
        max_new_tokens=max_new_tokens,
        do_sample=do_sample,
        output_logits=True,
        return_dict_in_generate=True,
        **(generate_args or {}),
    )
    if assistant:  # assisted generation: the assistant drafts, transformers' own schedule and acceptance rule
        kwargs["assistant_model"] = AutoModelForCausalLM.from_pretrained(assistant, dtype=getattr(torch, dtype))
        kwargs["assistant_model"].generation_config.update(**_ASSISTANT_SCHEDULE)
    if do_sample:
        for key, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k)):
            if value is not None:
                kwargs[key] = value
        torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(**inputs, **kwargs)
    prompt_len = inputs["input_ids"].shape[1]
    if model.config.is_encoder_decoder:  # the sequences are the decoder's: its start token, then the new ones
        prompt_len = out.sequences.shape[1] - len(out.logits)
    return {
        "input_ids": inputs["input_ids"].tolist(),
        "new_tokens": out.sequences[:, prompt_len:].tolist(),
        "top": [_top(step[0]) for step in out.logits],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model")
    parser.add_argument("--prompt")
    parser.add_argument("--image", action="append", default=[], help="an image file; repeat for more")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 leaves torch's default")
    parser.add_argument("--do-sample", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--arg", action="append", default=[], metavar="KEY=JSON", help="another generate argument")
    parser.add_argument("--no-template", action="store_true", help="tokenize the prompt as given")
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="float32", help="the dtype to load in (default float32)")
    parser.add_argument("--device", help="where to run (default: the CPU)")
    parser.add_argument("--jobs", metavar="FILE.json",
                        help="run each job of this JSON list instead ({model, prompt, images, max_new_tokens, "
                             "do_sample, seed, temperature, top_p, top_k, generate_args, no_template, assistant}; "
                             "assistant: a model folder that drafts (assisted generation); each model "
                             "loaded afresh) "
                             "and write the list of results: several references for one interpreter start")
    args = parser.parse_args(argv)
    if args.jobs:
        if args.threads > 0:
            torch.set_num_threads(args.threads)
        with open(args.jobs) as f:
            jobs = json.load(f)
        results = [run(job["model"], job["prompt"], job.get("images", ()), max_new_tokens=job.get("max_new_tokens", 8),
                       threads=0, do_sample=job.get("do_sample", False), seed=job.get("seed", 0),
                       temperature=job.get("temperature"), top_p=job.get("top_p"), top_k=job.get("top_k"),
                       no_template=job.get("no_template", False), generate_args=job.get("generate_args"),
                       dtype=job.get("dtype", "float32"), device=job.get("device"), assistant=job.get("assistant"))
                   for job in jobs]
        with open(args.out, "w") as f:
            json.dump(results, f)
        return 0

    if not args.model or args.prompt is None:
        parser.error("--model and --prompt are needed (or --jobs)")
    result = run(
        args.model,
        args.prompt,
        args.image,
        max_new_tokens=args.max_new_tokens,
        threads=args.threads,
        do_sample=args.do_sample,
        seed=args.seed,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        no_template=args.no_template,
        generate_args={k: json.loads(v) for k, _, v in (a.partition("=") for a in args.arg)},
        dtype=args.dtype,
        device=args.device,
    )
    with open(args.out, "w") as f:
        json.dump(result, f)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
