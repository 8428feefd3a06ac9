"""Word-level tokenizers built in memory, so tiny pipelines need no model hub.

Each kind follows the special-token layout of the real tokenizer family that a
pipeline expects (see FACTS-diffusers.md): T5 appends ``</s>``; CLIP wraps the
text in ``<|startoftext|> ... <|endoftext|>``; Llama and Gemma prepend a bos
token; Qwen adds nothing and knows ``<|im_start|>``/``<|im_end|>`` (and a newline
token, so QwenImage's chat template is 34 tokens long before the prompt, as with
the real tokenizer: the pipeline drops exactly that many).

>>> tok = build_word_tokenizer("t5")
>>> tok.convert_ids_to_tokens(tok("dance monkey").input_ids)
['dance', 'monkey', '</s>']
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["KINDS", "DEFAULT_WORDS", "build_word_tokenizer"]

# Every word of the prompts the tests and the default run use, plus the words of
# QwenImage's prompt template; anything else maps to the unknown token.
DEFAULT_WORDS: tuple[str, ...] = tuple(
    """
    a an the of and or in on at to with by for from is are was be it this that
    painting photo picture image video sound music drawing sketch render scene
    squirrel eating burger monkey dance dancing cat dog bird fish horse cow
    hammer hitting wooden surface wood metal glass stone water fire sky sea
    tree forest mountain river city street house room garden field beach
    red green blue yellow black white orange purple pink brown gray grey gold
    bright dark light small big large tiny huge old new young happy sad
    beautiful ugly bad good quality low high blurry sharp noisy clean clear
    deformed distorted cartoon realistic detailed simple style art artist
    man woman child people person face hand eye eyes hair smile
    sun moon star stars cloud clouds rain snow wind night day morning evening
    running walking flying swimming jumping sitting standing sleeping playing
    car boat train plane road bridge tower castle
    describe detailing color shape size texture quantity text spatial
    relationships objects background system user assistant
    cinematic slow motion camera close up wide shot view
    one two three four five many some very
    , . : ; ! ? ' " - ( )
    """.split()
)

KINDS = ("t5", "clip", "llama", "gemma", "qwen")

# Special tokens first, at the ids the kind's real tokenizer uses where that is
# small; the roles name which of them the transformers wrapper should know.
_LAYOUTS: dict[str, dict] = {
    "t5": dict(
        specials=["<pad>", "</s>", "<unk>"],
        roles=dict(pad_token="<pad>", eos_token="</s>", unk_token="<unk>"),
        single="$A </s>",
        pair="$A </s> $B </s>",
        max_length=512,
    ),
    "clip": dict(
        # Real CLIP pads with <|endoftext|>; pipelines pad to model_max_length.
        specials=["<|startoftext|>", "<|endoftext|>", "<unk>"],
        roles=dict(
            bos_token="<|startoftext|>",
            eos_token="<|endoftext|>",
            pad_token="<|endoftext|>",
            unk_token="<unk>",
        ),
        single="<|startoftext|> $A <|endoftext|>",
        pair="<|startoftext|> $A <|endoftext|> $B <|endoftext|>",
        max_length=77,
    ),
    "llama": dict(
        specials=["<unk>", "<s>", "</s>", "<pad>"],
        roles=dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"),
        single="<s> $A",
        pair="<s> $A <s> $B",
        max_length=512,
    ),
    "gemma": dict(
        specials=["<pad>", "<eos>", "<bos>", "<unk>"],
        roles=dict(bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>"),
        single="<bos> $A",
        pair="<bos> $A <bos> $B",
        max_length=512,
    ),
    "qwen": dict(
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"],
        roles=dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>"),
        single=None,
        pair=None,
        max_length=32768,
        newline_token=True,
    ),
}


def build_word_tokenizer(
    kind: str,
    vocab_words: Sequence[str] = DEFAULT_WORDS,
    model_max_length: int | None = None,
):
    """A ``PreTrainedTokenizerFast`` over ``vocab_words`` (NFKC, lower-cased, split
    on whitespace and punctuation) with ``kind``'s special tokens and layout.

    ``model_max_length`` defaults to the kind's usual value (77 for CLIP, which
    pipelines pad to). The vocabulary is the special tokens, then the words in
    order, so ids are stable; size the text encoder with ``len(tokenizer)``.
    """
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if kind not in _LAYOUTS:
        raise ValueError(f"unknown tokenizer kind {kind!r}; expected one of {', '.join(KINDS)}")
    layout = _LAYOUTS[kind]
    vocab: dict[str, int] = {}
    for token in [*layout["specials"], *(["\n"] if layout.get("newline_token") else []), *vocab_words]:
        vocab.setdefault(token if token in layout["specials"] or token == "\n" else token.lower(), len(vocab))

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=layout["roles"]["unk_token"]))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])  # full-width "ｒｅｄ" is "red"
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # Special tokens are matched on the raw text, before normalization and splitting.
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in layout["specials"]])
    if layout.get("newline_token"):
        tok.add_tokens([AddedToken("\n", special=False, normalized=False)])
    if layout["single"] is not None:
        used = {t for t in layout["single"].split() + layout["pair"].split() if not t.startswith("$")}
        tok.post_processor = processors.TemplateProcessing(
            single=layout["single"],
            pair=layout["pair"],
            special_tokens=[(t, vocab[t]) for t in sorted(used)],
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=model_max_length or layout["max_length"],
        padding_side="right",
        **layout["roles"],
    )
