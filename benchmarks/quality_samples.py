"""Seeded samples for the quality benchmark (`benchmarks.quality`) and the real-model tests.

Filler text is built from sentence templates and word lists, so no two sentences in a prompt
need be the same (a repeated sentence is easy to compress away and says little about a policy).
Every sample is a chat prompt rendered with the model's own chat template into token ids, so
every runtime (the sgl-kvc servers, kvpress under transformers) sees exactly the same tokens.

Tasks:
- `passkey`: a 5-digit pass key stated once at a relative depth of the filler; asked at the end.
- `multikey`: several "the code of the <colour> <thing> is NNNN" facts scattered through the
  filler; one of them is asked for.
- `longgen`: a passage of filler and a request to retell it at length; scored by fidelity of
  `max_tokens` greedy tokens to the full cache's, not by an answer.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

SUBJECTS = [
    "The old miller", "A young teacher", "The harbour master", "Our neighbour", "The baker's son",
    "A travelling musician", "The village doctor", "Her grandmother", "The tired postman",
    "A curious child", "The museum guard", "An elderly farmer", "The ship's cook", "A quiet student",
    "The town mayor", "A retired pilot", "The night nurse", "Two fishermen", "The gardener",
    "A street painter", "The librarian", "His cousin", "The blacksmith", "A group of hikers",
]
VERBS = [
    "repaired", "painted", "carried", "described", "forgot", "found", "sold", "borrowed", "cleaned",
    "measured", "photographed", "admired", "weighed", "hid", "delivered", "sketched", "examined",
    "wrapped", "counted", "polished", "moved", "returned", "ordered", "inspected",
]
OBJECTS = [
    "a wooden cart", "the broken clock", "an old map", "a basket of apples", "the red umbrella",
    "a heavy iron kettle", "the brass telescope", "a pile of letters", "the blue bicycle",
    "a jar of honey", "the stone statue", "a box of candles", "the silver spoon", "a winter coat",
    "the garden gate", "a bundle of firewood", "the kitchen table", "a small sailboat",
    "the church bell", "a leather satchel", "the oak cabinet", "a roll of canvas", "the copper pot",
]
PLACES = [
    "near the harbour", "behind the mill", "in the market square", "at the train station",
    "beside the river", "on the hill above the town", "in the school yard", "under the old bridge",
    "at the edge of the forest", "in the bakery", "on the pier", "by the lighthouse",
    "in the narrow lane", "outside the library", "at the crossroads", "in the orchard",
]
TIMES = [
    "before sunrise", "late in the evening", "on a rainy Tuesday", "after the long winter",
    "during the festival", "in the middle of the night", "one windy afternoon", "at noon",
    "the day before the wedding", "while the bells were ringing", "early in spring",
    "just after lunch", "on the first day of autumn", "as the fog lifted",
]
CLAUSES = [
    "and nobody noticed", "because it was needed", "although it was raining", "as everyone watched",
    "while humming a song", "without saying a word", "and then went home", "for the third time",
    "to everyone's surprise", "as the sun went down", "with great care", "in a hurry",
]
COLOURS = ["red", "blue", "green", "yellow", "purple", "orange", "white", "black", "grey", "pink"]
THINGS = ["door", "box", "lamp", "chair", "boat", "book", "key", "vase", "clock", "bag", "drum", "kite"]
TOPIC_OPENERS = [
    "This is a record of ordinary days in a small coastal town.",
    "The following notes were written by a visitor to a quiet village.",
    "What follows is a diary of small events, kept for a year.",
]


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def apply_chat_template(self, conversation: list[dict[str, str]], **kw: Any) -> Any: ...


@dataclass
class Sample:
    """One prompt as token ids plus what scores it."""

    id: str
    task: str  # passkey | multikey | longgen
    prompt_ids: list[int]
    answer: str = ""  # the string a correct output contains (empty for longgen)
    max_tokens: int = 16
    ignore_eos: bool = False
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def sentence(rng: random.Random) -> str:
    parts = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS), rng.choice(PLACES)]
    if rng.random() < 0.7:
        parts.append(rng.choice(TIMES))
    if rng.random() < 0.5:
        parts.append(rng.choice(CLAUSES))
    return " ".join(parts) + "."


def _render(tok: Tokenizer, user: str) -> list[int]:
    ids = tok.apply_chat_template(
        [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _build(
    tok: Tokenizer, rng: random.Random, target_len: int, head: str, tail: str,
    inserts: list[tuple[float, str]],
) -> list[int]:
    """Chat prompt `head + filler (with inserts at relative depths) + tail` of about target_len
    tokens. Sentence lengths are measured once, so the filler is sized without re-rendering."""
    overhead = len(_render(tok, head + tail + " ".join(s for _, s in inserts)))
    budget = max(target_len - overhead, 16)
    filler: list[str] = []
    used = 0
    while used < budget:
        s = sentence(rng)
        used += len(tok.encode(" " + s, add_special_tokens=False))
        filler.append(s)
    for depth, text in sorted(inserts, key=lambda x: x[0], reverse=True):
        filler.insert(round(depth * len(filler)), text)
    return _render(tok, head + " ".join(filler) + tail)


def passkey_samples(
    tok: Tokenizer, lengths: dict[int, int], depths: list[float], seed: int
) -> list[Sample]:
    """`lengths`: prompt length (tokens) -> samples per depth."""
    out = []
    for length, n in lengths.items():
        for depth in depths:
            for i in range(n):
                rng = random.Random(f"passkey-{seed}-{length}-{depth}-{i}")
                key = str(rng.randrange(10000, 100000))
                needle = f"The pass key is {key}. Remember it. {key} is the pass key."
                ids = _build(
                    tok, rng, length,
                    "There is a pass key hidden in the text below. Find it and remember it.\n\n",
                    "\n\nWhat is the pass key? Answer with the number only.",
                    [(depth, needle)],
                )
                out.append(Sample(
                    id=f"passkey-{length}-d{int(depth * 100)}-{i}", task="passkey", prompt_ids=ids,
                    answer=key, max_tokens=16,
                    meta={"length": length, "depth": depth},
                ))  # fmt: skip
    return out


def multikey_samples(
    tok: Tokenizer, n: int, length: int, facts: int, seed: int
) -> list[Sample]:
    out = []
    for i in range(n):
        rng = random.Random(f"multikey-{seed}-{length}-{i}")
        names = rng.sample([f"{c} {t}" for c in COLOURS for t in THINGS], facts)
        codes = rng.sample(range(1000, 10000), facts)
        depths = sorted(rng.uniform(0.05, 0.95) for _ in range(facts))
        inserts = [(d, f"The code of the {nm} is {cd}.") for d, nm, cd in zip(depths, names, codes)]
        ask = rng.randrange(facts)
        ids = _build(
            tok, rng, length,
            "The text below mentions the codes of several objects. Read it carefully.\n\n",
            f"\n\nWhat is the code of the {names[ask]}? Answer with the number only.",
            inserts,
        )
        out.append(Sample(
            id=f"multikey-{length}-{i}", task="multikey", prompt_ids=ids, answer=str(codes[ask]),
            max_tokens=16, meta={"length": length, "facts": facts, "asked_depth": depths[ask]},
        ))  # fmt: skip
    return out


def longgen_samples(tok: Tokenizer, n: int, length: int, max_tokens: int, seed: int) -> list[Sample]:
    out = []
    for i in range(n):
        rng = random.Random(f"longgen-{seed}-{length}-{i}")
        ids = _build(
            tok, rng, length, rng.choice(TOPIC_OPENERS) + "\n\n",
            "\n\nRetell everything that happened in the text above in your own words, in great "
            "detail, one event after another, then describe the town and its people.",
            [],
        )
        out.append(Sample(
            id=f"longgen-{length}-{i}", task="longgen", prompt_ids=ids, max_tokens=max_tokens,
            ignore_eos=True, meta={"length": length},
        ))  # fmt: skip
    return out


def is_correct(sample: Sample, text: str) -> bool:
    return bool(sample.answer) and sample.answer in text
