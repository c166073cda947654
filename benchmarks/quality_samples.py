"""Seeded samples for the quality benchmark (`benchmarks.quality`) and the real-model tests.

Filler text comes in several styles (`benchmarks.quality_fillers`: templated sentences,
documentation, source code, a table), so that a result is not one kind of text's. Every
sample is a chat prompt rendered with the model's own chat template into token ids, so every
runtime (the sgl-kvc servers, kvpress under transformers) sees exactly the same tokens.

Tasks:
- `passkey`: a 5-digit pass key stated once at a relative depth of the filler; asked at the end.
- `multikey`: several "the code of the <colour> <thing> is NNNN" facts scattered through the
  filler; one of them is asked for.
- `multidoc`: documents of several such facts, one in each slice of the document, every fact asked
  in a sample of its own over the same context (a shared document's questions, one at a time).
- `long-output`: a short prompt that makes the model write at length (`benchmarks.long_generation`);
  scored by fidelity of `max_tokens` greedy tokens to the full cache's, not by an answer.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from benchmarks.quality_fillers import FILLERS, sentence

__all__ = ["CODES_HEAD", "FILLERS", "LONG_OUTPUT_KINDS", "Sample", "code_fact", "code_objects", "code_question",
           "document_samples", "is_correct", "long_output_samples", "multikey_samples", "passkey_samples", "sentence"]

LONG_PIECE_TOKENS = 64
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
    task: str  # passkey | multikey | multidoc | long-output
    prompt_ids: list[int]
    answer: str = ""  # the string a correct output contains (empty for long-output)
    max_tokens: int = 16
    ignore_eos: bool = False
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _render(tok: Tokenizer, user: str) -> list[int]:
    ids = tok.apply_chat_template(
        [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _build(
    tok: Tokenizer, rng: random.Random, target_len: int, head: str, tail: str,
    inserts: list[tuple[float, str]], style: str = "templated", sized_for: str | None = None,
) -> list[int]:
    """Chat prompt `head + filler (with inserts at relative depths) + tail` of about target_len
    tokens, filled in `style`. Piece lengths are measured once, so the filler is sized without
    re-rendering. `sized_for`: the tail the filler is sized for (default `tail`): prompts that
    differ only in their tail then share their context token for token."""
    filler_style = FILLERS[style]
    sep = filler_style.sep
    overhead = len(_render(tok, head + (tail if sized_for is None else sized_for) + sep.join(s for _, s in inserts)))
    budget = max(target_len - overhead, 16)
    filler: list[str] = []
    sizes: list[int] = []
    used, skipped, pieces = 0, 0, filler_style.pieces(rng)
    while used < budget:
        piece = next(pieces)
        n = len(tok.encode(sep + piece, add_special_tokens=False))
        # A long piece (a docstring paragraph, a function) that would overshoot the length by
        # more than half of itself is left out; a sentence or a table row never is.
        if n > LONG_PIECE_TOKENS and filler and used + n - budget > n // 2 and skipped < 1000:
            skipped += 1
            continue
        used += n
        filler.append(piece)
        sizes.append(n)
    for depth, text in sorted(inserts, key=lambda x: x[0], reverse=True):
        # Pieces of about one size (sentences, rows): a depth counts pieces (and the facts
        # already placed); else tokens.
        at = round(depth * len(filler)) if filler_style.even_pieces else _depth_index(sizes, depth)
        filler.insert(at, text)
    return _render(tok, head + sep.join(filler) + tail)


def question_at(tok: Tokenizer, ids: list[int], question: str) -> int | None:
    """Where `question` (the prompt's tail, its leading blank lines left to the context) starts in
    the rendered prompt `ids`, for a run that compresses the context without its question
    (kvpress's query-agnostic setting, `research/kvpress_runner.py`); None if its tokens are not
    found as such."""
    sub = tok.encode(question.lstrip("\n"), add_special_tokens=False)
    for at in range(len(ids) - len(sub), -1, -1):
        if ids[at : at + len(sub)] == sub:
            return at
    return None


def _depth_index(sizes: list[int], depth: float) -> int:
    """The first boundary between pieces of `sizes` tokens at or past `depth` of the tokens."""
    total, run = sum(sizes), 0
    for i, n in enumerate(sizes):
        if run >= depth * total:
            return i
        run += n
    return len(sizes)


def _seed(task: str, style: str) -> str:
    """The templated style keeps the seeds its samples were first drawn with."""
    return task if style == "templated" else f"{task}-{style}"


def _id(task: str, style: str) -> str:
    return task if style == "templated" else f"{task}-{style}"


def passkey_samples(
    tok: Tokenizer, lengths: dict[int, int], depths: list[float], seed: int, style: str = "templated"
) -> list[Sample]:
    """`lengths`: prompt length (tokens) -> samples per depth."""
    out = []
    for length, n in lengths.items():
        for depth in depths:
            for i in range(n):
                rng = random.Random(f"{_seed('passkey', style)}-{seed}-{length}-{depth}-{i}")
                key = str(rng.randrange(10000, 100000))
                needle = f"The pass key is {key}. Remember it. {key} is the pass key."
                tail = "\n\nWhat is the pass key? Answer with the number only."
                ids = _build(
                    tok, rng, length,
                    "There is a pass key hidden in the text below. Find it and remember it.\n\n",
                    tail, [(depth, needle)], style,
                )
                out.append(Sample(
                    id=f"{_id('passkey', style)}-{length}-d{int(depth * 100)}-{i}", task="passkey",
                    prompt_ids=ids, answer=key, max_tokens=16,
                    meta={"length": length, "depth": depth, "style": style,
                          "question_at": question_at(tok, ids, tail)},
                ))  # fmt: skip
    return out


# The multi-key and document tasks: "the code of the <colour> <thing> is NNNN" facts, one asked.
CODES_HEAD = "The text below mentions the codes of several objects. Read it carefully.\n\n"


def code_objects(rng: random.Random, facts: int) -> tuple[list[str], list[int]]:
    """`facts` distinct objects ("<colour> <thing>") and their distinct 4-digit codes."""
    names = rng.sample([f"{c} {t}" for c in COLOURS for t in THINGS], facts)
    return names, rng.sample(range(1000, 10000), facts)


def code_fact(name: str, code: int) -> str:
    return f"The code of the {name} is {code}."


def code_question(name: str) -> str:
    return f"What is the code of the {name}? Answer with the number only."


def multikey_samples(
    tok: Tokenizer, n: int, length: int, facts: int, seed: int, style: str = "templated"
) -> list[Sample]:
    out = []
    for i in range(n):
        rng = random.Random(f"{_seed('multikey', style)}-{seed}-{length}-{i}")
        names, codes = code_objects(rng, facts)
        depths = sorted(rng.uniform(0.05, 0.95) for _ in range(facts))
        inserts = [(d, code_fact(nm, cd)) for d, nm, cd in zip(depths, names, codes)]
        ask = rng.randrange(facts)
        tail = "\n\n" + code_question(names[ask])
        ids = _build(tok, rng, length, CODES_HEAD, tail, inserts, style)
        out.append(Sample(
            id=f"{_id('multikey', style)}-{length}-{i}", task="multikey", prompt_ids=ids,
            answer=str(codes[ask]), max_tokens=16,
            meta={"length": length, "facts": facts, "asked_depth": depths[ask], "style": style,
                  "question_at": question_at(tok, ids, tail)},
        ))  # fmt: skip
    return out


def document_samples(
    tok: Tokenizer, n: int, length: int, facts: int, seed: int, style: str = "templated"
) -> list[Sample]:
    """Documents that each state `facts` codes at depths spread over the whole document, asked one
    at a time: one sample per (document, fact), the same context token for token with only the
    question after it differing, as a shared document's readers ask it."""
    out = []
    for i in range(n):
        rng = random.Random(f"{_seed('multidoc', style)}-{seed}-{length}-{i}")
        names, codes = code_objects(rng, facts)
        # one fact in each of `facts` equal slices of the document, at a random depth inside it
        depths = [(j + 0.1 + 0.8 * rng.random()) / facts for j in range(facts)]
        inserts = [(d, code_fact(nm, cd)) for d, nm, cd in zip(depths, names, codes)]
        tails = ["\n\n" + code_question(nm) for nm in names]
        longest = max(tails, key=lambda t: len(tok.encode(t, add_special_tokens=False)))
        state = rng.getstate()
        for j, tail in enumerate(tails):
            rng.setstate(state)  # the same filler for every question
            ids = _build(tok, rng, length, CODES_HEAD, tail, inserts, style, sized_for=longest)
            out.append(Sample(
                id=f"{_id('multidoc', style)}-{length}-{i}-f{j}", task="multidoc", prompt_ids=ids,
                answer=str(codes[j]), max_tokens=16,
                meta={"length": length, "facts": facts, "asked_depth": depths[j], "style": style,
                      "question_at": question_at(tok, ids, tail), "document": i},
            ))  # fmt: skip
    return out


LIST_TOPICS = [
    "animals and where they live", "kitchen tools and what they are for", "board games and how they are won",
    "trees and their leaves", "musical instruments and their sound", "jobs and what a day of each is like",
    "birds and the songs they sing", "cities and what visitors see there", "sports and their rules",
    "vegetables and how to cook them", "tools in a workshop and how to use them safely",
    "rivers and the countries they cross",
]
HOW_TO = [
    "bake a loaf of bread at home", "build a wooden bookshelf", "plant and keep a vegetable garden",
    "repair a flat bicycle tyre", "plan a week-long hiking trip", "set up a small freshwater aquarium",
    "paint the walls of a room", "start running and train for a first 10 km race",
    "organise a birthday party for twenty children", "make jam from summer fruit",
    "learn to play the guitar in three months", "move house without losing or breaking anything",
]
LONG_OUTPUT_KINDS = ("retell", "list", "steps")
MAX_LONG_OUTPUT_PER_KIND = min(len(LIST_TOPICS), len(HOW_TO))  # beyond it, lists and tasks repeat


def check_per_kind(per_kind: int) -> int:
    """`per_kind` if every long-output prompt it asks for is a distinct one, else ValueError."""
    if not 1 <= per_kind <= MAX_LONG_OUTPUT_PER_KIND:
        raise ValueError(f"per_kind must be 1..{MAX_LONG_OUTPUT_PER_KIND} (distinct prompts), got {per_kind}")
    return per_kind


def long_output_samples(tok: Tokenizer, per_kind: int, max_tokens: int, seed: int) -> list[Sample]:
    """Prompts that make the model write at length (R-KV's regime: a short prompt, a long
    output): retell a ~300-token passage, a long numbered list, a step-by-step explanation.
    Greedy with `ignore_eos`, so every configuration writes `max_tokens` tokens."""
    check_per_kind(per_kind)
    out = []
    for kind in LONG_OUTPUT_KINDS:
        for i in range(per_kind):
            rng = random.Random(f"long-output-{kind}-{seed}-{i}")
            if kind == "retell":
                ids = _build(
                    tok, rng, 300, rng.choice(TOPIC_OPENERS) + "\n\n",
                    "\n\nRetell everything that happened in the text above in your own words, in great "
                    "detail, one event after another, then describe the town and its people.", [],
                )
            elif kind == "list":
                topic = LIST_TOPICS[i % len(LIST_TOPICS)]
                ids = _render(tok, f"Write a numbered list of 200 different {topic}. Give every item "
                                   "its own line with two sentences about it. Do not stop early.")
            else:
                task = HOW_TO[i % len(HOW_TO)]
                ids = _render(tok, f"Explain step by step, in great detail, how to {task}. Number every "
                                   "step, explain each one in a long paragraph, and list what can go "
                                   "wrong at each step and how to fix it.")
            out.append(Sample(
                id=f"long-{kind}-{i}", task="long-output", prompt_ids=ids, max_tokens=max_tokens,
                ignore_eos=True, meta={"kind": kind},
            ))  # fmt: skip
    return out


def is_correct(sample: Sample, text: str) -> bool:
    return bool(sample.answer) and sample.answer in text
