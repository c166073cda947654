"""Filler styles for the quality benchmark's prompts: what fills a long prompt around its facts.

A policy that keeps a pass key in one kind of text may lose it in another (the attention a
needle draws depends on how unlike its surroundings it is), so every task is built in several
styles a user's long prompts look like:

- `templated`: sentences from templates and word lists (a diary of small events);
- `docs`: technical documentation, the docstrings of Python's standard library;
- `code`: source code, functions of Python's standard library;
- `table`: a plain-text table of generated records (one row per line).

`docs` and `code` are read at run time from the Python that runs the benchmark (nothing of them
is stored here); their order is shuffled by the sample's seed, so prompts are reproducible for
one Python version.
"""

from __future__ import annotations

import importlib
import inspect
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache

DOC_MODULES = (
    "argparse", "asyncio.tasks", "bisect", "calendar", "collections", "concurrent.futures",
    "configparser", "contextlib", "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message",
    "fractions", "functools", "gzip", "hashlib", "heapq", "http.client", "ipaddress", "itertools",
    "json", "logging", "mimetypes", "pathlib", "pickle", "queue", "random", "re", "sched", "shlex",
    "shutil", "smtplib", "socket", "statistics", "string", "subprocess", "tarfile", "tempfile",
    "textwrap", "threading", "timeit", "unittest.case", "urllib.parse", "uuid", "zipfile",
)  # fmt: skip
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
MAX_PIECE_CHARS = 1500  # a piece is a paragraph or a function: one long one would fill a prompt


@dataclass(frozen=True)
class Filler:
    """A style: `pieces(rng)` yields text pieces forever, joined with `sep`; `even_pieces`: all
    of about one size (a fact's depth can count pieces rather than tokens)."""

    name: str
    sep: str
    pieces: Callable[[random.Random], Iterator[str]]
    even_pieces: bool = False


def sentence(rng: random.Random) -> str:
    parts = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS), rng.choice(PLACES)]
    if rng.random() < 0.7:
        parts.append(rng.choice(TIMES))
    if rng.random() < 0.5:
        parts.append(rng.choice(CLAUSES))
    return " ".join(parts) + "."


def _templated(rng: random.Random) -> Iterator[str]:
    while True:
        yield sentence(rng)


def _public(module: object) -> Iterator[object]:
    """The module's own public functions and classes."""
    for name, obj in sorted(vars(module).items()):
        if (not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
                and getattr(obj, "__module__", None) == module.__name__):
            yield obj


@lru_cache(maxsize=1)
def _doc_pieces() -> tuple[str, ...]:
    out = []
    for mod_name in DOC_MODULES:
        module = importlib.import_module(mod_name)
        for obj in (module, *_public(module)):
            doc = inspect.getdoc(obj) or ""
            out += [p.strip() for p in doc.split("\n\n") if 80 <= len(p.strip()) <= MAX_PIECE_CHARS]
    return tuple(dict.fromkeys(out))


@lru_cache(maxsize=1)
def _code_pieces() -> tuple[str, ...]:
    out = []
    for mod_name in DOC_MODULES:
        module = importlib.import_module(mod_name)
        for obj in _public(module):
            if not inspect.isfunction(obj):
                continue
            try:
                src = inspect.getsource(obj)
            except (OSError, TypeError):
                continue
            if 200 <= len(src) <= MAX_PIECE_CHARS:
                out.append(src.rstrip())
    return tuple(dict.fromkeys(out))


def _shuffled(pool: Callable[[], tuple[str, ...]]) -> Callable[[random.Random], Iterator[str]]:
    def pieces(rng: random.Random) -> Iterator[str]:
        items = list(pool())
        while True:
            rng.shuffle(items)
            yield from items

    return pieces


FIRST_NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jun", "Kofi",
               "Lena", "Mateo", "Nia", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tomas", "Uma", "Vik"]
CITIES = ["Lisbon", "Osaka", "Lagos", "Denver", "Tallinn", "Quito", "Perth", "Bergen", "Pune", "Cork",
          "Leeds", "Porto", "Hanoi", "Malmo", "Split", "Tartu", "Graz", "Ghent"]
ITEMS = ["valve", "bracket", "sensor", "hinge", "gasket", "relay", "pump", "filter", "spring", "cable",
         "bearing", "switch", "nozzle", "clamp", "fuse", "gear"]
STATUSES = ["shipped", "pending", "returned", "on hold", "delivered", "cancelled"]


def _table(rng: random.Random) -> Iterator[str]:
    yield "order | customer | city | item | quantity | unit price | status"
    order = rng.randrange(10000, 90000)
    while True:
        order += rng.randrange(1, 9)
        yield (f"{order} | {rng.choice(FIRST_NAMES)} | {rng.choice(CITIES)} | {rng.choice(ITEMS)} | "
               f"{rng.randrange(1, 500)} | {rng.randrange(1, 999)}.{rng.randrange(100):02d} | "
               f"{rng.choice(STATUSES)}")  # fmt: skip


FILLERS: dict[str, Filler] = {
    f.name: f
    for f in (
        Filler("templated", " ", _templated, even_pieces=True),
        Filler("docs", "\n\n", _shuffled(_doc_pieces)),
        Filler("code", "\n\n", _shuffled(_code_pieces)),
        Filler("table", "\n", _table, even_pieces=True),
    )
}
STYLES = tuple(FILLERS)
