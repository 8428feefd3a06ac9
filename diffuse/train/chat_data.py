"""The dialogues tiny-qwen-chat learns from, and its tokenizer and chat template.

Every dialogue is made here, seeded, and has one right answer that a program can
check: adding and subtracting numbers below 100, reversing and sorting a few
words, counting the letters of a word, and a small fixed table of facts
(capitals, colours of things), plus greetings and a fixed reply to messages it
cannot read. A held-out set is fixed by a hash of each dialogue's key (the two
numbers of a sum, the word list, the made-up word, the fact and the phrasing), so
training never sees a held-out dialogue and evaluation sees nothing else.

The tokenizer is a byte-level BPE (Qwen2's normalizer and pre-tokenizer, which
``Qwen2Tokenizer`` rebuilds from code when a qwen2 folder loads) trained on the
words below: each of them is one token, digits are single tokens (Qwen's split
regex cuts numbers into digits), and any other text still tokenizes, into
smaller pieces down to single bytes.
"""

from __future__ import annotations

import functools

import hashlib
import json
import random
from dataclasses import dataclass

HELD_OUT_PERCENT = 10  # of the keys of every task with many keys (sums, word lists, made-up words)
FACT_HELD_OUT_PERCENT = 20  # of the (fact, phrasing) pairs; every fact keeps some phrasings in training

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen's chat format, without a default system turn; content may be a string or a list of text parts
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

WORDS = tuple("""
    apple banana cat dog egg fish goat hat ink jam kite lamp moon nest owl pear queen rose sun tree
    van wolf box yak zoo bird cake door frog gift house iron juice king lion milk nose pig ring star
    train vase cup bell corn duck fox horse leaf mouse pen sock toy whale
""".split())

CAPITALS = (
    ("france", "paris"), ("germany", "berlin"), ("italy", "rome"), ("spain", "madrid"), ("japan", "tokyo"),
    ("china", "beijing"), ("egypt", "cairo"), ("kenya", "nairobi"), ("peru", "lima"), ("chile", "santiago"),
    ("canada", "ottawa"), ("russia", "moscow"), ("greece", "athens"), ("norway", "oslo"), ("sweden", "stockholm"),
    ("finland", "helsinki"), ("poland", "warsaw"), ("austria", "vienna"), ("portugal", "lisbon"),
    ("ireland", "dublin"), ("cuba", "havana"), ("brazil", "brasilia"), ("australia", "canberra"),
    ("thailand", "bangkok"), ("vietnam", "hanoi"), ("turkey", "ankara"), ("iran", "tehran"),
    ("hungary", "budapest"), ("denmark", "copenhagen"), ("belgium", "brussels"), ("netherlands", "amsterdam"),
    ("switzerland", "bern"), ("ukraine", "kyiv"), ("morocco", "rabat"), ("ghana", "accra"), ("nigeria", "abuja"),
    ("colombia", "bogota"), ("venezuela", "caracas"), ("ecuador", "quito"), ("philippines", "manila"),
    ("indonesia", "jakarta"), ("iceland", "reykjavik"),
)

COLOURS = (
    ("the sky", "blue"), ("grass", "green"), ("snow", "white"), ("coal", "black"), ("a banana", "yellow"),
    ("a tomato", "red"), ("a lemon", "yellow"), ("milk", "white"), ("the sea", "blue"), ("a strawberry", "red"),
    ("a cherry", "red"), ("chocolate", "brown"), ("soil", "brown"), ("a carrot", "orange"), ("a pumpkin", "orange"),
    ("a grape", "purple"), ("a plum", "purple"), ("a lime", "green"), ("a flamingo", "pink"), ("salt", "white"),
    ("a crow", "black"), ("a leaf", "green"), ("the sun", "yellow"), ("a frog", "green"), ("an orange", "orange"),
    ("blood", "red"), ("a polar bear", "white"), ("an elephant", "grey"), ("ash", "grey"), ("a pig", "pink"),
)

TEMPLATES = {
    "add": ("what is {a} plus {b}?", "what is {a} + {b}?", "{a} + {b} = ?", "add {a} and {b}.",
            "how much is {a} plus {b}?", "compute {a} + {b}", "what do you get if you add {a} and {b}?"),
    "subtract": ("what is {a} minus {b}?", "what is {a} - {b}?", "{a} - {b} = ?", "subtract {b} from {a}.",
                 "how much is {a} minus {b}?", "compute {a} - {b}", "take {b} away from {a}."),
    "reverse": ("reverse these words: {w}", "reverse the order of these words: {w}", "say these words backwards: {w}",
                "reverse: {w}", "please reverse the words {w}"),
    "sort": ("sort these words: {w}", "put these words in alphabetical order: {w}", "sort alphabetically: {w}",
             "sort: {w}", "please sort the words {w}"),
    "letters": ("how many letters are in {w}?", "how many letters does {w} have?", "count the letters in {w}.",
                "how long is the word {w}?", "how many letters are in the word {w}?"),
    "capital": ("what is the capital of {c}?", "what's the capital of {c}?", "tell me the capital of {c}.",
                "name the capital city of {c}.", "which city is the capital of {c}?", "capital of {c}?"),
    "country": ("{x} is the capital of which country?", "which country has {x} as its capital?",
                "of which country is {x} the capital?", "where is {x}?"),
    "colour": ("what colour is {t}?", "what color is {t}?", "tell me the colour of {t}.", "which colour is {t}?",
               "what is the color of {t}?", "{t} is what colour?"),
}
ANSWERS = {
    "add": "{a} + {b} = {r}.",
    "subtract": "{a} - {b} = {r}.",
    "letters": "It has {n} letters.",
    "capital": "The capital of {C} is {X}.",
    "country": "{X} is the capital of {C}.",
    "colour": "{T} is {k}.",
}
GREETINGS = {
    "hello! how can i help?": ("hi", "hello", "hey", "hello there", "hi there", "good morning", "good evening"),
    "i can add and subtract numbers, reverse and sort words, count letters, and tell you capitals and colours.": (
        "who are you?", "what can you do?", "help", "what do you know?", "how can you help me?"),
    "you are welcome!": ("thanks", "thank you", "thank you very much", "thanks a lot"),
}
UNKNOWN_ANSWER = "Sorry, I do not understand."
SYSTEM_PROMPTS = ("You are a helpful assistant.", "you are a helpful assistant", "Answer briefly.")

# the tasks evaluate reports, each with the kinds of dialogue it covers
TASKS = ("add", "subtract", "reverse", "sort", "letters", "capitals", "colours", "unknown")
# how often each kind is drawn in training
MIX = {"add": 22, "subtract": 26, "reverse": 12, "sort": 11, "letters": 8, "capital": 4, "country": 8,
       "colour": 4, "greeting": 2, "unknown": 2}
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _proper(s: str) -> str:
    return " ".join(_cap(w) for w in s.split())


def held_out(key: tuple, percent: int = HELD_OUT_PERCENT) -> bool:
    """Whether the dialogue with this key belongs to the held-out set (a fixed hash, not the seed)."""
    digest = hashlib.sha256(json.dumps(key).encode()).digest()
    return int.from_bytes(digest[:4], "little") % 100 < percent


def _made_up(rng: random.Random) -> str:
    """A word of 3-9 random letters that is none of the known words."""
    while True:
        w = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 9)))
        if w not in _known_words():
            return w


@functools.cache
def _known_words() -> frozenset:
    return frozenset(corpus_words())


@dataclass
class Turn:
    user: str
    answer: str
    task: str  # one of TASKS, or "greeting"
    key: tuple


def make_turn(kind: str, rng: random.Random, want_held_out: bool = False) -> Turn:
    """One question and its answer of the given kind, its key held out or not as asked."""
    for _ in range(10000):
        turn = _draw(kind, rng)
        if turn.key[0] == "greeting" or held_out(turn.key, _percent(turn.key)) == want_held_out:
            if turn.key[0] == "greeting" and want_held_out:
                raise ValueError("greetings have no held-out dialogues")
            return turn
    raise RuntimeError(f"no {'held-out' if want_held_out else 'training'} dialogue of kind {kind}")


def _percent(key: tuple) -> int:
    return FACT_HELD_OUT_PERCENT if key[0] in ("capital", "country", "colour") else HELD_OUT_PERCENT


def _casing(rng: random.Random, text: str) -> str:
    return _cap(text) if rng.random() < 0.5 else text


def _draw(kind: str, rng: random.Random) -> Turn:
    if kind in ("add", "subtract"):
        a = rng.randint(0, 99)
        b = rng.randint(0, 99) if kind == "add" else rng.randint(0, a)
        t = rng.randrange(len(TEMPLATES[kind]))
        r = a + b if kind == "add" else a - b
        return Turn(_casing(rng, TEMPLATES[kind][t].format(a=a, b=b)), ANSWERS[kind].format(a=a, b=b, r=r),
                    kind, (kind, a, b))
    if kind in ("reverse", "sort"):
        words = rng.sample(WORDS, rng.randint(2, 6))
        t = rng.randrange(len(TEMPLATES[kind]))
        sep = ", " if rng.random() < 0.3 else " "
        answer = list(reversed(words)) if kind == "reverse" else sorted(words)
        return Turn(_casing(rng, TEMPLATES[kind][t].format(w=sep.join(words))), " ".join(answer), kind,
                    (kind, *words))
    if kind == "letters":
        t = rng.randrange(len(TEMPLATES[kind]))
        if rng.random() < 0.25:  # a known word: its length is learned with it; kept in training in some phrasings
            w = rng.choice(WORDS)
            key = ("letters", w, t)
        else:
            w = _made_up(rng)
            key = ("letters", w)
        return Turn(_casing(rng, TEMPLATES[kind][t].format(w=w)), ANSWERS[kind].format(n=len(w), w=w), "letters", key)
    if kind in ("capital", "country"):
        i = rng.randrange(len(CAPITALS))
        c, x = CAPITALS[i]
        t = rng.randrange(len(TEMPLATES[kind]))
        cq, xq = (_proper(c), _proper(x)) if rng.random() < 0.6 else (c, x)
        q = TEMPLATES[kind][t].format(c=cq, x=xq)
        return Turn(_casing(rng, q), ANSWERS[kind].format(C=_proper(c), X=_proper(x)), "capitals", (kind, c, t))
    if kind == "colour":
        i = rng.randrange(len(COLOURS))
        thing, colour = COLOURS[i]
        t = rng.randrange(len(TEMPLATES[kind]))
        return Turn(_casing(rng, TEMPLATES[kind][t].format(t=thing)), ANSWERS[kind].format(T=_cap(thing), k=colour),
                    "colours", (kind, thing, t))
    if kind == "greeting":
        answer = rng.choice(sorted(GREETINGS))
        q = rng.choice(GREETINGS[answer])
        q = rng.choice((q, _cap(q), q + "!" if not q.endswith("?") else q))
        return Turn(q, _cap(answer), "greeting", ("greeting",))
    if kind == "unknown":
        return _unknown(rng)
    raise ValueError(f"unknown kind {kind!r}")


_ODD = "éèüßñçøåæ£€¥§©®µ¿¡«»日本語中文한국어привет안녕ÀÉÎÕÜ😀🚀✨→∑∞"


def _unknown(rng: random.Random) -> Turn:
    """Made-up words, odd characters and known words mixed so they ask nothing the model knows."""
    parts = []
    for _ in range(rng.randint(1, 6)):
        r = rng.random()
        if r < 0.5:
            parts.append(_made_up(rng))
        elif r < 0.75:
            parts.append("".join(rng.choice(_ODD) for _ in range(rng.randint(1, 4))))
        else:
            parts.append(rng.choice(WORDS))
    if all(p in WORDS for p in parts):
        parts.append(_made_up(rng))
    text = " ".join(parts) + rng.choice(("", "?", ".", "!"))
    return Turn(_casing(rng, text), UNKNOWN_ANSWER, "unknown", ("unknown", text))


KIND_OF_TASK = {"add": ("add",), "subtract": ("subtract",), "reverse": ("reverse",), "sort": ("sort",),
                "letters": ("letters",), "capitals": ("capital", "country"), "colours": ("colour",),
                "unknown": ("unknown",)}


def training_dialogue(rng: random.Random) -> list[dict]:
    """Messages of one training conversation: mostly one turn, sometimes two or three, sometimes with a system
    prompt first."""
    kinds, weights = zip(*MIX.items())
    turns = 1 if rng.random() < 0.9 else rng.randint(2, 3)
    messages = []
    if rng.random() < 0.05:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for _ in range(turns):
        turn = make_turn(rng.choices(kinds, weights)[0], rng)
        messages += [{"role": "user", "content": turn.user}, {"role": "assistant", "content": turn.answer}]
    return messages


def held_out_turns(task: str, n: int, seed: int = 1) -> list[Turn]:
    """``n`` held-out dialogues of one task (distinct keys where there are enough), the same for the same seed."""
    rng = random.Random(f"held-out {task} {seed}")
    kinds = KIND_OF_TASK[task]
    seen, out = set(), []
    for _ in range(n * 200):
        if len(out) == n:
            break
        turn = make_turn(kinds[len(out) % len(kinds)], rng, want_held_out=True)
        if turn.key in seen and task not in ("unknown",):
            continue
        seen.add(turn.key)
        out.append(turn)
    return out


def check_facts_trained() -> None:
    """Every fact keeps at least one phrasing in training (else no held-out phrasing of it could be answered)."""
    for kind, items in (("capital", CAPITALS), ("country", CAPITALS), ("colour", COLOURS)):
        for item in items:
            keys = [(kind, item[0], t) for t in range(len(TEMPLATES[kind]))]
            if all(held_out(k, FACT_HELD_OUT_PERCENT) for k in keys):
                raise AssertionError(f"every phrasing of {kind} {item[0]} is held out")


# ---- tokenizer ---------------------------------------------------------------


def corpus_words() -> list[str]:
    """Every word of every template, answer, fact and word list, as typed (lower case) and capitalised."""
    text = [*WORDS, *(w for pair in CAPITALS for w in pair), *(w for pair in COLOURS for w in pair),
            *(t for ts in TEMPLATES.values() for t in ts), *ANSWERS.values(), UNKNOWN_ANSWER, *SYSTEM_PROMPTS,
            *GREETINGS, *(q for qs in GREETINGS.values() for q in qs), "user assistant system letters"]
    words = []
    for line in text:
        for w in line.replace("{", " ").replace("}", " ").split():
            w = "".join(ch for ch in w if ch.isalpha() or ch == "'")
            if w and w.isascii():
                words += [w.lower(), _cap(w.lower())]
    return sorted(set(words))


def build_tokenizer():
    """A ``Qwen2Tokenizer`` over a byte-level BPE trained here on ``corpus_words()`` (each word with and without a
    space in front) and the arithmetic signs after a space, the chat template set; ``<|endoftext|>`` pads, ``<|im_end|>`` ends each turn."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=100000, min_frequency=1, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = [form for w in corpus_words() for form in (w, " " + w)] + ["'s", " +", " -", " ="]
    bpe.train_from_iterator(lines, trainer)
    model = json.loads(bpe.to_str())["model"]
    tok = Qwen2Tokenizer(vocab=dict(model["vocab"]), merges=[tuple(m) for m in model["merges"]],
                         unk_token=None, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": SPECIALS[1:]})
    tok.chat_template = CHAT_TEMPLATE
    tok.model_max_length = 512
    return tok
