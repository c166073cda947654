"""The request-mix fuzz test's driver: seeded random mixes of requests, sent in concurrent bursts
to a live server through the official `openai` client.

A mix varies what one tenant can choose: every policy and prompt policy, budgets at their edges,
both selections, `kv_compression` absent, empty, partial, full or invalid; chat and completions,
streaming (and a client that hangs up mid-stream), `n` > 1, stop strings, log-probabilities of
the output and of the prompt (`echo`), prompts of a few to several hundred tokens (longer than the
chunk of a server with a small `--chunked-prefill-size`), and chat requests that begin with one of a
few shared documents (`kv_compression.document`, with prompt policies that can and cannot compress
one; drawn from a stream of their own, so the rest of a seed's mix is as it was).

What must hold, whatever the mix: each request completes with the tokens it asked for (or fewer,
ended by its own stop string), or gets a 400 whose `param` names its own field; nothing gets a
5xx; and once the server is idle the pool adds up, the per-request state is zero bytes and
sgl-kvc failed no request. A failure names the seed and the request that reproduce it.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import openai

from kvc_reference import assert_pool_whole
from sgl_kvc.policies import AUTO, SELECTIONS, available_policies, policy_class, prompt_policy_error, prompt_policy_name
from sgl_kvc.request_settings import MAX_BUDGET, RequestCompression, parse_kv_compression

WORDS = ("cache", "token", "budget", "tree", "prefix", "layer", "head", "query", "key", "value",
         "memory", "pool", "slot", "chunk", "decode", "prompt", "score", "window", "sink", "the")
BUDGETS = (1, 2, 7, 8, 9, 31, 32, 33, 64, 200, MAX_BUDGET)
# (settings, the field a 400 must name); settings that are not even an object name the object
INVALID: tuple[tuple[Any, str], ...] = (
    ({"policy": "bogus"}, "kv_compression.policy"),
    ({"budget": 0}, "kv_compression.budget"),
    ({"budget": -3}, "kv_compression.budget"),
    ({"budget": 1.5}, "kv_compression.budget"),
    ({"budget": "64"}, "kv_compression.budget"),
    ({"budget": MAX_BUDGET + 1}, "kv_compression.budget"),
    ({"selection": "diagonal"}, "kv_compression.selection"),
    ({"prompt_policy": "none"}, "kv_compression.prompt_policy"),
    ({"policy": "rkv", "colour": "blue"}, "kv_compression.colour"),
    (["rkv"], "kv_compression"),
    ("rkv", "kv_compression"),
    (None, "kv_compression"),
)


# The shared documents of the mix: fixed texts, so that requests of one burst and of later bursts
# start from the same ones (a document of 40 to 250 words is 50 to 300 tokens).
DOCUMENTS = tuple(" ".join(random.Random(f"document-{i}").choice(WORDS) for _ in range(n))
                  for i, n in enumerate((40, 120, 250)))
DOCUMENT_SPECS = ({}, {"ratio": 0.2}, {"ratio": 0.5}, {"budget": 16}, {"messages": 1})


def _document_expect(settings: dict[str, Any], server_policy: str, server_prompt_policy: str) -> str | None:
    """The field a 400 must name for a chat request with a document and these settings."""
    parsed = parse_kv_compression(settings, chat=True)
    wants = [k for k in ("policy", "budget", "prompt_policy", "document") if settings.get(k) not in (None, "none")]
    if server_policy == "none":
        return "kv_compression." + wants[0]
    if parsed.policy is not None and policy_class(parsed.policy).prompt_only:
        return "kv_compression.policy"
    policies = parsed.policies(server_policy, server_prompt_policy)
    if prompt_policy_error(*policies) is not None:
        return "kv_compression.prompt_policy"
    if not policy_class(prompt_policy_name(*policies)).question_free or (parsed.selection or "per-head") != "per-head":
        return "kv_compression.document"
    return None


@dataclass(frozen=True)
class MixRequest:
    """One request of a mix: its route, its body (as the `openai` client's keyword arguments),
    and what the server must answer."""

    route: str  # "chat" or "completions"
    kwargs: dict[str, Any]
    disconnect: bool  # streamed, and the client hangs up after the first chunk
    expect_param: str | None  # a 400 naming this field is the only right answer

    def describe(self) -> str:
        return f"{self.route} {self.kwargs} disconnect={self.disconnect}"


def _settings(rng: random.Random, server_policy: str, server_prompt_policy: str) -> tuple[Any, str | None]:
    """A `kv_compression` value (or `...` for none at all) and the field a 400 must name."""
    kind = rng.choices(["absent", "empty", "partial", "full", "invalid"], [4, 1, 3, 3, 1])[0]
    if kind == "absent":
        return ..., None
    if kind == "invalid":
        return rng.choice(INVALID)
    choices = {
        "policy": available_policies(),
        "prompt_policy": [AUTO, *(p for p in available_policies() if p != "none")],
        "budget": BUDGETS,
        "selection": SELECTIONS,
    }
    names = [] if kind == "empty" else list(choices) if kind == "full" else rng.sample(list(choices), rng.randint(1, 2))
    settings = {name: rng.choice(choices[name]) for name in names}
    parsed = RequestCompression(**settings)
    if server_policy == "none" and (parsed.policy not in (None, "none") or parsed.budget or parsed.prompt_policy):
        return settings, "kv_compression." + next(k for k in ("policy", "budget", "prompt_policy") if settings.get(k) not in (None, "none"))
    if parsed.policy is not None and policy_class(parsed.policy).prompt_only:  # KVzip as a request's policy
        return settings, "kv_compression.policy"
    if prompt_policy_error(*parsed.policies(server_policy, server_prompt_policy)) is not None:
        return settings, "kv_compression.prompt_policy"
    return settings, None


def make_mix(seed: int, count: int, model: str, server_policy: str, server_prompt_policy: str = AUTO,
             max_words: int = 300, prompt_policy_now: str | None = None) -> list[MixRequest]:
    """`prompt_policy_now`: the server's prompt policy as its stats name it (for the documents)."""
    rng = random.Random(seed)
    documents = random.Random(f"documents-{seed}")
    out = []
    for _ in range(count):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.choice([3, 20, 60, max_words // 2, max_words])))
        route = rng.choice(["chat", "completions"])
        stream = rng.random() < 0.35
        disconnect = stream and rng.random() < 0.3
        kwargs: dict[str, Any] = {"model": model, "max_tokens": rng.choice([1, 2, 9, 24, 40, 120]), "stream": stream}
        extra: dict[str, Any] = {"ignore_eos": True}
        if rng.random() < 0.3:
            kwargs["n"] = rng.choice([2, 3])
        kwargs["temperature"] = 0.0 if "n" not in kwargs and rng.random() < 0.5 else 0.8
        if rng.random() < 0.25:
            kwargs["stop"] = [rng.choice(WORDS[:5])]
        if route == "chat":
            kwargs["messages"] = [{"role": "user", "content": text}]
            if rng.random() < 0.25:
                kwargs["logprobs"], kwargs["top_logprobs"] = True, 2
        else:
            kwargs["prompt"] = text
            if rng.random() < 0.25:
                kwargs["logprobs"] = 2
                kwargs["echo"] = rng.random() < 0.5 and not stream  # the prompt's log-probabilities
        if stream and rng.random() < 0.7:
            kwargs["stream_options"] = {"include_usage": True}
        settings, expect = _settings(rng, server_policy, server_prompt_policy)
        if route == "chat" and expect is None and documents.random() < 0.3:
            kwargs["messages"] = [{"role": "user", "content": documents.choice(DOCUMENTS)}, *kwargs["messages"]]
            settings = {**({} if settings is ... else settings), "document": documents.choice(DOCUMENT_SPECS)}
            if documents.random() < 0.7:
                settings["prompt_policy"] = documents.choice(["kvzip", "keydiff", "streamingllm", "snapkv"])
            expect = _document_expect(settings, server_policy, prompt_policy_now or server_prompt_policy)
        if settings is not ...:
            extra["kv_compression"] = settings
        kwargs["extra_body"] = extra
        out.append(MixRequest(route, kwargs, disconnect, expect))
    return out


@dataclass
class Answer:
    status: int
    param: str | None = None
    message: str = ""
    finish: dict[int, str] = field(default_factory=dict)  # choice index -> finish reason
    completion_tokens: int | None = None


def send(client: openai.OpenAI, req: MixRequest) -> Answer:
    create = client.chat.completions.create if req.route == "chat" else client.completions.create
    try:
        result = create(**req.kwargs)
        if not req.kwargs["stream"]:
            return Answer(200, finish={c.index: c.finish_reason for c in result.choices},
                          completion_tokens=result.usage.completion_tokens)
        answer = Answer(200)
        with result:
            for chunk in result:
                for c in chunk.choices:
                    if c.finish_reason is not None:
                        answer.finish[c.index] = c.finish_reason
                if chunk.usage is not None:
                    answer.completion_tokens = chunk.usage.completion_tokens
                if req.disconnect:
                    break  # hang up: leaving the block closes the connection mid-stream
        return answer
    except openai.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else {}
        body = body.get("error", body) if isinstance(body.get("error"), dict) else body
        return Answer(e.status_code, param=body.get("param"), message=str(body.get("message", e))[:300])
    except openai.APIError as e:  # an error event in a stream that began with 200
        body = e.body if isinstance(e.body, dict) else {}
        code = body.get("code") if isinstance(body.get("code"), int) else 599
        return Answer(code, param=body.get("param"), message=f"error event in the stream: {e}"[:300])


# A 400 for a prompt (or a budget) the pool cannot hold: the request's own, but only a server
# whose pool is smaller than the mix's prompts gives it (`run_bursts(pool_limited=True)`).
POOL_LIMITS = ("exceeds the maximum allowed length", "cannot hold this request")


def problems(req: MixRequest, answer: Answer, pool_limited: bool = False) -> list[str]:
    """What is wrong with `answer` to `req` (empty: nothing)."""
    if answer.status >= 500:
        return [f"{answer.status}: {answer.message}"]
    if pool_limited and answer.status == 400 and any(s in answer.message for s in POOL_LIMITS):
        return []
    if req.expect_param is not None:
        if answer.status != 400 or answer.param != req.expect_param:
            return [f"expected a 400 naming {req.expect_param}, got {answer.status} naming {answer.param}: {answer.message}"]
        return []
    if answer.status != 200:
        return [f"a valid request got {answer.status} ({answer.param}): {answer.message}"]
    if req.disconnect:
        return []
    n, max_tokens = req.kwargs.get("n", 1), req.kwargs["max_tokens"]
    found = []
    if sorted(answer.finish) != list(range(n)) or not set(answer.finish.values()) <= {"length", "stop"}:
        found.append(f"finish reasons {answer.finish} for n={n}")
    stopped = "stop" in answer.finish.values() and "stop" in req.kwargs
    if answer.completion_tokens is not None and not stopped and answer.completion_tokens != n * max_tokens:
        found.append(f"{answer.completion_tokens} completion tokens, asked for {n} x {max_tokens}")
    if "stop" in answer.finish.values() and "stop" not in req.kwargs:
        found.append("finished by a stop it did not ask for")
    return found


# SGLang closes a connection idle for SGLANG_TIMEOUT_KEEP_ALIVE (5 s); httpx keeps one idle for 5 s
# too, so a request sent on a connection idle that long races the server's close and fails with
# "Connection error." (the clients here never retry). The client drops idle connections first.
CLIENT_KEEPALIVE_S = 2.0


def openai_client(url: str, timeout: float = 300) -> openai.OpenAI:
    """An OpenAI client of the server at `url` that never retries and never reuses a connection
    the server may be closing (`CLIENT_KEEPALIVE_S`)."""
    import httpx

    http = openai.DefaultHttpxClient(limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100,
                                                         keepalive_expiry=CLIENT_KEEPALIVE_S))
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=timeout, http_client=http)


def run_bursts(
    server: Any, seed: int, bursts: int, per_burst: int, max_words: int = 300, pool_limited: bool = False,
) -> dict[str, int]:
    """`bursts` bursts of `per_burst` concurrent requests (mix seeds seed, seed + 1, ...) against a
    live `ServerProcess`; fails with the seed and request of the first problem. Returns counts.
    `pool_limited`: the server's pool is smaller than some prompts of the mix (see `POOL_LIMITS`)."""
    before = server.wait_idle()
    policy, model = before["policy"], server.get("/v1/models").json()["data"][0]["id"]
    client = openai_client(server.url)
    counts = {"requests": 0, "ok": 0, "rejected": 0, "streamed": 0, "disconnected": 0}
    for burst in range(bursts):
        mix = make_mix(seed + burst, per_burst, model, policy, max_words=max_words, prompt_policy_now=before["prompt_policy"])
        with ThreadPoolExecutor(per_burst) as pool:
            answers = list(pool.map(lambda r: send(client, r), mix))
        for k, (req, answer) in enumerate(zip(mix, answers)):
            found = problems(req, answer, pool_limited)
            assert not found, (f"request-mix seed {seed + burst}, request {k}: {'; '.join(found)}\n"
                               f"  {req.describe()}\n  reproduce: pytest --fuzz-seed {seed + burst} --fuzz-bursts 1")
            counts["requests"] += 1
            counts["ok"] += answer.status == 200
            counts["rejected"] += answer.status == 400
            counts["streamed"] += bool(req.kwargs["stream"])
            counts["disconnected"] += req.disconnect
    after = server.wait_idle()
    assert after["requests"]["running"] == 0, f"seeds {seed}..{seed + bursts - 1}: requests still running"
    assert_pool_whole(after)
    assert after["pool"]["request_state_bytes"] == 0, after["pool"]
    failed = after["compression"]["failed_requests"] - before["compression"]["failed_requests"]
    assert failed == 0, f"seeds {seed}..{seed + bursts - 1}: sgl-kvc failed {failed} request(s); see the server log"
    assert server.get("/health").status_code == 200
    return counts
