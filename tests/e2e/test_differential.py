"""Where nothing is compressed, a compressing server answers exactly as plain SGLang does.

The same requests (kinds SGLang's own OpenAI-server and `/generate` tests send: log-probabilities
and top log-probabilities of prompts and outputs, `n` > 1, streams, echo, stop strings and token
ids, logit bias, `/v1/score`, cached tokens of a repeated prompt, long and short) go to plain
SGLang (`--policy none`) and to compressing servers whose budget exceeds every prompt and output
(R-KV on the uniform pool and on the unit pool of `--kv-head-budget layer`; per request a KVzip
prompt policy on both, SnapKV and H2O on the uniform one), one at a time, each after an emptied prefix cache, in bfloat16 and in
float32. Every field of every response must agree (`tests/differential.py`: ids and times apart,
log-probabilities within the dtype's rounding). Then the same requests with a per-request budget
small enough that every one is compressed: every field still present and well-formed, no error,
the prompt's log-probabilities unchanged, and the tokens generated before the first pass as the
full cache's.
"""

from __future__ import annotations

import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any, Iterator

import pytest

from differential import (
    CHAT, COMPLETIONS, GENERATE, SCORE, Case, Target, differences, merged_stream, output_tokens,
    send, shape_differences, tolerance,
)
from loadtest.server import ServerProcess

pytestmark = pytest.mark.e2e

BUDGET, BUFFER = 4096, 16  # the servers': past every prompt and output here
SMALL = 9  # a per-request budget (the window + 1, the least a request may ask for) every longer prompt passes
PROMPT = "The orchestra tuned its instruments while the audience found their seats."
CHAT_MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in a few words."}]
# Per-request settings on each compressing server (None: the server's own R-KV, SnapKV on prompts).
# H2O accumulates every prompt query's attention, so it reads a prompt whole unless it can never
# be compressed (prompt and output within its budget): then it hits as plain SGLang does.
VARIANTS = {
    "uniform": {"rkv": None, "snapkv": {"policy": "snapkv"}, "kvzip": {"prompt_policy": "kvzip"},
                "h2o": {"policy": "h2o"}},
    "layer": {"rkv": None, "kvzip": {"prompt_policy": "kvzip"}},
}


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n)]


def _cases() -> list[Case]:
    greedy = {"model": "m", "temperature": 0.0}
    gen = {"temperature": 0.0}
    return [
        Case("completion logprobs", COMPLETIONS, {**greedy, "prompt": PROMPT, "max_tokens": 24, "logprobs": 3}),
        Case("completion echo", COMPLETIONS, {**greedy, "prompt": PROMPT, "max_tokens": 6, "echo": True, "logprobs": 2}),
        Case("completion n=2", COMPLETIONS, {**greedy, "prompt": PROMPT, "max_tokens": 8, "n": 2}),
        Case("completion ignore_eos", COMPLETIONS, {**greedy, "prompt": "Seven times eight is", "max_tokens": 64,
                                                    "ignore_eos": True, "logprobs": 1}),
        Case("completion stream", COMPLETIONS, {**greedy, "prompt": PROMPT, "max_tokens": 12, "logprobs": 1,
                                                "stream_options": {"include_usage": True}}, stream=True),
        Case("chat logprobs", CHAT, {**greedy, "messages": CHAT_MESSAGES, "max_tokens": 16, "logprobs": True,
                                     "top_logprobs": 3}),
        Case("chat stream", CHAT, {**greedy, "messages": CHAT_MESSAGES, "max_tokens": 16, "logprobs": True,
                                   "top_logprobs": 2, "stream_options": {"include_usage": True}}, stream=True),
        Case("chat n=2", CHAT, {**greedy, "messages": CHAT_MESSAGES, "max_tokens": 8, "n": 2}),
        Case("logit bias", COMPLETIONS, {**greedy, "prompt": PROMPT, "max_tokens": 6, "logit_bias": {"1017": 100}}),
        Case("generate logprobs", GENERATE, {"text": PROMPT, "return_logprob": True, "logprob_start_len": 2,
                                             "top_logprobs_num": 2, "return_text_in_logprobs": True,
                                             "sampling_params": {**gen, "max_new_tokens": 10}}),
        Case("generate batch", GENERATE, {"text": [PROMPT, "Seven times eight is"],
                                          "sampling_params": {**gen, "max_new_tokens": 6}}),
        Case("score", SCORE, {"model": "m", "query": PROMPT, "items": [" The violins", " The conductor raised"],
                              "label_token_ids": [10, 20, 30]}, kvc=False),
        Case("repeated long prompt", GENERATE, {"input_ids": _ids(300, 1), "sampling_params": {**gen, "max_new_tokens": 4}},
             repeat=2),
        Case("repeated short prompt", GENERATE, {"text": "The capital of France is",
                                                 "sampling_params": {**gen, "max_new_tokens": 4}}, repeat=2),
    ]


def _stop_cases(plain: Target) -> list[Case]:
    """Stops that end a greedy answer inside it: a token text of plain SGLang's answer as a stop
    string, and a generated token id as a stop token id (each 5 tokens in)."""
    base = Case("probe", COMPLETIONS, {"model": "m", "temperature": 0.0, "prompt": PROMPT, "max_tokens": 12,
                                       "logprobs": 1})
    tokens = send(plain, base)[0]["choices"][0]["logprobs"]["tokens"]
    probe = Case("probe", GENERATE, {"text": PROMPT, "sampling_params": {"temperature": 0.0, "max_new_tokens": 12}})
    ids = send(plain, probe)[0]["output_ids"]
    return [
        Case("stop string", COMPLETIONS, {**base.body, "stop": [tokens[5]]}),
        Case("stop string, chat", CHAT, {"model": "m", "temperature": 0.0, "messages": CHAT_MESSAGES, "max_tokens": 12,
                                         "stop": [tokens[5], "never appears"]}),
        Case("stop token id", GENERATE, {"text": PROMPT, "sampling_params": {"temperature": 0.0, "max_new_tokens": 12,
                                                                             "stop_token_ids": [ids[5]]}}),
    ]


def _flags(dtype: str) -> list[str]:
    return [sys.executable, "-m", "sgl_kvc.launch", "--model-path", "demo", "--dtype", dtype, "--enable-cache-report"]


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def servers(request: pytest.FixtureRequest, demo_model_path: str) -> Iterator[dict[str, Any]]:
    dtype = request.param
    compressing = ["--policy", "rkv", "--kv-budget", str(BUDGET), "--kv-buffer", str(BUFFER)]
    specs = {
        "plain": [*_flags(dtype), "--policy", "none"],
        "uniform": [*_flags(dtype), *compressing],
        "layer": [*_flags(dtype), *compressing, "--kv-head-budget", "layer"],
    }
    with ExitStack() as stack, ThreadPoolExecutor(len(specs)) as pool:
        futures = {name: pool.submit(stack.enter_context, ServerProcess.launch(cmd)) for name, cmd in specs.items()}
        started = {name: f.result() for name, f in futures.items()}
        yield {"dtype": dtype, "servers": started, "targets": {n: Target.at(s.url) for n, s in started.items()}}


def _fresh(server: ServerProcess, wait_s: float = 30.0) -> None:
    """An empty prefix cache. SGLang flushes only an idle scheduler, and the last request's answer
    can reach the client a step before its scheduler has released it: retried, within `wait_s`."""
    deadline = time.monotonic() + wait_s
    while (r := server.post("/flush_cache", json={})).status_code != 200:
        assert time.monotonic() < deadline, f"the cache was not flushed in {wait_s} s: {r.text}"
        time.sleep(0.05)


def _run(servers: dict[str, Any], name: str, case: Case, kvc: dict | None = None) -> list[Any]:
    _fresh(servers["servers"][name])
    return send(servers["targets"][name], case, kvc)


def _compared(plain: list[Any], ours: list[Any], case: Case) -> tuple[list[Any], list[Any]]:
    """The responses as compared: a stream as what a client assembles of it (`merged_stream`)."""
    if case.stream:
        return [merged_stream(s) for s in plain], [merged_stream(s) for s in ours]
    return plain, ours


def test_nothing_compressed_answers_as_plain_sglang(servers) -> None:
    tol = tolerance(servers["dtype"])
    targets = servers["targets"]
    before = {n: servers["servers"][n].stats()["compression"] for n in ("uniform", "layer")}
    found = []
    cases = _cases() + _stop_cases(targets["plain"])
    for case in cases:
        plain = _run(servers, "plain", case)
        for name in ("uniform", "layer"):
            for variant, kvc in VARIANTS[name].items():
                if not case.kvc and kvc is not None:
                    continue
                a, b = _compared(plain, _run(servers, name, case, kvc), case)
                found += [f"{case.name} / {name} {variant}: {d}" for d in differences(a, b, tol)]
    assert not found, f"{len(found)} differences from plain SGLang:\n" + "\n".join(found[:40])
    # The fields compared are the ones that matter here: cached tokens were reported and reused.
    repeated = _run(servers, "plain", next(c for c in cases if c.name == "repeated short prompt"))
    assert repeated[1]["meta_info"]["cached_tokens"] > 0 and repeated[1]["meta_info"]["cached_tokens_details"]
    for name in ("uniform", "layer"):
        after = servers["servers"][name].stats()["compression"]
        assert after["passes"] == before[name]["passes"], f"{name}: something was compressed"
        assert after["failed_requests"] == 0
        assert servers["servers"][name].stats()["decode_attention"]["layers"] > 0  # sgl-kvc's kernel served


def _uncompressed_tokens(case: Case, prompt_len: int) -> int:
    """Tokens a request generates before its first pass at budget `SMALL`: all of those it
    computes while its cache is under budget + buffer (a prompt over the budget is cut right after
    prefill: only the first token, from the prefill's logits)."""
    return 1 if prompt_len > SMALL else SMALL + BUFFER - prompt_len


def _prompt_len(response: Any, case: Case) -> int:
    if case.route == GENERATE:
        meta = response["meta_info"] if isinstance(response, dict) else response[0]["meta_info"]
        return int(meta["prompt_tokens"])
    return int(response["usage"]["prompt_tokens"])


def test_everything_compressed_keeps_every_field(servers) -> None:
    targets = servers["targets"]
    tol = tolerance(servers["dtype"])
    cases = [c for c in _cases() + _stop_cases(targets["plain"]) if c.kvc]
    before = {n: servers["servers"][n].stats()["compression"] for n in ("uniform", "layer")}
    found, over = [], 0
    for case in cases:
        plain = _run(servers, "plain", case)
        over += sum(_prompt_len(p, case) > SMALL for p in plain if not case.stream and isinstance(p, dict))
        for name in ("uniform", "layer"):
            for variant, kvc in VARIANTS[name].items():
                small = {**(kvc or {}), "budget": SMALL}
                ours = _run(servers, name, case, small)
                where = f"{case.name} / {name} {variant}"
                a, b = _compared(plain, ours, case)
                for p, o in zip(a, b):
                    found += [f"{where}: {d}" for d in _compressed_differences(p, o, case, tol)]
    assert not found, f"{len(found)} problems with compressed requests:\n" + "\n".join(found[:40])
    for name in ("uniform", "layer"):
        after = servers["servers"][name].stats()["compression"]
        assert after["passes"] - before[name]["passes"] >= over * len(VARIANTS[name]), f"{name}: not everything compressed"
        assert after["failed_requests"] == 0


def _compressed_differences(plain: Any, ours: Any, case: Case, tol) -> list[str]:
    """A compressed answer against the full cache's: the same fields; the same prompt
    log-probabilities (read before any pass); the same first tokens, as long as nothing was
    evicted yet."""
    found = shape_differences(_lengths_free(plain), _lengths_free(ours))
    if case.stream or found:
        return found
    if case.route == GENERATE and isinstance(plain, dict):
        meta_p, meta_o = plain["meta_info"], ours["meta_info"]
        found += differences(meta_p.get("input_token_logprobs"), meta_o.get("input_token_logprobs"), tol)
        found += differences(meta_p["prompt_tokens"], meta_o["prompt_tokens"], tol)
    elif case.route != GENERATE:
        found += differences(plain["usage"]["prompt_tokens"], ours["usage"]["prompt_tokens"], tol)
        if case.body.get("echo"):
            n = _prompt_len(plain, case)
            lp_p, lp_o = plain["choices"][0]["logprobs"], ours["choices"][0]["logprobs"]
            found += differences(lp_p["token_logprobs"][:n], lp_o["token_logprobs"][:n], tol)
    if case.greedy and not case.body.get("echo") and isinstance(plain, dict) and "logit_bias" not in case.body:
        keep = _uncompressed_tokens(case, _prompt_len(plain, case))
        route = case.route
        p_tokens, o_tokens = output_tokens(plain, route)[:keep], output_tokens(ours, route)[:keep]
        if p_tokens and o_tokens and p_tokens[: len(o_tokens)] != o_tokens[: len(p_tokens)]:
            found.append(f"first {keep} tokens: {p_tokens} != {o_tokens}")
    return found


def _lengths_free(response: Any) -> Any:
    """A response with what a compressed cache may change the length of left out: the generated
    tokens and everything per generated token (a greedy answer may end elsewhere)."""
    per_token = {"output_token_logprobs", "output_top_logprobs", "output_ids", "content", "tokens", "logprobs",
                 "token_logprobs", "top_logprobs", "text_offset", "weight_versions"}
    if isinstance(response, dict):
        return {k: (None if k in per_token and isinstance(v, list) else _lengths_free(v)) for k, v in response.items()}
    if isinstance(response, list):
        return [_lengths_free(v) for v in response]
    return response


def test_models_and_server_info_as_plain_sglang(servers) -> None:
    plain, ours = servers["servers"]["plain"], servers["servers"]["uniform"]
    tol = tolerance(servers["dtype"])
    assert not differences(plain.get("/v1/models").json(), ours.get("/v1/models").json(), tol)
    info_p, info_o = plain.get("/get_server_info").json(), ours.get("/get_server_info").json()
    assert set(info_p) <= set(info_o)
    for key in ("model_path", "tokenizer_path", "dtype", "context_length", "max_req_input_len", "version"):
        assert info_p.get(key) == info_o.get(key), key
