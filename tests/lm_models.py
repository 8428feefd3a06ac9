"""Tiny transformers language models, built offline and saved for ``from_pretrained``.

``build(name, out_dir)`` (or ``BUILDERS[name](out_dir, seed=0)``) writes a complete
model folder -- config.json, model.safetensors, generation_config.json, the
tokenizer files and, for models that take images, preprocessor_config.json --
with seeded random float32 weights, and returns the folder. Nothing is fetched
from a hub: the tokenizers are byte-level BPEs trained here, with the
``tokenizers`` library, on the small fixed English text below.

Every model has 4 decoder layers of hidden size 32 (so a 2- or 4-node split gives
every node a layer) and is saved for sdpa attention. Weights are drawn from
``torch.manual_seed(seed)`` and then redrawn wider than the class's own
initializer (normal, std 0.2; norm scales 1 + normal, std 0.2), so greedy
generations are not one token repeated (with the class's std 0.02 they are).
Building twice with the same seed writes byte-identical files.

Two deliberate edits to the random weights keep generation going for the
length a test asks for: the output-embedding rows of the eos token and of the
padding ids past the tokenizer (the model's vocab is rounded up to a multiple
of 64, as Qwen's is) are zeroed, so their logit is exactly 0 while the others
spread around 0: greedy decoding never picks them and sampling rarely does.
With tied embeddings (qwen2, hybrid, qwen2_vl) that also zeroes the input
embedding of ``<|endoftext|>``, which only ever appears as left padding.

Traps the models exercise (FACTS-transformers.md):

- ``qwen2``: ``AutoTokenizer`` always loads a qwen2 folder as ``Qwen2Tokenizer``,
  which rebuilds its pre-tokenizer from code, so the folder carries a real
  byte-level BPE (vocab.json + merges.txt, and tokenizer.json) trained with that
  same pre-tokenizer; tied word embeddings, as in Qwen2.5-0.5B.
- ``hybrid``: Qwen2 with ``layer_types`` alternating full and sliding attention
  (window 4): each layer needs the mask of its own type, and the cache needs
  ``DynamicCache(config=...)``.
- ``smolvlm``: SmolVLM (Idefics3 layout, Llama text model); its processor will not
  build without torchvision and num2words, so clients expand ``<image>`` into the
  row/column tiling prompt themselves (image_seq_len is in processor_config.json).
- ``qwen2_vl``: M-RoPE (``mrope_section`` [2, 1, 1] for head_dim 8), a vision tower
  with its own block stack, ``mm_token_type_ids``; its processor needs
  torchvision too, so clients expand ``<|image_pad|>`` by the image grid.

    python tests/lm_models.py NAME OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

NAMES = ["qwen2", "hybrid", "smolvlm", "qwen2_vl", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "falcon",
         "olmo", "gemma2_capped", "bloom", "t5", "t5_untied"]

# The text the byte-level BPEs are trained on: plain English plus the words the
# chat templates and test prompts use, so those become few tokens.
_CORPUS = """\
You are a helpful assistant. The user asks a question and the assistant answers it.
system user assistant User Assistant: Describe the image. What is in this picture?
Describe this image in one short sentence. What do you see in the picture?
A small red cat sits on a green chair next to the window.
The quick brown fox jumps over the lazy dog.
A squirrel eats a burger in the park on a sunny day, and a bird sings in the tree.
Once upon a time there was a little house by the river, and in the house lived
an old man with his dog. Every morning the man walked to the market to buy bread,
milk, apples and fresh fish for dinner. In the evening he told stories to the
children of the village about the sea, the mountains and the stars in the sky.
Tell me a story about a robot who learns to paint. Write a poem about the moon.
How many legs does a spider have? Eight. What is the capital of France? Paris.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 12 20 42 100. Colors: red, green, blue, yellow, white, black.
"""

_BPE_VOCAB = 384  # 256 byte symbols + 128 merges; the special tokens come after
_VOCAB_MULTIPLE = 64  # the model's vocab_size is rounded up to this, like Qwen's

_HIDDEN = 32
_LAYERS = 4

# Qwen-style ChatML with the default system turn; message content may be a
# string or a list of {"type": "text"} parts.
QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Qwen2-VL-Instruct's template (images and videos become
# <|vision_start|><|image_pad|><|vision_end|>, expanded later by the grid).
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# SmolVLM's template (transformers' processing_smolvlm.DEFAULT_CHAT_TEMPLATE):
# images become a bare <image>, expanded later into the tiling prompt.
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'] is string %}{{': ' + message['content']}}"
    "{% else %}{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% elif line['type'] == 'video' %}{{ '<video>' }}"
    "{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN2_VL_SPECIALS = QWEN2_SPECIALS + ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
SMOLVLM_SPECIALS = (
    ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<fake_token_around_image>", "<image>", "<end_of_utterance>"]
    + ["<global-img>"]
    + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
)


# --------------------------------------------------------------------------- #
# tokenizers


def _train_bpe() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE (vocab, merges) trained on ``_CORPUS`` with Qwen2's own
    normalizer and pre-tokenizer (NFC, its split regex, ByteLevel without regex),
    so ``Qwen2Tokenizer`` -- which rebuilds that pipeline from code on load --
    tokenizes exactly as the merges were learned. The trainer is deterministic
    (merges ranked by count, then by pair), checked by building twice."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer)
    model = json.loads(tok.to_str())["model"]
    return dict(model["vocab"]), [tuple(m) for m in model["merges"]]


def _qwen2_tokenizer(specials: list[str], chat_template: str):
    """A ``Qwen2Tokenizer`` over the trained BPE; ``specials`` get the ids after
    the BPE vocab, in order (``<|endoftext|>`` first: eos, pad and unk, as in Qwen)."""
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    vocab, merges = _train_bpe()
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges)
    assert specials[0] == "<|endoftext|>"
    tok.add_special_tokens({"additional_special_tokens": specials[1:]})
    tok.chat_template = chat_template
    return tok


def _smolvlm_tokenizer():
    """A GPT-2 style byte-level tokenizer (what SmolVLM ships) over the trained
    BPE, with SmolVLM's added tokens: ``<|im_start|>`` as bos (no post-processor
    adds it: the chat template writes it), ``<end_of_utterance>`` as eos,
    ``<|im_end|>`` as pad, and the image tokens its processor expands
    (``<fake_token_around_image>``, ``<image>``, ``<global-img>``, ``<row_r_col_c>``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab, merges = _train_bpe()
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SMOLVLM_SPECIALS])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<end_of_utterance>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=SMOLVLM_SPECIALS[3:],
        model_max_length=8192,
    )
    tok.chat_template = SMOLVLM_CHAT_TEMPLATE
    return tok


def _vocab_size(tokenizer) -> int:
    n = len(tokenizer)
    return -(-n // _VOCAB_MULTIPLE) * _VOCAB_MULTIPLE


# --------------------------------------------------------------------------- #
# weights and saving


def _seed(seed: int) -> None:
    import torch

    torch.manual_seed(seed)


def _randomize(model, seed: int, quiet_ids: list[int]) -> None:
    """Redraw every parameter from a generator seeded with ``seed``: norm
    scales 1 + N(0, 0.2), everything else N(0, 0.2) (the classes' own init is
    std 0.02, whose greedy output repeats one token). Then zero the output
    rows of ``quiet_ids`` (eos and vocab padding) so they score exactly 0."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    done = set()
    with torch.no_grad():
        for mname, module in model.named_modules():
            is_norm = "norm" in type(module).__name__.lower()
            for pname, p in module.named_parameters(recurse=False):
                if id(p) in done:
                    continue
                done.add(id(p))
                noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.2
                if is_norm and pname == "weight":
                    noise += 1.0
                p.copy_(noise.to(p.dtype))
        head = model.get_output_embeddings().weight
        head[quiet_ids] = 0.0


def _save(model, tokenizer, out_dir: str, generation: dict, image_processor=None, extra_files=None) -> str:
    """save_pretrained for model (safetensors), generation config, tokenizer
    (tokenizer.json, plus vocab.json + merges.txt) and image processor."""
    from transformers import GenerationConfig

    os.makedirs(out_dir, exist_ok=True)
    model.generation_config = GenerationConfig(**generation)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    # The slow-file form too (Qwen ships both): Qwen2Tokenizer reloads from it.
    tokenizer.backend_tokenizer.model.save(out_dir)
    if image_processor is not None:
        image_processor.save_pretrained(out_dir)
    for name, content in (extra_files or {}).items():
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(content, f, indent=2, sort_keys=True)
            f.write("\n")
    return str(out_dir)


def _text_kwargs(vocab_size: int, hidden: int = _HIDDEN) -> dict:
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        hidden_act="silu",
    )


# --------------------------------------------------------------------------- #
# the models


def _qwen2(out_dir: str, seed: int, layer_types: list[str] | None, hidden: int = _HIDDEN) -> str:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = _qwen2_tokenizer(QWEN2_SPECIALS, QWEN2_CHAT_TEMPLATE)
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    vocab_size = _vocab_size(tok)
    hybrid = layer_types is not None
    config = Qwen2Config(
        **_text_kwargs(vocab_size, hidden),
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        use_sliding_window=hybrid,
        sliding_window=4 if hybrid else 32768,
        max_window_layers=_LAYERS if not hybrid else 0,
        layer_types=layer_types,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        dtype="float32",
    )
    config._attn_implementation = "sdpa"
    _seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    _randomize(model, seed, [eot, *range(len(tok), vocab_size)])
    generation = dict(bos_token_id=eot, eos_token_id=[eot], pad_token_id=eot)
    if config.is_encoder_decoder:  # the decoder starts from the padding token, as T5's does
        generation["decoder_start_token_id"] = model.config.decoder_start_token_id = eot
    return _save(model, tok, out_dir, generation)


def build_qwen2(out_dir: str, seed: int = 0) -> str:
    """Qwen2.5 (Qwen2ForCausalLM): 4 layers, hidden 32, 4 heads / 2 kv heads,
    tied embeddings, ``use_sliding_window=False`` (every layer full attention).

    Traps: AutoTokenizer loads the folder as Qwen2Tokenizer whatever
    tokenizer_class says, so the tokenizer is a real byte-level BPE; the layer
    loop slices ``self.layers[: config.num_hidden_layers]`` and indexes
    ``config.layer_types[i]``; vocab_size (448) > len(tokenizer) (387).
    """
    return _qwen2(out_dir, seed, layer_types=None)


def build_qwen2_wide(out_dir: str, seed: int = 0) -> str:
    """The tiny Qwen2 at hidden 64 (intermediate 128, 4 heads of 16 / 2 kv heads): the narrowest whose layers
    bitsandbytes' 4-bit CPU kernel takes on a CPU with AVX512-BF16 (each input width a multiple of its
    64-weight block, each output width of 32). Not one of ``NAMES``: only the saved-quantized tests use it."""
    return _qwen2(out_dir, seed, layer_types=None, hidden=64)


def build_hybrid(out_dir: str, seed: int = 0) -> str:
    """Qwen2 with ``layer_types`` full, sliding, full, sliding and
    ``sliding_window=4``, so any prompt past 4 tokens attends differently in
    the sliding layers than a full-attention model with the same weights.

    Traps: each layer gets the mask for its own ``layer_types[i]`` (shipping
    layer 0's mask to every layer changes the tokens); node caches need
    ``DynamicCache(config=...)``; bumping ``num_hidden_layers`` on the config
    object raises IndexError (``layer_types`` has 4 entries).
    """
    return _qwen2(out_dir, seed, layer_types=["full_attention", "sliding_attention"] * (_LAYERS // 2))


def build_smolvlm(out_dir: str, seed: int = 0) -> str:
    """SmolVLM (SmolVLMForConditionalGeneration, Idefics3 layout): a 2-layer
    SigLIP-style vision tower (image 64, patch 16, hidden 32), pixel-shuffle
    connector (scale 2: 4 tokens per 64x64 tile) and a 4-layer Llama text
    model (hidden 32). The image processor resizes the longest edge to 128 and
    tiles by 64, so an image gives at most 2x2 tiles + the global one.

    Traps: decoder stack at ``model.text_model.layers``; the processor
    (SmolVLMProcessor) refuses to build here (torchvision, num2words), so
    ``<image>`` must be expanded into the row/col tiling prompt by hand, with
    ``image_seq_len`` from processor_config.json; untied lm_head.
    """
    import torch
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    tok = _smolvlm_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in SMOLVLM_SPECIALS[:7]}
    vocab_size = _vocab_size(tok)
    image_size, patch_size, scale_factor = 64, 16, 2
    image_seq_len = ((image_size // patch_size) ** 2) // (scale_factor**2)
    text = dict(
        _text_kwargs(vocab_size),
        model_type="llama",
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=False,
        bos_token_id=ids["<|im_start|>"],
        eos_token_id=ids["<end_of_utterance>"],
        pad_token_id=ids["<|im_end|>"],
    )
    vision = dict(
        hidden_size=_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch_size,
        num_channels=3,
    )
    config = SmolVLMConfig(
        text_config=text,
        vision_config=vision,
        scale_factor=scale_factor,
        image_token_id=ids["<image>"],
        tie_word_embeddings=False,
        pad_token_id=ids["<|im_end|>"],
        dtype="float32",
    )
    config._attn_implementation = "sdpa"
    _seed(seed)
    model = SmolVLMForConditionalGeneration(config).to(torch.float32).eval()
    eos = ids["<end_of_utterance>"]
    _randomize(model, seed, [eos, *range(len(tok), vocab_size)])
    image_processor = SmolVLMImageProcessorPil(
        size={"longest_edge": 2 * image_size},
        max_image_size={"longest_edge": image_size},
        do_image_splitting=True,
    )
    return _save(
        model,
        tok,
        out_dir,
        dict(bos_token_id=ids["<|im_start|>"], eos_token_id=[eos], pad_token_id=ids["<|im_end|>"]),
        image_processor=image_processor,
        extra_files={"processor_config.json": {"image_seq_len": image_seq_len, "processor_class": "SmolVLMProcessor"}},
    )


def build_qwen2_vl(out_dir: str, seed: int = 0) -> str:
    """Qwen2-VL (Qwen2VLForConditionalGeneration): a 2-block vision tower
    (embed 32, patch 14, temporal patch 2, spatial merge 2) and a 4-layer text
    model (hidden 32, head_dim 8, ``mrope_section`` [2, 1, 1]), tied
    embeddings. The image processor keeps 28*28 to 28*28*8 pixels, so an image
    gives 1 to 8 ``<|image_pad|>`` tokens.

    Traps: M-RoPE positions (3 rows, from ``mm_token_type_ids`` and
    ``image_grid_thw``) are resolved on the client, ``rope_deltas`` lives on
    ``model.model``; the vision tower is a second block stack
    (``model.visual.blocks``); Qwen2VLProcessor refuses to build here
    (torchvision), so ``<|image_pad|>`` is expanded by hand by
    ``image_grid_thw.prod() // merge_size**2``.
    """
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = _qwen2_tokenizer(QWEN2_VL_SPECIALS, QWEN2_VL_CHAT_TEMPLATE)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN2_VL_SPECIALS}
    eot = ids["<|endoftext|>"]
    vocab_size = _vocab_size(tok)
    patch_size, merge_size, temporal_patch_size = 14, 2, 2
    text = dict(
        _text_kwargs(vocab_size),
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        use_sliding_window=False,
        sliding_window=32768,
        max_window_layers=_LAYERS,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
    )
    vision = dict(
        depth=2,
        embed_dim=_HIDDEN,
        hidden_size=_HIDDEN,
        num_heads=2,
        mlp_ratio=2,
        in_channels=3,
        patch_size=patch_size,
        spatial_merge_size=merge_size,
        temporal_patch_size=temporal_patch_size,
    )
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
        dtype="float32",
    )
    config._attn_implementation = "sdpa"
    _seed(seed)
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32).eval()
    _randomize(model, seed, [eot, *range(len(tok), vocab_size)])
    factor = patch_size * merge_size
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=factor * factor,
        max_pixels=factor * factor * 8,
        patch_size=patch_size,
        temporal_patch_size=temporal_patch_size,
        merge_size=merge_size,
    )
    return _save(
        model,
        tok,
        out_dir,
        dict(bos_token_id=eot, eos_token_id=[eot], pad_token_id=eot),
        image_processor=image_processor,
    )


def _causal(out_dir: str, seed: int, config_class: str, extra: dict, attention: str = "sdpa",
            auto: str = "AutoModelForCausalLM") -> str:
    """A model of ``config_class`` (decoder-only unless ``auto`` says otherwise) over the Qwen2 tokenizer: the
    shared text sizes (``_text_kwargs``) with ``extra`` on top (a None there drops the setting), untied head,
    float32, ``attention`` (sdpa unless the class has none)."""
    import torch
    import transformers

    tok = _qwen2_tokenizer(QWEN2_SPECIALS, QWEN2_CHAT_TEMPLATE)
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    vocab_size = _vocab_size(tok)
    kwargs = dict(_text_kwargs(vocab_size), tie_word_embeddings=False, bos_token_id=eot, eos_token_id=eot,
                  pad_token_id=eot, dtype="float32")
    kwargs.update(extra)
    config = getattr(transformers, config_class)(**{k: v for k, v in kwargs.items() if v is not None})
    config._attn_implementation = attention
    _seed(seed)
    model = getattr(transformers, auto).from_config(config).to(torch.float32).eval()
    _randomize(model, seed, [eot, *range(len(tok), vocab_size)])
    generation = dict(bos_token_id=eot, eos_token_id=[eot], pad_token_id=eot)
    if config.is_encoder_decoder:  # the decoder starts from the padding token, as T5's does
        generation["decoder_start_token_id"] = model.config.decoder_start_token_id = eot
    return _save(model, tok, out_dir, generation)


def build_mixtral(out_dir: str, seed: int = 0) -> str:
    """Mixtral (MixtralForCausalLM): 4 experts, 2 chosen per token, in every layer.

    Traps: the checkpoint keeps one tensor per expert (``block_sparse_moe.experts.N.w1.weight``) and
    ``from_pretrained`` renames and fuses them into ``mlp.experts.gate_up_proj`` / ``down_proj`` as it
    loads: a node must apply the same conversion to the layers it holds."""
    return _causal(out_dir, seed, "MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2))


def build_qwen2_moe(out_dir: str, seed: int = 0) -> str:
    """Qwen2-MoE (Qwen2MoeForCausalLM): 4 experts of width 32, 2 chosen per token, plus a gated shared
    expert, in every layer; per-expert tensors fused at load, as Mixtral's."""
    return _causal(out_dir, seed, "Qwen2MoeConfig", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False))


def build_qwen3_moe(out_dir: str, seed: int = 0) -> str:
    """Qwen3-MoE (Qwen3MoeForCausalLM): 4 experts of width 32, 2 chosen per token, q/k norms, head_dim 8;
    layer 0 dense (``mlp_only_layers``), so a stack mixes dense and expert layers."""
    return _causal(out_dir, seed, "Qwen3MoeConfig", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
        mlp_only_layers=[0], use_sliding_window=False))


def build_deepseek_v3(out_dir: str, seed: int = 0) -> str:
    """DeepSeek-V3 (DeepseekV3ForCausalLM): multi-head latent attention, layer 0 dense
    (``first_k_dense_replace``), then 4 routed experts (2 chosen, one group) and a shared expert."""
    return _causal(out_dir, seed, "DeepseekV3Config", dict(
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
        first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=24,
        qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4))


def build_falcon(out_dir: str, seed: int = 0) -> str:
    """Falcon (FalconForCausalLM), rotary, parallel attention and MLP.

    Traps: each layer returns ``(hidden_states, attn_weights)`` and the model reads ``outputs[0]`` before it
    calls the next layer, so what stands in for a layer must answer with that tuple."""
    return _causal(out_dir, seed, "FalconConfig", dict(
        new_decoder_architecture=False, multi_query=False, parallel_attn=True, bias=False, alibi=False,
        ffn_hidden_size=64, num_key_value_heads=None, intermediate_size=None, hidden_act=None,
        max_position_embeddings=None))


def build_olmo(out_dir: str, seed: int = 0) -> str:
    """OLMo (OlmoForCausalLM). Traps: its layer norms carry no weights, so a client whose layers, embedding
    and head are all on nodes holds no parameter at all, and ``generate`` reads ``self.device`` from one."""
    return _causal(out_dir, seed, "OlmoConfig", {})


def build_gemma2_capped(out_dir: str, seed: int = 0) -> str:
    """Gemma 2 (Gemma2ForCausalLM) with a tiny final logit soft cap (0.1), eager attention (its class has no sdpa).

    Traps: ``tanh(logits / cap) * cap`` after the head saturates in float32, so many ids tie at exactly +cap
    and greedy decoding's argmax picks the lowest id of the whole row, which is not among the best raw
    candidates: the head's answer must not be a shortlist of raw logits."""
    return _causal(out_dir, seed, "Gemma2Config", dict(
        head_dim=8, final_logit_softcapping=0.1, attn_logit_softcapping=50.0, query_pre_attn_scalar=8,
        hidden_activation="gelu_pytorch_tanh", hidden_act=None, sliding_window=4096), attention="eager")


def build_bloom(out_dir: str, seed: int = 0) -> str:
    """BLOOM (BloomForCausalLM): ALiBi, eager attention (its class has no sdpa).

    Traps: its attention has a ``layer_idx`` but no ``is_causal`` (causal through the mask its model builds);
    each block returns its attention weights beside the hidden state, which the model ignores."""
    return _causal(out_dir, seed, "BloomConfig", dict(
        n_layer=4, n_head=4, num_hidden_layers=None, num_attention_heads=None, num_key_value_heads=None,
        intermediate_size=None, hidden_act=None, max_position_embeddings=None), attention="eager")


def build_t5(out_dir: str, seed: int = 0, tied: bool = True) -> str:
    """T5 (T5ForConditionalGeneration) as T5Config makes it: an encoder and a decoder of 4 blocks each, relative
    position buckets, the head tied to the shared embedding and so fed the decoder's output scaled by
    ``d_model ** -0.5``. ``tied=False``: an untied head fed the decoder's output as it is (flan-T5's layout).

    Traps: each block returns ``(hidden, position bias, cross-attention position bias)``, the stack unpacks the
    three, and only block 0 computes the biases: every later block is handed the ones block 0 returned, so
    what stands in for a skipped block must answer with tensors of that structure (and the nodes must thread
    them from block 0 on). The tied head reads the final norm's output scaled, not rows of it. The encoder runs
    once, without a cache; the decoder with one. Its weights are drawn from ``seed + 5``: with seeds 0-4 this
    tiny model's greedy answer is mostly one token repeated."""
    return _causal(out_dir, seed + 5, "T5Config", dict(
        d_model=_HIDDEN, d_kv=8, d_ff=64, num_layers=_LAYERS, num_decoder_layers=_LAYERS, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, feed_forward_proj="relu",
        dropout_rate=0.0, hidden_size=None, intermediate_size=None, tie_word_embeddings=None if tied else False,
        num_hidden_layers=None, num_attention_heads=None, num_key_value_heads=None, max_position_embeddings=None,
        hidden_act=None), auto="AutoModelForSeq2SeqLM")


def build_t5_untied(out_dir: str, seed: int = 0) -> str:
    """``build_t5`` with an untied head, which reads the final norm's output as it is."""
    return build_t5(out_dir, seed, tied=False)


BUILDERS = {
    "qwen2": build_qwen2,
    "hybrid": build_hybrid,
    "smolvlm": build_smolvlm,
    "qwen2_vl": build_qwen2_vl,
    "mixtral": build_mixtral,
    "qwen2_moe": build_qwen2_moe,
    "qwen3_moe": build_qwen3_moe,
    "deepseek_v3": build_deepseek_v3,
    "falcon": build_falcon,
    "olmo": build_olmo,
    "gemma2_capped": build_gemma2_capped,
    "bloom": build_bloom,
    "t5": build_t5,
    "t5_untied": build_t5_untied,
}


def build(name: str, out_dir: str, seed: int = 0) -> str:
    """Write tiny model ``name`` to ``out_dir`` and return the folder."""
    if name not in BUILDERS:
        raise KeyError(f"no tiny model {name!r}; known: {', '.join(BUILDERS)}")
    return BUILDERS[name](str(out_dir), seed=seed)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (2, 3):
        print("usage: python tests/lm_models.py NAME OUT_DIR [SEED]", file=sys.stderr)
        return 2
    seed = int(argv[2]) if len(argv) == 3 else 0
    print(build(argv[0], argv[1], seed=seed))
    return 0


__all__ = ["NAMES", "BUILDERS", "build", *(f"build_{n}" for n in NAMES)]


if __name__ == "__main__":  # python tests/lm_models.py NAME OUT_DIR
    sys.exit(main())
