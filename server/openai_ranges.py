"""OpenAI's documented ranges of the chat and completions fields, which SGLang does not check
(`n: 0` failed deep inside with "range() arg 3 must not be zero"; `n: -1`, `logprobs: 1000`,
`best_of: 0` were accepted): the body guard (`server/body_guard.py`) refuses a body outside them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import orjson

from sgl_kvc.request_settings import json_type_name


@dataclass(frozen=True)
class Range:
    """A numeric field's allowed range (OpenAI's API reference; SGLang's where it is stricter
    or the field is SGLang's own). `None` values are always allowed (the field's default)."""

    field: str
    lo: float | None = None
    hi: float | None = None
    integer: bool = False
    lo_open: bool = False  # lo itself is excluded
    also: tuple[float, ...] = ()  # extra allowed values (top_k: -1 means "off")

    def check(self, value: Any) -> str | None:
        if value is None or value in self.also:
            return None
        ok = not (isinstance(value, float) and math.isnan(value))
        if ok and self.lo is not None:
            ok = value > self.lo if self.lo_open else value >= self.lo
        if ok and self.hi is not None:
            ok = value <= self.hi
        return None if ok else self.describe()

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        fmt = (lambda x: str(int(x))) if self.integer else (lambda x: f"{x:g}")
        if self.lo is not None and self.hi is not None:
            if self.lo_open:
                text = f"{kind} greater than {fmt(self.lo)} and at most {fmt(self.hi)}"
            else:
                text = f"{kind} between {fmt(self.lo)} and {fmt(self.hi)}"
        elif self.lo is not None:
            text = f"{kind} {'greater than' if self.lo_open else 'of at least'} {fmt(self.lo)}"
        else:
            text = f"{kind} of at most {fmt(self.hi)}"
        if self.also:
            text += " (or " + ", ".join(fmt(a) for a in self.also) + ")"
        return text


_SAMPLING = (
    Range("n", 1, 128, integer=True),
    Range("temperature", 0, 2),
    # OpenAI allows 0; SGLang's sampler refuses it (later, without naming the field).
    Range("top_p", 0, 1, lo_open=True),
    Range("presence_penalty", -2, 2),
    Range("frequency_penalty", -2, 2),
    # SGLang's own sampling extensions, with the ranges its SamplingParams.verify enforces.
    Range("top_k", 1, None, integer=True, also=(-1,)),
    Range("min_p", 0, 1),
    Range("repetition_penalty", 0, 2, lo_open=True),
    Range("min_tokens", 0, None, integer=True),
)
CHAT_RANGES = _SAMPLING + (
    Range("top_logprobs", 0, 20, integer=True),
    Range("max_tokens", 1, None, integer=True),
    Range("max_completion_tokens", 1, None, integer=True),
)
COMPLETION_RANGES = _SAMPLING + (
    Range("logprobs", 0, 5, integer=True),
    Range("best_of", 1, 20, integer=True),
    Range("max_tokens", 1, None, integer=True),
)
LOGIT_BIAS_RANGE = Range("logit_bias", -100, 100)


def shown(value: Any) -> str:
    try:
        return orjson.dumps(value).decode()[:100]
    except TypeError:
        return json_type_name(value)


def check_ranges(fields: dict[str, Any], ranges: tuple[Range, ...], best_of: bool = False) -> tuple[str, str] | None:
    """(message, field) of the first field outside its range, or None; `fields` are the values
    after SGLang's pydantic model parsed them (so "2" already is 2). `best_of`: the completions
    route, where `best_of` must be at least `n`."""
    for r in ranges:
        value = fields.get(r.field)
        problem = r.check(value)
        if problem:
            return f"Invalid '{r.field}': expected {problem}, but got {shown(value)} instead.", r.field
    bias = fields.get("logit_bias")
    if isinstance(bias, dict):
        for key, value in bias.items():
            param = f"logit_bias.{key}"
            try:
                int(key)
            except ValueError:
                # SGLang would fail with Python's "invalid literal for int() with base 10".
                return (f"Invalid 'logit_bias': its keys must be token ids (integers as strings), "
                        f"got {shown(key)}."), param
            problem = LOGIT_BIAS_RANGE.check(value)
            if problem:
                return f"Invalid '{param}': expected {problem}, but got {shown(value)} instead.", param
    if best_of:
        value, n = fields.get("best_of"), fields.get("n") or 1
        if value is not None and value < n:
            return f"Invalid 'best_of': it must be at least 'n' ({n}), got {value}.", "best_of"
    return None
