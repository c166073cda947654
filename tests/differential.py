"""The differential suite's requests and comparisons: the same requests to plain SGLang and to
compressing servers, compared field by field (`tests/e2e/test_differential.py`).

A case is one client request, or a short sequence of them (the same prompt twice, for cached
tokens); `send(target, case, kvc)` runs it against a server, optionally with per-request
`kv_compression` settings, and returns every response as JSON (a stream as its list of chunks).

`differences(plain, ours, tol)` walks two responses together and names every field that differs:
keys missing on either side, other types, other list lengths, other values. Numbers compare
within `tol(a, b)`; ids, creation times and latencies are not compared (`VOLATILE`).
`shape_differences` compares what a compressed request must keep of the plain response: the same
fields, of the same types, with lists (tokens, log-probabilities) of the same lengths, the values
free.

Tolerance for log-probabilities (`tolerance`): a request that holds nothing compressed is attended
by the same `scaled_dot_product_attention` call as on plain SGLang where the model's dtype rounds
as SDPA does (bfloat16: `kernels/decode_attention.plain_decode`), so there the values are equal;
in float32 sgl-kvc's batched kernel and SDPA sum in other orders, each to float32 rounding, which
two layers of the model and a log-softmax carry to a few float32 epsilons of the values' scale:
64 epsilons (7.6e-6) of max(1, |value|).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import openai
import requests

from request_mix import openai_client

GENERATE, COMPLETIONS, CHAT, SCORE = "/generate", "/v1/completions", "/v1/chat/completions", "/v1/score"

# What differs between any two responses, even of one server: request ids, timestamps, latencies.
VOLATILE = frozenset({"id", "created", "e2e_latency", "response_sent_to_client_ts", "system_fingerprint"})

FLOAT32_EPS = 2.0**-23


def tolerance(dtype: str) -> Callable[[float, float], float]:
    """How far a number of a compressing server's response may be from plain SGLang's, for a model
    served in `dtype` (see the module's note)."""
    if dtype in ("bfloat16", "float16"):
        return lambda a, b: 0.0
    return lambda a, b: 64 * FLOAT32_EPS * max(1.0, abs(a), abs(b))


@dataclass(frozen=True)
class Case:
    """One request (`body` to `route`), sent `repeat` times in a row; `stream`: as a stream.
    `kvc`: whether per-request settings ride along on a compressing server (not on `/v1/score`,
    which takes none). `greedy`: its answer is greedy (the compressed check compares its first tokens)."""

    name: str
    route: str
    body: dict[str, Any]
    repeat: int = 1
    stream: bool = False
    kvc: bool = True
    greedy: bool = True


@dataclass
class Target:
    """A live server, its OpenAI client and its base URL."""

    url: str
    client: openai.OpenAI = field(repr=False)

    @classmethod
    def at(cls, url: str) -> "Target":
        return cls(url, openai_client(url))


def _with_kvc(case: Case, kvc: dict[str, Any] | None) -> dict[str, Any]:
    body = json.loads(json.dumps(case.body))
    if not kvc or not case.kvc:
        return body
    if case.route == GENERATE:
        body.setdefault("sampling_params", {}).setdefault("custom_params", {})["sgl_kvc"] = kvc
    else:
        body["kv_compression"] = kvc
    return body


def send(target: Target, case: Case, kvc: dict[str, Any] | None = None) -> list[Any]:
    """`case` against `target`: each response as JSON; a stream as the list of its chunks."""
    body = _with_kvc(case, kvc)
    out = []
    for _ in range(case.repeat):
        if case.route in (COMPLETIONS, CHAT):
            create = (target.client.completions.create if case.route == COMPLETIONS
                      else target.client.chat.completions.create)
            extra = {k: v for k, v in body.items() if k not in _OPENAI_ARGS[case.route]}
            args = {k: v for k, v in body.items() if k in _OPENAI_ARGS[case.route]}
            if case.stream:
                out.append([chunk.model_dump() for chunk in create(stream=True, extra_body=extra, **args)])
            else:
                out.append(create(extra_body=extra, **args).model_dump())
        else:
            r = requests.post(target.url + case.route, json=body, timeout=300)
            assert r.status_code == 200, f"{case.name}: {r.status_code} {r.text[:500]}"
            out.append(r.json())
    return out


_COMMON = {"model", "max_tokens", "temperature", "n", "stop", "logit_bias", "seed", "top_p", "stream_options"}
_OPENAI_ARGS = {
    COMPLETIONS: _COMMON | {"prompt", "logprobs", "echo"},
    CHAT: _COMMON | {"messages", "logprobs", "top_logprobs"},
}


def differences(plain: Any, ours: Any, tol: Callable[[float, float], float], path: str = "") -> list[str]:
    """Every field where `ours` differs from `plain` (see the module's note)."""
    if isinstance(plain, dict) and isinstance(ours, dict):
        found = []
        for key in sorted(set(plain) | set(ours), key=str):
            if key in VOLATILE:
                continue
            if key not in ours or key not in plain:
                found.append(f"{path}.{key}: only in {'plain' if key in plain else 'ours'}")
                continue
            found += differences(plain[key], ours[key], tol, f"{path}.{key}")
        return found
    if isinstance(plain, list) and isinstance(ours, list):
        if len(plain) != len(ours):
            return [f"{path}: {len(plain)} items, ours {len(ours)}"]
        return [d for i, (a, b) in enumerate(zip(plain, ours)) for d in differences(a, b, tol, f"{path}[{i}]")]
    numbers = (int, float)
    if isinstance(plain, numbers) and isinstance(ours, numbers) and not isinstance(plain, bool) and not isinstance(ours, bool):
        if isinstance(plain, int) and isinstance(ours, int):
            return [] if plain == ours else [f"{path}: {plain} != {ours}"]
        if math.isfinite(plain) and math.isfinite(ours) and abs(plain - ours) <= tol(plain, ours):
            return []
        return [] if plain == ours else [f"{path}: {plain!r} != {ours!r} (tolerance {tol(plain, ours):.3g})"]
    return [] if plain == ours else [f"{path}: {plain!r} != {ours!r}"]


# Fields SGLang sets to null where there is nothing to say: no stop matched (the answer ran to its
# length), no cached token (a compressed prompt is not inserted into the tree, so a repeat of it
# reuses none).
NULLABLE = frozenset({"matched_stop", "cached_tokens_details"})
# `/generate`'s finish reason: its fields by its type (a stop it matched, or the length it ran to).
FINISH_FIELDS = {"stop": {"type", "matched"}, "length": {"type", "length"}}


def shape_differences(plain: Any, ours: Any, path: str = "") -> list[str]:
    """Where `ours` lacks a field of `plain`, has one more, or one of another type or length
    (values free; a None is a field's type too, but in `NULLABLE` fields)."""
    if isinstance(plain, dict) and isinstance(ours, dict):
        if path.endswith(".finish_reason") and "type" in plain:  # `/generate`: its fields follow its type
            return [] if FINISH_FIELDS.get(ours.get("type")) == set(ours) else [f"{path}: {ours!r}"]
        found = [f"{path}.{k}: only in {'plain' if k in plain else 'ours'}" for k in set(plain) ^ set(ours)]
        return found + [d for k in set(plain) & set(ours) if not (k in NULLABLE and None in (plain[k], ours[k]))
                        for d in shape_differences(plain[k], ours[k], f"{path}.{k}")]
    if isinstance(plain, list) and isinstance(ours, list):
        if len(plain) != len(ours):
            return [f"{path}: {len(plain)} items, ours {len(ours)}"]
        return [d for i, (a, b) in enumerate(zip(plain, ours)) for d in shape_differences(a, b, f"{path}[{i}]")]
    kinds = (type(plain).__name__, type(ours).__name__)
    if kinds[0] != kinds[1] and not all(k in ("int", "float") for k in kinds):
        return [f"{path}: {kinds[0]}, ours {kinds[1]}"]
    return []


def merged_stream(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A stream as what a client assembles of it: per choice its text (content deltas joined), its
    token log-probabilities in order, its role and finish; the chunks' keys; and the usage chunk.
    How SGLang's tokenizer manager groups tokens into chunks follows the timing of its processes,
    so two runs of one server may cut one stream differently; what a client reads of it may not
    differ."""
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    keys = set()
    for chunk in chunks:
        keys.add(tuple(sorted(k for k in chunk if k not in VOLATILE)))
        if chunk.get("usage") is not None:
            usage = chunk["usage"]
        for c in chunk.get("choices") or []:
            got = choices.setdefault(c["index"], {"text": "", "logprobs": [], "role": None, "finish_reason": None,
                                                  "matched_stop": None})
            delta = c.get("delta")
            if delta is not None:
                got["text"] += delta.get("content") or ""
                got["role"] = got["role"] or delta.get("role")
            else:
                got["text"] += c.get("text") or ""
            lp = c.get("logprobs")
            if lp:
                got["logprobs"] += lp.get("content") or lp.get("token_logprobs") or []
            if c.get("finish_reason") is not None:
                got["finish_reason"], got["matched_stop"] = c["finish_reason"], c.get("matched_stop")
    return {"choices": [choices[i] for i in sorted(choices)], "usage": usage, "chunk_keys": sorted(keys)}


def output_tokens(response: Any, route: str) -> list[Any]:
    """The generated tokens of a response's first choice (ids on `/generate`, else token texts)."""
    if route == GENERATE:
        return list(response["output_ids"])
    choice = response["choices"][0]
    lp = choice.get("logprobs") or {}
    if route == CHAT:
        return [t["token"] for t in lp.get("content") or []]
    return list(lp.get("tokens") or [])
