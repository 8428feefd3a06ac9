"""The dialogues tiny-qwen-chat learns from, and its tokenizer and chat template.

Every dialogue is made here, seeded, and has one right answer that a program can
check: what a newcomer types first. Sums and differences of whole numbers from 0
to 20, asked in digits or in words (``what's seven minus four?``) and always
answered in one form (``7 - 4 = 3.``); the capitals of well-known countries, both
ways; greetings, ``who are you?``, ``what can you do?``, thanks and goodbye, each
with a fixed reply; and a fixed reply to text it cannot read.

A held-out set is fixed by a hash of each dialogue's key, not by the seed: for
sums and differences the number pair alone (such a pair is never trained, in any
phrasing) or the pair with its phrasing and number form; for capitals the fact
with its phrasing; for greetings the combination of phrasing, lead-in and end
mark; for unreadable text the text itself. Training never sees a held-out
dialogue and evaluation sees nothing else.

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

HELD_OUT_PERCENT = 10  # of the number pairs, and again of the (pair, phrasing, number form) combinations
PHRASING_HELD_OUT_PERCENT = 20  # of the (fact, phrasing) and greeting (phrasing, lead-in, end mark) combinations
MAX_OPERAND = 20

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

NUMBER_WORDS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
                "sixteen seventeen eighteen nineteen twenty").split()

# (country, capital) as written in an answer; a question may write them so or in lower case
CAPITALS = (
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Portugal", "Lisbon"),
    ("the United Kingdom", "London"), ("Ireland", "Dublin"), ("the United States", "Washington"),
    ("Canada", "Ottawa"), ("Mexico", "Mexico City"), ("Brazil", "Brasilia"), ("Argentina", "Buenos Aires"),
    ("Peru", "Lima"), ("Chile", "Santiago"), ("Japan", "Tokyo"), ("China", "Beijing"), ("India", "New Delhi"),
    ("South Korea", "Seoul"), ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"), ("Indonesia", "Jakarta"),
    ("the Philippines", "Manila"), ("Australia", "Canberra"), ("New Zealand", "Wellington"), ("Russia", "Moscow"),
    ("Ukraine", "Kyiv"), ("Poland", "Warsaw"), ("Austria", "Vienna"), ("Switzerland", "Bern"),
    ("the Netherlands", "Amsterdam"), ("Belgium", "Brussels"), ("Greece", "Athens"), ("Turkey", "Ankara"),
    ("Egypt", "Cairo"), ("Kenya", "Nairobi"), ("Nigeria", "Abuja"), ("Norway", "Oslo"), ("Sweden", "Stockholm"),
    ("Denmark", "Copenhagen"), ("Finland", "Helsinki"), ("Iran", "Tehran"), ("Saudi Arabia", "Riyadh"),
)

TEMPLATES = {
    "add": ("what is {a} plus {b}?", "what's {a} plus {b}?", "what is {a} + {b}?", "{a} + {b} = ?", "{a} + {b}",
            "{a} plus {b}", "add {a} and {b}.", "how much is {a} plus {b}?", "compute {a} + {b}",
            "what do you get if you add {a} and {b}?", "what is the sum of {a} and {b}?", "{a} plus {b} is?"),
    "subtract": ("what is {a} minus {b}?", "what's {a} minus {b}?", "what is {a} - {b}?", "{a} - {b} = ?",
                 "{a} - {b}", "{a} minus {b}", "subtract {b} from {a}.", "how much is {a} minus {b}?",
                 "compute {a} - {b}", "take {b} away from {a}.", "what is {a} take away {b}?", "{a} minus {b} is?"),
    "capital": ("what is the capital of {c}?", "what's the capital of {c}?", "tell me the capital of {c}.",
                "name the capital city of {c}.", "which city is the capital of {c}?", "capital of {c}?",
                "what is the capital city of {c}?", "do you know the capital of {c}?"),
    "country": ("{x} is the capital of which country?", "which country has {x} as its capital?",
                "of which country is {x} the capital?", "{x} is the capital of what country?",
                "what country is {x} the capital of?", "which country is {x} the capital of?"),
}
ANSWERS = {
    "add": "{a} + {b} = {r}.",
    "subtract": "{a} - {b} = {r}.",
    "capital": "The capital of {C} is {X}.",
    "country": "{X} is the capital of {C}.",
}
# fixed reply -> the phrasings that ask for it, without their end mark; the questions end in "?" or nothing
GREETINGS = {
    "Hello! How can I help?": ("hi", "hello", "hey", "hello there", "hi there", "hey there", "good morning",
                               "good afternoon", "good evening", "greetings"),
    "I am tiny-qwen-chat, a small model that Diffuse runs split across machines.": (
        "who are you?", "what are you?", "what is your name?", "what's your name?", "tell me about yourself",
        "introduce yourself", "who am i talking to?"),
    "I can add and subtract numbers up to 20 and tell you the capitals of countries.": (
        "what can you do?", "what do you know?", "help", "how can you help me?", "what can i ask you?",
        "what are you good at?"),
    "I am fine, thank you. How can I help?": ("how are you?", "how are you doing?", "how's it going?"),
    "You are welcome!": ("thanks", "thank you", "thank you very much", "thanks a lot", "many thanks", "cheers"),
    "Goodbye!": ("bye", "goodbye", "see you", "bye bye", "see you later"),
}
LEAD_INS = ("", "hi, ", "hello, ", "hey, ", "ok, ", "so ")  # before any greeting but a hello
UNKNOWN_ANSWER = "Sorry, I do not understand."
SYSTEM_PROMPTS = ("You are a helpful assistant.", "you are a helpful assistant", "Answer briefly.")
NOUNS = tuple("cat dog egg fish tree sun moon star house car book door bird lamp cup hat".split())  # in unreadable text

# the tasks evaluate reports, each with the kinds of dialogue it covers
TASKS = ("add", "subtract", "capitals", "greetings", "unknown")
KIND_OF_TASK = {"add": ("add",), "subtract": ("subtract",), "capitals": ("capital", "country"),
                "greetings": ("greeting",), "unknown": ("unknown",)}
# how often each kind is drawn in training
MIX = {"add": 30, "subtract": 30, "capital": 13, "country": 13, "greeting": 9, "unknown": 5}
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def held_out(key: tuple, percent: int = HELD_OUT_PERCENT) -> bool:
    """Whether the dialogue with this key belongs to the held-out set (a fixed hash, not the seed)."""
    digest = hashlib.sha256(json.dumps(key).encode()).digest()
    return int.from_bytes(digest[:4], "little") % 100 < percent


def is_held_out(key: tuple) -> bool:
    """A dialogue's key held out: a sum's or difference's number pair, or its whole key; any other key whole."""
    if key[0] in ("add", "subtract"):
        return held_out(key[:3]) or held_out(key)
    if key[0] in ("capital", "country", "greeting"):
        return held_out(key, PHRASING_HELD_OUT_PERCENT)
    return held_out(key)


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
    task: str  # one of TASKS
    key: tuple


def make_turn(kind: str, rng: random.Random, want_held_out: bool = False) -> Turn:
    """One question and its answer of the given kind, its key held out or not as asked."""
    for _ in range(10000):
        turn = _draw(kind, rng)
        if is_held_out(turn.key) == want_held_out:
            return turn
    raise RuntimeError(f"no {'held-out' if want_held_out else 'training'} dialogue of kind {kind}")


def _casing(rng: random.Random, text: str) -> str:
    return _cap(text) if rng.random() < 0.5 else text


def _number(n: int, form: int) -> str:
    return NUMBER_WORDS[n] if form else str(n)


def _draw(kind: str, rng: random.Random) -> Turn:
    if kind in ("add", "subtract"):
        a = rng.randint(0, MAX_OPERAND)
        b = rng.randint(0, MAX_OPERAND) if kind == "add" else rng.randint(0, a)
        t, form = rng.randrange(len(TEMPLATES[kind])), rng.randrange(2)  # form: 0 digits, 1 words
        r = a + b if kind == "add" else a - b
        q = TEMPLATES[kind][t].format(a=_number(a, form), b=_number(b, form))
        return Turn(_casing(rng, q), ANSWERS[kind].format(a=a, b=b, r=r), kind, (kind, a, b, t, form))
    if kind in ("capital", "country"):
        c, x = CAPITALS[rng.randrange(len(CAPITALS))]
        t = rng.randrange(len(TEMPLATES[kind]))
        cq, xq = (c, x) if rng.random() < 0.6 else (c.lower(), x.lower())
        q = TEMPLATES[kind][t].format(c=cq, x=xq)
        return Turn(_casing(rng, q), ANSWERS[kind].format(C=c, X=x), "capitals", (kind, c, t))
    if kind == "greeting":
        answers = list(GREETINGS)
        i = rng.randrange(len(answers))
        p = rng.randrange(len(GREETINGS[answers[i]]))
        phrasing = GREETINGS[answers[i]][p]
        ends = ("?", "") if phrasing.endswith("?") else ("", "!", ".")
        lead = rng.randrange(len(LEAD_INS)) if i else 0  # no "hi, hello"
        end = rng.randrange(len(ends))
        q = LEAD_INS[lead] + phrasing.rstrip("?") + ends[end]
        return Turn(_casing(rng, q), answers[i], "greetings", ("greeting", i, p, lead, end))
    if kind == "unknown":
        return _unknown(rng)
    raise ValueError(f"unknown kind {kind!r}")


_ODD = "éèüßñçøåæ£€¥§©®µ¿¡«»日本語中文한국어привет안녕ÀÉÎÕÜ😀🚀✨→∑∞"


def _unknown(rng: random.Random) -> Turn:
    """Made-up words, odd characters and a few plain nouns mixed so they ask nothing the model knows."""
    parts = []
    for _ in range(rng.randint(1, 6)):
        r = rng.random()
        if r < 0.5:
            parts.append(_made_up(rng))
        elif r < 0.75:
            parts.append("".join(rng.choice(_ODD) for _ in range(rng.randint(1, 4))))
        else:
            parts.append(rng.choice(NOUNS))
    if all(p in NOUNS for p in parts):
        parts.append(_made_up(rng))
    text = " ".join(parts) + rng.choice(("", "?", ".", "!"))
    return Turn(_casing(rng, text), UNKNOWN_ANSWER, "unknown", ("unknown", text))


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
    """``n`` held-out dialogues of one task (distinct keys where there are enough), the same for the same seed;
    the first ``k`` of them are the ``k`` asked for with a smaller ``n``."""
    rng = random.Random(f"held-out {task} {seed}")
    kinds = KIND_OF_TASK[task]
    seen, out = set(), []
    for _ in range(n * 200):
        if len(out) == n:
            break
        turn = make_turn(kinds[len(out) % len(kinds)], rng, want_held_out=True)
        if turn.key in seen:
            continue
        seen.add(turn.key)
        out.append(turn)
    return out


def check_facts_trained() -> None:
    """Every fact keeps at least one phrasing in training, and every greeting phrasing one combination (else no
    held-out dialogue of it could be answered)."""
    for kind in ("capital", "country"):
        for c, _ in CAPITALS:
            if all(is_held_out((kind, c, t)) for t in range(len(TEMPLATES[kind]))):
                raise AssertionError(f"every phrasing of {kind} {c} is held out")
    for i, (answer, phrasings) in enumerate(GREETINGS.items()):
        for p in range(len(phrasings)):
            combos = [("greeting", i, p, lead, end) for lead in range(len(LEAD_INS) if i else 1) for end in range(3)]
            if all(is_held_out(k) for k in combos):
                raise AssertionError(f"every combination of greeting {phrasings[p]!r} is held out")


# ---- tokenizer ---------------------------------------------------------------


def corpus_words() -> list[str]:
    """Every word of every template, answer, fact and greeting, as typed (lower case) and capitalised."""
    text = [*NUMBER_WORDS, *NOUNS, *(w for pair in CAPITALS for w in pair),
            *(t for ts in TEMPLATES.values() for t in ts), *ANSWERS.values(), UNKNOWN_ANSWER, *SYSTEM_PROMPTS,
            *GREETINGS, *(q for qs in GREETINGS.values() for q in qs), *LEAD_INS, "user assistant system"]
    words = []
    for line in text:
        for w in line.replace("{", " ").replace("}", " ").replace("-", " ").split():
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
