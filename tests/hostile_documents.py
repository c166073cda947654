"""The hostile-client suite for shared documents and KVzip: seeded random bursts of everything a
client controls about them, mixed with the request-mix fuzz test's ordinary tenants
(`tests/request_mix.py`), sent at once to a live server.

What a burst sends, beside the ordinary mix (each request drawn at random, by seed):
- `extra_key` and `cache_salt` in sgl-kvc's reserved document namespace (`sgl-kvc/document/...`,
  also one prompt of a `/generate` batch) and values near it (no slash, other case, a leading
  space, a look-alike slash), with and without a document;
- `lora_path` (one value, a batch's list, empty) and the `model` name's `base:adapter` form on a
  server without LoRA;
- prompt log-probabilities on documents (often resident): `/generate` `return_logprob` with
  `logprob_start_len` at 0, inside, at and past the document's end, at and past the prompt's end,
  -1 and below; `/v1/completions` `echo` with `logprobs`;
- `n` of 2 and 3, `max_tokens` 0 and 1 (`max_new_tokens` 0 on `/generate`), stop strings;
- clients that hang up, streamed or not, while a new document of several chunks is compressed and
  while other requests wait for it;
- document budgets of 1, `budget` at and past the document's tokens, ratios near 0 (down to the
  smallest double) and near 1, at 0 and 1, documents of one token, at the prompt policy's floor
  and just above, documents that end where the prompt does, prompts at the context length
  (SGLang's longest input, and past it), prompt policies that cannot compress a document;
- chat documents named by messages: text content parts, `messages` at the edges (0, 1, all but
  the last, all, past it, not an integer), a conversation of one message;
- documents that extend a resident one (a conversation's next turns, each conversation with one of
  the prompt policies a document may name): one token more up to past a chunk, branches at once,
  budgets that leave the chain no room, another namespace, prompt log-probabilities, `n`, clients
  hanging up while a turn is published.

What must hold after every burst: the server is alive; idle, its pool is whole (the servers run
with `SGLKVC_CHECK=1`, which stops a server at a violation), no request state is left and
sgl-kvc failed no request; another tenant's fixed greedy requests (one plain, one starting from
its own document) give the tokens they gave on the quiet server before the first burst; every
served request got the tokens (and prompt log-probabilities) it asked for; every refusal is an
OpenAI-style 4xx (`{"error": {"message", "type", "param", "code"}}`) whose `param` names the field
the case expects, never a 5xx and never an error inside a 200 stream. A failure names the seed and
the request that reproduce it (`pytest --fuzz-seed S --fuzz-bursts 1`).
"""

from __future__ import annotations

import http.client
import json
import math
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Callable
from urllib.parse import urlsplit

import requests

from kvc_reference import assert_pool_whole, launcher_argv
from request_mix import WORDS, make_mix, openai_client
from request_mix import problems as mix_problems
from request_mix import send as mix_send
from sgl_kvc.request_settings import MAX_BUDGET

GENERATE, COMPLETIONS, CHAT = "/generate", "/v1/completions", "/v1/chat/completions"
NAMESPACE = "sgl-kvc/document/"  # sgl_kvc.adapter.documents.NAMESPACE, written out: the client's view
RESERVED = (NAMESPACE, NAMESPACE + "0" * 64, NAMESPACE + "/x", NAMESPACE + " ")
NEAR = ("", "tenant-a", "sgl-kvc/document", "sgl-kvc/documents/a", " sgl-kvc/document/a", "SGL-KVC/DOCUMENT/a",
        "sgl-kvc\\document\\a", "sgl-kvc/document\u2215a", "sgl-kvc/doc")
QUESTION = 12  # tokens after a document
# a long answer's tokens: past what its row holds before R-KV compacts it (its document's entries,
# its budget of the floor + 2 and the servers' --kv-buffer of 128, after its question)
REPLY = 150
# decode policies a reply may be compacted by (each keeps what it keeps: the reply's key says which)
REPLY_POLICIES = ("rkv", "h2o", "snapkv", "kvcompress", "streamingllm")
# the prompt policies a document may name (`Policy.question_free`)
DOCUMENT_POLICIES = ("kvzip", "keydiff", "streamingllm")


@dataclass(frozen=True)
class Target:
    """What the suite needs to know of the server it attacks."""

    model: str
    floor: int  # entries a document always keeps (its prompt policy's sinks and window, + 1)
    max_prompt: int  # the longest prompt SGLang takes (its `max_req_input_len` - 1)
    long: int  # a document of several chunks, compressed while its clients hang up


@dataclass(frozen=True)
class Hostile:
    """One request of the hostile part of a burst, and what the server must answer."""

    what: str  # the edge it sends
    path: str
    body: dict
    refuse: str | None = None  # the field a refusal must name
    served: bool | None = True  # True: a 200; False: a 4xx naming `refuse`; None: either
    hang_up: float | None = None  # the client closes its connection after this many seconds
    tokens: int | None = None  # completion tokens each choice gets (fewer only when its stop string ends it)
    prompt_logprobs: int | None = None  # prompt tokens it gets log-probabilities of
    # the requests sent after its answer (a conversation's next turns), from that answer
    then: Callable[[Any], list["Hostile"]] | None = None

    def describe(self) -> str:
        body = json.dumps(self.body)
        return f"{self.what}: POST {self.path} {body[:600]}{'...' if len(body) > 600 else ''}"


def document_floor_of(flags: list[str]) -> int:
    """The entries a document always keeps on a server started with `flags` (as its launcher
    parses them)."""
    from sgl_kvc.launcher.cli import parse_args
    from sgl_kvc.request_settings import document_floor

    return document_floor(parse_args(launcher_argv(flags))[0])


def document_field(path: str, name: str = "") -> str:
    """`kv_compression.document(.name)` as the route's client knows it."""
    base = "sampling_params.custom_params.sgl_kvc.document" if path == GENERATE else "kv_compression.document"
    return base + (f".{name}" if name else "")


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(n)]


def _body(t: Target, path: str, prompt: list[int], max_tokens: int, kv: dict | None = None,
          sampling: dict | None = None, **extra: Any) -> dict:
    """A greedy request for `prompt` (token ids) that ignores EOS, with `kv_compression` `kv`."""
    if path == GENERATE:
        sp = {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **(sampling or {})}
        if kv is not None:
            sp["custom_params"] = {"sgl_kvc": kv}
        return {"input_ids": prompt, "sampling_params": sp, **extra}
    body = {"model": t.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            **(sampling or {}), **extra}
    if kv is not None:
        body["kv_compression"] = kv
    return body


def _route(rng: random.Random, chat: bool = False) -> str:
    return rng.choice([GENERATE, COMPLETIONS, CHAT] if chat else [GENERATE, COMPLETIONS])


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _chat(t: Target, messages: list[dict], max_tokens: int, kv: dict | None, **extra: Any) -> dict:
    body = {"model": t.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, **extra}
    if kv is not None:
        body["kv_compression"] = kv
    return body


def _content(rng: random.Random, text: str) -> Any:
    """A message's content: the text, or a list of text parts (SGLang joins them with " ")."""
    if rng.random() < 0.5:
        return text
    words = text.split(" ")
    cuts = sorted(rng.sample(range(1, len(words)), min(len(words) - 1, rng.randint(1, 3)))) if len(words) > 1 else []
    bounds = [0, *cuts, len(words)]
    return [{"type": "text", "text": " ".join(words[a:b])} for a, b in zip(bounds, bounds[1:])]


# ------------------------------------------------------------------------------------ the cases
# Each draws one edge (a list of requests for the cases that need several) over the burst's shared
# documents (`docs`: token lists, so that requests of a burst, and of later bursts, publish, wait
# for and hit the same ones).


def _namespace(rng: random.Random, t: Target, docs: list[list[int]]) -> list[Hostile]:
    path, name = _route(rng), rng.choice(["extra_key", "cache_salt"])
    doc = rng.choice(docs)
    kv = {"prompt_policy": "kvzip", "document": {"tokens": len(doc), "ratio": 0.3}} if rng.random() < 0.6 else None
    prompt = doc + _tokens(rng, QUESTION)
    if path == GENERATE and rng.random() < 0.3:  # one prompt of a batch in the namespace
        body = {"input_ids": [prompt, _tokens(rng, 20)], name: [rng.choice(NEAR), rng.choice(RESERVED)],
                "sampling_params": {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True}}
        return [Hostile(f"{name}[1] reserved", path, body, f"{name}[1]", served=False)]
    if path == GENERATE and rng.random() < 0.15:  # a list for a single prompt
        body = _body(t, path, prompt, 2, kv, **{name: [rng.choice(NEAR)]})
        return [Hostile(f"{name} a list", path, body, name, served=False)]
    if rng.random() < 0.5:
        value = rng.choice(RESERVED)
        return [Hostile(f"{name} reserved", path, _body(t, path, prompt, 2, kv, **{name: value}), name, served=False)]
    value = rng.choice(NEAR)
    return [Hostile(f"{name} near the namespace", path, _body(t, path, prompt, 3, kv, **{name: value}), tokens=3)]


def _lora(rng: random.Random, t: Target, docs: list[list[int]]) -> list[Hostile]:
    path = _route(rng, chat=True)
    doc = rng.choice(docs)
    kv = {"prompt_policy": "kvzip", "document": {"tokens": len(doc)}} if path != CHAT else None
    prompt = doc + _tokens(rng, QUESTION)
    build = (lambda **kw: _chat(t, [{"role": "user", "content": _text(rng, 30)}], 2, None, **kw)) if path == CHAT \
        else (lambda **kw: _body(t, path, prompt, 2, kv, **kw))
    kind = rng.choice(["lora_path", "lora_path", "empty", "model", "batch"])
    if kind == "empty":  # no adapter: served
        return [Hostile("lora_path empty", path, build(lora_path=""), tokens=2)]
    if kind == "model" and path != GENERATE:
        return [Hostile("model base:adapter", path, build(model=f"{t.model}:adapter-x"), "model", served=False)]
    if kind == "batch" and path == GENERATE:
        body = {"input_ids": [prompt, _tokens(rng, 20)], "lora_path": [None, "adapter-x"],
                "sampling_params": {"max_new_tokens": 2}}
        return [Hostile("lora_path[1]", path, body, "lora_path[1]", served=False)]
    return [Hostile("lora_path", path, build(lora_path="adapter-x"), "lora_path", served=False)]


def _prompt_logprobs(rng: random.Random, t: Target, docs: list[list[int]]) -> list[Hostile]:
    doc = rng.choice(docs)
    prompt = doc + _tokens(rng, QUESTION)
    p, d = len(prompt), len(doc)
    kv = {"prompt_policy": rng.choice(["kvzip", "kvzip", "keydiff", "streamingllm"]),
          "document": {"tokens": d, "ratio": 0.3}}
    if rng.random() < 0.35:  # /v1/completions: echo the prompt with its log-probabilities
        n = rng.choice([1, 2])
        return [Hostile("echo logprobs", COMPLETIONS, _body(t, COMPLETIONS, prompt, n, kv, echo=True, logprobs=1),
                        tokens=n, prompt_logprobs=p)]
    start = rng.choice([0, 1, d - 1, d, d + 1, p - 1, p, -1, -2, -7, p + 1])
    new = rng.choice([0, 1, 2])
    body = _body(t, GENERATE, prompt, new, kv, return_logprob=True, logprob_start_len=start)
    if start < -1 or start > p:
        return [Hostile(f"logprob_start_len {start} of {p}", GENERATE, body, "logprob_start_len", served=False)]
    return [Hostile(f"logprob_start_len {start} of {p} (document {d})", GENERATE, body, tokens=new,
                    prompt_logprobs=0 if start == -1 else p - start)]


def _samples(rng: random.Random, t: Target, docs: list[list[int]]) -> list[Hostile]:
    path, doc, n = _route(rng), rng.choice(docs), rng.choice([2, 3])
    kv = {"prompt_policy": "kvzip", "document": {"tokens": len(doc), "ratio": rng.choice([0.3, 0.5])}}
    new = rng.choice([1, 2, 5])
    temperature = rng.choice([0.0, 0.8])
    prompt = doc + _tokens(rng, QUESTION)
    if path == GENERATE:
        body = _body(t, path, prompt, new, kv, sampling={"n": n, "temperature": temperature})
    else:
        body = _body(t, path, prompt, new, kv, n=n, temperature=temperature)
    return [Hostile(f"n={n}", path, body, tokens=new)]


def _max_tokens(rng: random.Random, t: Target, docs: list[list[int]]) -> list[Hostile]:
    path, doc = _route(rng), rng.choice(docs)
    kv = {"prompt_policy": "kvzip", "document": {"tokens": len(doc)}}
    prompt = doc + _tokens(rng, QUESTION)
    new = rng.choice([0, 1])
    if path == GENERATE:
        return [Hostile(f"max_new_tokens {new}", path, _body(t, path, prompt, new, kv), tokens=new)]
    if new == 0:
        return [Hostile("max_tokens 0", path, _body(t, path, prompt, 0, kv), "max_tokens", served=False)]
    return [Hostile("max_tokens 1", path, _body(t, path, prompt, 1, kv), tokens=1)]


def _stop(rng: random.Random, t: Target, docs: list[list[int]]) -> list[Hostile]:
    path, doc = _route(rng), rng.choice(docs)
    kv = {"prompt_policy": "kvzip", "document": {"tokens": len(doc), "budget": rng.choice([1, 8])}}
    stop = rng.sample(["a", "e", " ", "the", "\n", "s", "</s>"], rng.randint(1, 3))
    prompt = doc + _tokens(rng, QUESTION)
    sampling = {"stop": stop}
    return [Hostile(f"stop {stop}", path, _body(t, path, prompt, 16, kv, sampling=sampling), tokens=16)]


def _hang_ups(rng: random.Random, t: Target, docs: list[list[int]]) -> list[Hostile]:
    """A new document of several chunks, asked for by several clients at once: whichever is
    admitted first compresses it while the others wait for it, and some of them hang up meanwhile
    (a few milliseconds in: a streamed `/generate` answers its headers at once, and SGLang aborts
    it as soon as its client is gone; the OpenAI routes and unstreamed requests wait for the
    first result, and SGLang notices the client gone within 4 s); one reads its answer to the end.
    (On the demo model a document of 600 tokens takes about 0.15 s to compress on a 2-core CPU.)"""
    doc = _tokens(rng, t.long)
    kv = {"prompt_policy": "kvzip", "document": {"tokens": len(doc), "ratio": 0.2}}
    out = []
    for i in range(4):
        path = GENERATE if i < 2 else _route(rng)
        stream = i < 2 or rng.random() < 0.5
        body = _body(t, path, doc + _tokens(rng, QUESTION), 4, kv, stream=stream)
        if i < 3:
            out.append(Hostile(f"hangs up {'a stream ' if stream else ''}while the document is compressed", path,
                               body, hang_up=rng.uniform(0.005, 0.2)))
        else:
            out.append(Hostile("waits for a document whose other clients hung up", path,
                               {**body, "stream": False}, tokens=4))
    return out


def _budgets(rng: random.Random, t: Target, docs: list[list[int]]) -> list[Hostile]:
    path, doc = _route(rng), rng.choice(docs)
    d = len(doc)
    spec = rng.choice([{"budget": 1}, {"budget": d - 1}, {"budget": d}, {"budget": MAX_BUDGET},
                       {"ratio": 1e-9}, {"ratio": 5e-324}, {"ratio": 0.999999}, {"ratio": 1 - 2 ** -52},
                       {"ratio": 0}, {"ratio": 1}, {"budget": 0}, {"ratio": 0.5, "budget": 4}])
    own = {"budget": 1} if rng.random() < 0.3 else {}  # the request's own budget, beyond its document
    kv = {"prompt_policy": rng.choice(DOCUMENT_POLICIES), **own, "document": {"tokens": d, **spec}}
    body = _body(t, path, doc + _tokens(rng, QUESTION), 2, kv)
    what = f"document {spec} of {d} tokens"
    ratio, budget = spec.get("ratio"), spec.get("budget")
    if "ratio" in spec and "budget" in spec or ratio is not None and not 0 < ratio < 1:
        return [Hostile(what, path, body, document_field(path, "ratio"), served=False)]
    if budget == 0:
        return [Hostile(what, path, body, document_field(path, "budget"), served=False)]
    refused = _nothing_to_compress(t, d, spec)
    if refused:
        return [Hostile(what, path, body, document_field(path, refused), served=False)]
    return [Hostile(what, path, body, tokens=2)]


def _nothing_to_compress(t: Target, d: int, spec: dict) -> str | None:
    """The field a document of `d` tokens compressed to `spec` is refused for, keeping all its
    tokens (`DocumentSpec.entries`: never fewer than the floor), or None."""
    if t.floor >= d:
        return "tokens"
    budget, ratio = spec.get("budget"), spec.get("ratio", 0.3)
    entries = max(t.floor, budget if budget is not None else math.ceil(ratio * d))
    if entries < d:
        return None
    return "budget" if budget is not None else "ratio"


def _document_tokens(rng: random.Random, t: Target, docs: list[list[int]]) -> list[Hostile]:
    path = _route(rng)
    doc = rng.choice(docs)
    prompt = doc + _tokens(rng, rng.choice([1, QUESTION]))
    p = len(prompt)
    d = rng.choice([1, t.floor, t.floor + 1, p - 1, p, p + 1, 0, -1, True, "5", 2.0, MAX_BUDGET + 1, None])
    kv = {"prompt_policy": "kvzip", "document": {"tokens": d, "budget": 1}}
    if d is None:
        kv["document"] = {"budget": 1}  # tokens missing
    body = _body(t, path, prompt, 2, kv)
    what = f"document of {d!r} tokens in a prompt of {p}"
    if not isinstance(d, int) or isinstance(d, bool) or not 1 <= d <= MAX_BUDGET or d >= p:
        return [Hostile(what, path, body, document_field(path, "tokens"), served=False)]
    refused = _nothing_to_compress(t, d, {"budget": 1})
    if refused:
        return [Hostile(what, path, body, document_field(path, refused), served=False)]
    return [Hostile(what, path, body, tokens=2)]


def _context(rng: random.Random, t: Target, docs: list[list[int]]) -> list[Hostile]:
    """Documents in prompts at SGLang's longest input, and just past it."""
    p = rng.choice([t.max_prompt, t.max_prompt, t.max_prompt - 1, t.max_prompt + 1])
    d = p - rng.choice([1, 2, QUESTION])
    prompt = _tokens(rng, p)
    path = _route(rng)
    new = rng.choice([1, 2, 4])
    kv = {"prompt_policy": rng.choice(["kvzip", "streamingllm"]), "document": {"tokens": d, "ratio": 0.3}}
    body = _body(t, path, prompt, new, kv)
    what = f"document of {d} tokens in a prompt of {p} (the longest: {t.max_prompt})"
    if p > t.max_prompt:
        return [Hostile(what, path, body, "input_ids" if path == GENERATE else "prompt", served=False)]
    return [Hostile(what, path, body, tokens=new)]


def _chat_document(rng: random.Random, t: Target, docs: list[list[int]]) -> list[Hostile]:
    """A chat document named by messages: content parts, `messages` at its edges."""
    count = rng.choice([1, 2, 3, 4])
    # a system message's content is one text (SGLang's conversation templates refuse parts there)
    words = max(3, min(80, t.max_prompt // (9 * count)))  # so that the conversation fits the context
    messages = [{"role": "system", "content": _text(rng, words)} if i == 0 and rng.random() < 0.3 else
                {"role": "user", "content": _content(rng, _text(rng, rng.choice([words // 2, words])))}
                for i in range(count - 1)]
    messages.append({"role": "user", "content": _content(rng, _text(rng, 6))})
    m = rng.choice([None, None, 1, count - 1, count, count + 1, 0, -1, "1", True, 1.0, MAX_BUDGET + 1])
    spec: dict[str, Any] = {} if m is None else {"messages": m}
    spec.update(rng.choice([{}, {"ratio": 0.3}, {"budget": 1}, {"ratio": 1e-9}]))
    kv = {"prompt_policy": rng.choice(["kvzip", "kvzip", "keydiff", "streamingllm", "snapkv"]), "document": spec}
    stream = rng.random() < 0.3
    body = _chat(t, messages, 2, kv, stream=stream, **({"stream_options": {"include_usage": True}} if stream else {}))
    what = f"chat document {spec} of {count} messages"
    field = "kv_compression.document"
    # in the order the HTTP layer checks them: the value, the server's settings, the conversation
    if m is not None and (not isinstance(m, int) or isinstance(m, bool) or not 1 <= m <= MAX_BUDGET):
        return [Hostile(what, CHAT, body, f"{field}.messages", served=False)]
    if kv["prompt_policy"] == "snapkv" or count < 2:
        return [Hostile(what, CHAT, body, field, served=False)]
    if m is not None and m >= count:
        return [Hostile(what, CHAT, body, f"{field}.messages", served=False)]
    # D is counted from SGLang's rendering: a short one may keep every token (refused, naming its messages)
    return [Hostile(what, CHAT, body, f"{field}.messages", served=None, tokens=2)]


def _question_policy(rng: random.Random, t: Target, docs: list[list[int]]) -> list[Hostile]:
    """A prompt policy that needs the question, or none at all, for a document."""
    path, doc = _route(rng), rng.choice(docs)
    policy = rng.choice(["snapkv", "rkv", "expected_attention", "none", "bogus"])
    kv = {"prompt_policy": policy, "document": {"tokens": len(doc)}}
    body = _body(t, path, doc + _tokens(rng, QUESTION), 2, kv)
    prefix = "sampling_params.custom_params.sgl_kvc" if path == GENERATE else "kv_compression"
    param = f"{prefix}.prompt_policy" if policy in ("none", "bogus") else f"{prefix}.document"
    return [Hostile(f"document with prompt_policy {policy}", path, body, param, served=False)]


def _batch(rng: random.Random, t: Target, docs: list[list[int]]) -> list[Hostile]:
    """One `/generate` batch whose prompts publish, wait for and start from the same document, each
    with its own settings (a ratio, a budget of 1, another prompt policy, none at all)."""
    doc = rng.choice(docs)
    size = rng.choice([2, 3])
    specs = [rng.choice([{"document": {"tokens": len(doc), "ratio": 0.3}, "prompt_policy": "kvzip"},
                         {"document": {"tokens": len(doc), "budget": 1}, "prompt_policy": "kvzip"},
                         {"document": {"tokens": len(doc)}, "prompt_policy": "streamingllm"}, None])
             for _ in range(size)]
    sampling = [{"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True,
                 **({"custom_params": {"sgl_kvc": spec}} if spec else {})} for spec in specs]
    body = {"input_ids": [doc + _tokens(rng, QUESTION) for _ in range(size)], "sampling_params": sampling}
    return [Hostile(f"a batch of {size} on one document", GENERATE, body, tokens=3)]


def _extensions(rng: random.Random, t: Target, docs: list[list[int]]) -> list[Hostile]:
    """Documents that begin with one of the suite's (a conversation's next turns, often resident):
    one token more up to a chunk and past it, several branches at once, ratios and budgets (a
    chain at its budget), another tenant's namespace, prompt log-probabilities, `n`, and a client
    hanging up while its turn is published."""
    doc = rng.choice(docs[:-1])
    room = t.max_prompt - len(doc) - QUESTION  # the server's longest prompt
    turns = [_tokens(rng, min(rng.choice([1, 7, 40, 130]), room)) for _ in range(rng.choice([1, 2, 3]))]
    spec = rng.choice([{"ratio": 0.3}, {"ratio": 0.5}, {"budget": 1}, {"budget": t.floor + 2}, {"budget": 200}])
    policy = rng.choice(DOCUMENT_POLICIES)
    out = []
    for turn in turns:
        path, prompt = _route(rng), doc + turn + _tokens(rng, QUESTION)
        d = len(doc) + len(turn)
        kv = {"prompt_policy": policy, "document": {"tokens": d, **spec}}
        what = f"a turn of {len(turn)} tokens after a document of {len(doc)}, {policy} {spec}"
        refused = _nothing_to_compress(t, d, spec)
        if refused:
            out.append(Hostile(what, path, _body(t, path, prompt, 2, kv), document_field(path, refused), served=False))
            continue
        pick = rng.random()
        if path == GENERATE and pick < 0.2:
            body = _body(t, path, prompt, 2, kv, return_logprob=True, logprob_start_len=0)
            out.append(Hostile(what + ", its prompt log-probabilities", path, body, tokens=2, prompt_logprobs=len(prompt)))
        elif pick < 0.35:
            out.append(Hostile(what + ", another namespace", path, _body(t, path, prompt, 3, kv, extra_key="tenant-b"),
                               tokens=3))
        elif pick < 0.5:
            body = _body(t, GENERATE, prompt, 4, kv, stream=True)
            out.append(Hostile(what + ", hanging up", GENERATE, body, hang_up=rng.uniform(0.005, 0.1)))
        elif pick < 0.65:
            n = 2
            body = (_body(t, path, prompt, 2, kv, sampling={"n": n}) if path == GENERATE
                    else _body(t, path, prompt, 2, kv, n=n))
            out.append(Hostile(what + f", n={n}", path, body, tokens=2))
        else:
            out.append(Hostile(what, path, _body(t, path, prompt, 3, kv), tokens=3))
    return out


def _turns(rng: random.Random, t: Target, docs: list[list[int]]) -> list[Hostile]:
    """A conversation's next turns, sent after its first answer: the document is the prompt and
    answer (a finished turn, often resident, or a reply compacted while it decoded), a template's
    tail of 0-2 tokens, or the answer's last token changed, or ending exactly where the turn
    does; with prompt log-probabilities, another namespace, `n`, a budget of the floor,
    `max_tokens` 0 or 1, or hanging up; and a third turn after the second's answer."""
    doc = rng.choice(docs[1:-1])
    spec = rng.choice([{"ratio": 0.3}, {"ratio": 0.5}, {"budget": t.floor + 2}])
    prompt_policy = rng.choice(DOCUMENT_POLICIES)  # the conversation's, every turn
    rng = random.Random(rng.random())  # its own: the next turns are drawn in the thread that sends them
    room = t.max_prompt - 2 * QUESTION - 16

    def first(prompt: list[int], d: int, depth: int) -> Hostile:
        kv = {"prompt_policy": prompt_policy, "document": {"tokens": d, **spec}}
        what = f"turn {depth} after a document of {d} tokens, {prompt_policy} {spec}"
        answer = rng.choice([1, 3])
        if rng.random() < 0.3 and len(prompt) + REPLY <= t.max_prompt:
            # a reply compacted while it decodes (a decode policy, a small budget of its own, down to
            # 1): kept as a reply, which the next turns (the server's own settings) never start from
            policy, budget = rng.choice(REPLY_POLICIES), rng.choice([1, 2, t.floor + 2])
            answer, kv = REPLY, {**kv, "policy": policy, "budget": budget}
            what += f", its reply compacted ({policy}, budget {budget})"
        then = (lambda body: _next_turns(prompt, body, depth)) if depth < 3 else None
        return Hostile(what, GENERATE, _body(t, GENERATE, prompt, answer, kv), tokens=answer, then=then)

    def _next_turns(prompt: list[int], body: Any, depth: int) -> list[Hostile]:
        said = prompt + body["output_ids"]
        if len(said) + 2 + QUESTION > room:
            return []
        pick = rng.random()
        d = len(said) + rng.choice([0, 1, 2])
        document = said + _tokens(rng, d - len(said))
        if pick < 0.1:
            document[len(said) - 2] += 1  # not the answer the model gave
        elif pick < 0.2:
            d = len(said) - 1  # ends where the turn does
            document = said[:d]
        question = document + _tokens(rng, QUESTION)
        kv = {"prompt_policy": prompt_policy, "document": {"tokens": d, **spec}}
        what = f"turn {depth + 1}: document of {d} tokens after a turn of {len(said) - 1}, {prompt_policy} {spec}"
        out = [first(question, d, depth + 1)]
        pick = rng.random()
        if pick < 0.2:
            body = _body(t, GENERATE, question, 2, kv, return_logprob=True, logprob_start_len=0)
            out.append(Hostile(what + ", its prompt log-probabilities", GENERATE, body, tokens=2,
                               prompt_logprobs=len(question)))
        elif pick < 0.35:
            out.append(Hostile(what + ", another namespace", GENERATE,
                               _body(t, GENERATE, question, 2, kv, extra_key="tenant-b"), tokens=2))
        elif pick < 0.5:
            out.append(Hostile(what + ", hanging up", GENERATE, _body(t, GENERATE, question, 4, kv, stream=True),
                               hang_up=rng.uniform(0.005, 0.1)))
        elif pick < 0.65:
            out.append(Hostile(what + ", n=2", GENERATE, _body(t, GENERATE, question, 2, kv, sampling={"n": 2}),
                               tokens=2))
        elif pick < 0.8:
            answer = rng.choice([0, 1])
            out.append(Hostile(what + f", max_tokens {answer}", GENERATE, _body(t, GENERATE, question, answer, kv),
                               tokens=answer))
        return out

    d = len(doc)
    return [first(doc + _tokens(rng, rng.choice([1, QUESTION])), d, 1)]


def _chain(rng: random.Random, t: Target, docs: list[list[int]]) -> list[Hostile]:
    """One client declaring its document one token longer at each request, one after another (a
    chain grown a link a request: the sequence that once recursed the server to its end), KVzip at
    a ratio, one token out: the chain stops at `--kv-document-depth` and is compressed again."""
    doc = docs[2]
    grow = _tokens(rng, 8)
    question = _tokens(rng, QUESTION)
    if _nothing_to_compress(t, len(doc) + 1, {"ratio": 0.3}):
        return []

    def link(j: int) -> Hostile:
        d = len(doc) + j
        kv = {"prompt_policy": "kvzip", "document": {"tokens": d, "ratio": 0.3}}
        then = (lambda body: [link(j + 1)]) if j < len(grow) else None
        return Hostile(f"a chain's link {j}: a document of {d} tokens", GENERATE,
                       _body(t, GENERATE, doc + grow[:j] + question, 1, kv), tokens=1, then=then)

    return [link(1)]


def _impersonate(rng: random.Random, t: Target, docs: list[list[int]]) -> list[Hostile]:
    """Another tenant's namespace and document (`tenant_answers`), with settings of its own, its
    prompt log-probabilities, or hanging up: the tenant's answers must not change."""
    tenant = random.Random("quiet-tenant")
    _tokens(tenant, 132)
    doc = _tokens(tenant, 120)
    spec = rng.choice([{"tokens": len(doc), "ratio": 0.3}, {"tokens": len(doc), "budget": 1},
                       {"tokens": len(doc), "ratio": 0.9}])
    kv = {"prompt_policy": rng.choice(["kvzip", "kvzip", "keydiff"]), "document": spec}
    path = _route(rng)
    prompt = doc + _tokens(rng, QUESTION)
    if path == GENERATE and rng.random() < 0.4:
        body = _body(t, path, prompt, 2, kv, extra_key="quiet-tenant", return_logprob=True, logprob_start_len=0)
        return [Hostile("the tenant's document, its prompt log-probabilities", path, body, tokens=2,
                        prompt_logprobs=len(prompt))]
    body = _body(t, path, prompt, 4, kv, extra_key="quiet-tenant")
    if rng.random() < 0.3:
        return [Hostile("the tenant's document, hanging up", GENERATE, _body(t, GENERATE, prompt, 4, kv, stream=True,
                        extra_key="quiet-tenant"), hang_up=rng.uniform(0.005, 0.1))]
    return [Hostile(f"the tenant's document {spec}", path, body, tokens=4)]


CASES: tuple[tuple[Callable[..., list[Hostile]], int], ...] = (
    (_namespace, 3), (_lora, 2), (_prompt_logprobs, 4), (_samples, 2), (_max_tokens, 2), (_stop, 2),
    (_budgets, 3), (_document_tokens, 2), (_chat_document, 3), (_question_policy, 1), (_batch, 1),
    (_impersonate, 2), (_extensions, 3), (_turns, 3), (_chain, 1),
)


def make_hostile(seed: int, count: int, t: Target, context: bool) -> list[Hostile]:
    """About `count` hostile requests (a case of several requests counts them all); the shared
    documents are the same for every seed. `context`: prompts at the server's longest input."""
    rng = random.Random(f"hostile-{seed}")
    shared = random.Random("hostile-documents")
    lengths = [t.floor + 1, 40, 120, min(300, t.max_prompt - QUESTION - 30)]
    docs = [_tokens(shared, n) for n in lengths]
    cases = [c for c in CASES] + ([(_context, 2)] if context else [])
    out: list[Hostile] = []
    # one new long document per burst, its clients hanging up while it is compressed
    out += _hang_ups(rng, t, docs)
    while len(out) < count:
        case = rng.choices([c for c, _ in cases], [w for _, w in cases])[0]
        out += case(rng, t, docs)
    return out


# ----------------------------------------------------------------------------------- sending


@dataclass
class Reply:
    status: int  # 0: the client hung up before an answer
    body: Any = None  # the JSON answer, or a stream's events
    error: dict | None = None  # the error object of a refusal (or of an error event in a stream)
    in_stream: bool = False  # the error came as an event of a 200 stream


def send(url: str, h: Hostile) -> Reply:
    if h.hang_up is not None:
        return _hang_up(url, h)
    stream = bool(h.body.get("stream"))
    r = requests.post(url + h.path, json=h.body, timeout=300, stream=stream)
    if r.status_code != 200 or not stream:
        try:
            body = r.json()
        except ValueError:
            body = r.text
        error = body.get("error") if isinstance(body, dict) else None
        return Reply(r.status_code, body, error if r.status_code != 200 else None)
    events = []
    for line in r.iter_lines(decode_unicode=True):
        if line and line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[len("data: "):])
            if isinstance(event, dict) and "error" in event:
                return Reply(200, events, event["error"], in_stream=True)
            events.append(event)
    return Reply(200, events)


def _hang_up(url: str, h: Hostile) -> Reply:
    """Send `h`, then close the connection after `h.hang_up` s (a stream: after its first event,
    or then), unless the answer came first."""
    where = urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=h.hang_up)
    try:
        conn.request("POST", h.path, body=json.dumps(h.body), headers={"content-type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            body = json.loads(response.read() or b"null")
            return Reply(response.status, body, body.get("error") if isinstance(body, dict) else None)
        if h.body.get("stream"):
            response.fp.readline()  # its first event, then hang up
        return Reply(0)
    except (socket.timeout, TimeoutError):
        return Reply(0)
    finally:
        conn.close()


def problems(h: Hostile, reply: Reply) -> list[str]:
    """What is wrong with `reply` to `h` (empty: nothing)."""
    if reply.status == 0:
        return []
    code = reply.error.get("code") if reply.error else None
    if reply.status >= 500 or isinstance(code, int) and code >= 500:
        return [f"{reply.status}: {str(reply.body)[:400]}"]
    if reply.error is not None:
        if reply.in_stream:
            return [f"a refusal inside a 200 stream: {reply.error}"]
        err = reply.error
        if set(reply.body) != {"error"} or set(err) != {"message", "type", "param", "code"}:
            return [f"not an OpenAI-style error: {reply.body}"]
        if err["code"] != reply.status or err["type"] != "invalid_request_error" or not 400 <= reply.status < 500:
            return [f"status {reply.status}, error {err}"]
        if h.served is True:
            return [f"a valid request was refused ({err['param']}): {err['message']}"]
        if err["param"] != h.refuse:
            return [f"refused naming {err['param']!r}, not {h.refuse!r}: {err['message']}"]
        return []
    if reply.status != 200:
        return [f"{reply.status} without an error object: {str(reply.body)[:300]}"]
    if h.served is False:
        return [f"served, where a 400 naming {h.refuse} was expected"]
    return _served_problems(h, reply.body)


def _served_problems(h: Hostile, body: Any) -> list[str]:
    sp = h.body.get("sampling_params")
    sp = sp if isinstance(sp, dict) else {}  # a batch's list: no n, no stop
    stopped = "stop" in h.body or "stop" in sp
    n = h.body.get("n") or sp.get("n") or 1
    found = []
    if h.path == GENERATE:
        ids = h.body.get("input_ids")
        prompts = len(ids) if isinstance(ids, list) and ids and isinstance(ids[0], list) else 1
        outs = body if isinstance(body, list) else [body]
        if len(outs) != n * prompts:
            return [f"{len(outs)} answers for {prompts} prompt(s), n={n}"]
        for out in outs:
            got = len(out["output_ids"])
            if h.tokens is not None and (got > h.tokens or got < h.tokens and not stopped):
                found.append(f"{got} output tokens, asked for {h.tokens}")
            if h.prompt_logprobs is not None:
                lps = out["meta_info"].get("input_token_logprobs") or []
                if len(lps) != h.prompt_logprobs:
                    found.append(f"{len(lps)} prompt log-probabilities, asked for {h.prompt_logprobs}")
        return found
    if isinstance(body, list):  # a stream's events
        finish = {c["index"]: c["finish_reason"] for e in body for c in e.get("choices", []) if c.get("finish_reason")}
        if sorted(finish) != list(range(n)):
            found.append(f"finish reasons {finish} for n={n}")
        usage = [e["usage"] for e in body if e.get("usage")]
        if usage and h.tokens is not None and not stopped and usage[-1]["completion_tokens"] != n * h.tokens:
            found.append(f"{usage[-1]['completion_tokens']} completion tokens, asked for {n} x {h.tokens}")
        return found
    choices = body["choices"]
    if sorted(c["index"] for c in choices) != list(range(n)):
        return [f"{len(choices)} choices for n={n}"]
    got = body["usage"]["completion_tokens"]
    if h.tokens is not None and (got > n * h.tokens or got < n * h.tokens and not stopped):
        found.append(f"{got} completion tokens, asked for {n} x {h.tokens}")
    if h.prompt_logprobs is not None:
        lps = choices[0]["logprobs"]["token_logprobs"]
        if len(lps) != h.prompt_logprobs + (h.tokens or 0):
            found.append(f"{len(lps)} echoed log-probabilities, asked for {h.prompt_logprobs} + {h.tokens}")
    return found


# A server whose context is shorter than this takes the request mix's short prompts only.
SHORT_CONTEXT = 1024


def _words(req: Any) -> int:
    """Words in a request-mix request's prompt."""
    if "prompt" in req.kwargs:
        return len(req.kwargs["prompt"].split())
    return sum(len(m["content"].split()) for m in req.kwargs["messages"])


# ------------------------------------------------------------------------------ another tenant


def tenant_answers(server: Any, t: Target) -> list[list[int]]:
    """Greedy answers of another tenant: a plain prompt read with the full cache, and a question
    on its own document (the second of two requests, so that it starts from the document whether
    or not the first published it). The plain prompt is not compressed: where chunks are
    compressed between them, a compressed prompt's answer depends on where its own earlier copy
    left SGLang's radix cache (a prefix hit moves its cuts), on a quiet server too."""
    rng = random.Random("quiet-tenant")
    plain, doc = _tokens(rng, 132), _tokens(rng, 120)

    def ask(prompt: list[int], kv: dict | None = None) -> list[int]:
        body = _body(t, GENERATE, prompt, 8, kv, extra_key="quiet-tenant")
        r = server.post(GENERATE, json=body)
        assert r.status_code == 200, r.text[:300]
        return r.json()["output_ids"]

    kv = {"prompt_policy": "kvzip", "document": {"tokens": len(doc), "ratio": 0.3}}
    question = _tokens(rng, QUESTION)
    ask(doc + question, kv)
    return [ask(plain, {"policy": "none"}), ask(doc + question, kv)]


def run_bursts(server: Any, t: Target, seed: int, bursts: int, hostile: int, ordinary: int) -> dict[str, int]:
    """`bursts` bursts (seeds seed, seed + 1, ...) of about `hostile` hostile requests and
    `ordinary` requests of the request mix, all at once, against a live `ServerProcess`; after
    each, the checks of the module's docstring. Prompts at the longest input SGLang takes are sent
    to a server with a short context only (`SHORT_CONTEXT`). Returns counts."""
    context = t.max_prompt < SHORT_CONTEXT
    before = server.wait_idle()
    quiet = tenant_answers(server, t)
    client = openai_client(server.url)
    counts = {"hostile": 0, "served": 0, "refused": 0, "hung_up": 0, "ordinary": 0}
    for burst in range(bursts):
        s = seed + burst
        cases = make_hostile(s, hostile, t, context)
        mix = make_mix(s, ordinary, t.model, before["policy"], prompt_policy_now=before["prompt_policy"])
        if t.max_prompt < SHORT_CONTEXT:  # the ordinary requests that fit a short context
            mix = [replace(m, kwargs={**m.kwargs, "max_tokens": min(m.kwargs["max_tokens"], 32)})
                   for m in mix if _words(m) <= 20]
        jobs: list[tuple[str, Any]] = [("hostile", h) for h in cases] + [("ordinary", m) for m in mix]
        random.Random(s).shuffle(jobs)

        def run(job: tuple[str, Any]) -> list[tuple[str, Any, Any]]:
            kind, req = job
            if kind != "hostile":
                return [(kind, req, mix_send(client, req))]
            reply = send(server.url, req)
            done = [(kind, req, reply)]
            if req.then is not None and reply.status == 200 and not problems(req, reply):
                for follow in req.then(reply.body):  # a conversation's next turns, in order
                    done += run(("hostile", follow))
            return done

        started = time.monotonic()
        with ThreadPoolExecutor(len(jobs)) as pool:
            replies = [r for rs in pool.map(run, jobs) for r in rs]
        where = f"hostile suite seed {s} (reproduce: pytest --fuzz-seed {s} --fuzz-bursts 1)"
        for kind, req, reply in replies:
            found = problems(req, reply) if kind == "hostile" else mix_problems(req, reply)
            assert not found, f"{where}: {'; '.join(found)}\n  {req.describe()}"
            if kind == "hostile":
                counts["hostile"] += 1
                counts["served"] += reply.status == 200
                counts["refused"] += 400 <= reply.status < 500
                counts["hung_up"] += reply.status == 0
            else:
                counts["ordinary"] += 1
        assert server.get("/health").status_code == 200, f"{where}: the server is down"
        after = server.wait_idle(timeout_s=120)
        assert after["requests"]["running"] == 0, f"{where}: requests still running"
        assert_pool_whole(after)
        assert after["pool"]["request_state_bytes"] == 0, (where, after["pool"])
        failed = after["compression"]["failed_requests"] - before["compression"]["failed_requests"]
        assert failed == 0, f"{where}: sgl-kvc failed {failed} request(s); see the server log"
        now = tenant_answers(server, t)
        assert now == quiet, f"{where}: another tenant's greedy answers changed: {now} (plain, document), {quiet} quiet"
        print(f"hostile burst {s}: {len(jobs)} requests in {time.monotonic() - started:.1f} s")
    return counts

