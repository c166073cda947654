"""No request body can take the server down, and every bad one gets a useful OpenAI-style 4xx.

One compressing server (`--policy rkv`, demo model) receives the whole matrix: malformed JSON,
non-object bodies, deep nesting, wrong types, out-of-range sampling fields, out-of-vocabulary
prompt token ids, bad per-request compression settings sent straight in `custom_params`,
unknown routes and methods. Each answer must be the right status with
`{"error": {"message", "type", "param", "code"}}`, `param` naming the field, and a message
without Python internals; afterwards the server still serves. The `--policy none` server
(the session's `kvc_server`) checks what depends on the policy.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import openai
import pytest
import requests

from loadtest.server import ServerProcess

pytestmark = pytest.mark.e2e

HI = [{"role": "user", "content": "hi"}]
OOV = 999_999  # the demo model has a few thousand tokens; real ones well under a million

# Text that means Python or pydantic leaked into a message meant for a person.
LEAKS = re.compile(
    r"Traceback|File \"|\.py\b|line \d+ column|\(char \d+\)|NoneType|Value error,|validator|"
    r"function-after|list\[int\]|range\(\)|pydantic|dictionary or object to extract|"
    r"RecursionError|IndexError|AttributeError|object has no attribute|invalid literal"
)


def chat(**kw: Any) -> dict:
    return {"model": "m", "messages": HI, "max_tokens": 2, **kw}


def comp(**kw: Any) -> dict:
    return {"model": "m", "prompt": "hi", "max_tokens": 2, **kw}


def gen(**kw: Any) -> dict:
    return {"text": "hi", "sampling_params": {"max_new_tokens": 2}, **kw}


def gen_sp(**sp: Any) -> dict:
    return {"text": "hi", "sampling_params": {"max_new_tokens": 2, **sp}}


def kvc(value: Any) -> dict:
    return {"custom_params": {"sgl_kvc": value}}


CHAT, COMP, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
DEEP = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
DEEP_OK_FOR_JSON = b'{"model": "m", "prompt": "hi", "custom_params": ' + b'{"a": ' * 200 + b"1" + b"}" * 201

# (case id, method, path, body: dict | bytes | None, status, param: str | None)
MATRIX: list[tuple[str, str, str, Any, int, str | None]] = [
    # -- bodies that are not a JSON object
    ("invalid-json-chat", "POST", CHAT, b"{not json", 400, None),
    ("invalid-json-comp", "POST", COMP, b'{"model": "m", "prompt": "hi",', 400, None),
    ("invalid-json-generate", "POST", GEN, b"{bad", 400, None),
    ("empty-body", "POST", CHAT, b"", 400, None),
    ("not-utf8", "POST", CHAT, b'{"model": "\xff\xfe"}', 400, None),
    ("nan-literal", "POST", CHAT, b'{"model": "m", "messages": [], "temperature": NaN}', 400, None),
    ("array-chat", "POST", CHAT, b"[]", 400, None),
    ("null-chat", "POST", CHAT, b"null", 400, None),
    ("string-chat", "POST", CHAT, b'"hello"', 400, None),
    ("number-chat", "POST", CHAT, b"42", 400, None),
    ("array-comp", "POST", COMP, b'[{"prompt": "hi"}]', 400, None),
    ("null-comp", "POST", COMP, b"null", 400, None),
    ("array-generate", "POST", GEN, b"[]", 400, None),
    ("deep-nesting-chat", "POST", CHAT, DEEP, 400, None),
    ("deep-nesting-comp", "POST", COMP, DEEP_OK_FOR_JSON, 400, None),
    # -- wrong types, missing fields
    ("missing-messages", "POST", CHAT, {"model": "m"}, 400, "messages"),
    ("missing-prompt", "POST", COMP, {"model": "m"}, 400, "prompt"),
    ("messages-not-list", "POST", CHAT, {"model": "m", "messages": "hi"}, 400, "messages"),
    ("bad-role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
    ("prompt-number", "POST", COMP, comp(prompt=5), 400, "prompt"),
    ("n-string", "POST", CHAT, chat(n="many"), 400, "n"),
    ("temperature-string", "POST", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("logprobs-string", "POST", COMP, comp(logprobs="all"), 400, "logprobs"),
    ("response-format-string", "POST", CHAT, chat(response_format="json"), 400, None),
    ("custom-params-list", "POST", CHAT, chat(custom_params=[1]), 400, "custom_params"),
    ("huge-integer", "POST", COMP, comp(max_tokens=10**30), 400, "max_tokens"),
    ("generate-wrong-type", "POST", GEN, {"text": "hi", "sampling_params": 5}, 400, "sampling_params"),
    ("logit-bias-key", "POST", CHAT, chat(logit_bias={"x": 1}), 400, "logit_bias.x"),
    ("logit-bias-value", "POST", CHAT, chat(logit_bias={"5": 1000}), 400, "logit_bias.5"),
    # -- out of OpenAI's documented ranges
    ("n-zero-chat", "POST", CHAT, chat(n=0), 400, "n"),
    ("n-zero-comp", "POST", COMP, comp(n=0), 400, "n"),
    ("n-zero-as-string", "POST", CHAT, chat(n="0"), 400, "n"),
    ("n-negative", "POST", CHAT, chat(n=-1), 400, "n"),
    ("n-zero-streamed", "POST", CHAT, chat(n=0, stream=True), 400, "n"),
    ("n-too-many", "POST", COMP, comp(n=129), 400, "n"),
    ("top-logprobs-negative", "POST", CHAT, chat(logprobs=True, top_logprobs=-1), 400, "top_logprobs"),
    ("top-logprobs-1000", "POST", CHAT, chat(logprobs=True, top_logprobs=1000), 400, "top_logprobs"),
    ("logprobs-negative", "POST", COMP, comp(logprobs=-1), 400, "logprobs"),
    ("logprobs-1000", "POST", COMP, comp(logprobs=1000), 400, "logprobs"),
    ("best-of-zero", "POST", COMP, comp(best_of=0), 400, "best_of"),
    ("best-of-below-n", "POST", COMP, comp(best_of=1, n=2), 400, "best_of"),
    ("temperature-high", "POST", CHAT, chat(temperature=2.5), 400, "temperature"),
    ("temperature-negative", "POST", COMP, comp(temperature=-0.5), 400, "temperature"),
    ("top-p-high", "POST", CHAT, chat(top_p=1.5), 400, "top_p"),
    ("max-tokens-zero-chat", "POST", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative-chat", "POST", CHAT, chat(max_tokens=-5), 400, "max_tokens"),
    ("max-completion-tokens-zero", "POST", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("max-tokens-zero-comp", "POST", COMP, comp(max_tokens=0), 400, "max_tokens"),
    ("presence-penalty", "POST", CHAT, chat(presence_penalty=3), 400, "presence_penalty"),
    ("frequency-penalty", "POST", COMP, comp(frequency_penalty=-3), 400, "frequency_penalty"),
    # -- prompt token ids outside the vocabulary (each killed the server before)
    ("oov-prompt", "POST", COMP, comp(prompt=[OOV]), 400, None),
    ("negative-token-id", "POST", COMP, comp(prompt=[-1]), 400, None),
    ("oov-nested-prompt", "POST", COMP, comp(prompt=[[1, 2], [3, OOV]]), 400, None),
    ("oov-streamed-prompt", "POST", COMP, comp(prompt=[OOV], stream=True), 400, None),
    ("oov-chat-input-ids", "POST", CHAT, chat(input_ids=[5, OOV]), 400, None),
    ("oov-generate", "POST", GEN, {"input_ids": [OOV], "sampling_params": {"max_new_tokens": 2}}, 400, "input_ids"),
    ("oov-generate-streamed", "POST", GEN,
     {"input_ids": [-1], "stream": True, "sampling_params": {"max_new_tokens": 2}}, 400, "input_ids"),
    ("oov-generate-batch", "POST", GEN,
     {"input_ids": [[1, 2], [OOV]], "sampling_params": {"max_new_tokens": 2}}, 400, "input_ids[1]"),
    # -- per-request compression settings sent straight in custom_params
    ("kvc-policy-bogus-chat", "POST", CHAT, chat(**kvc({"policy": "bogus"})), 400, "custom_params.sgl_kvc.policy"),
    ("kvc-policy-bogus-comp", "POST", COMP, comp(**kvc({"policy": "bogus"})), 400, "custom_params.sgl_kvc.policy"),
    ("kvc-budget-string", "POST", CHAT, chat(**kvc({"budget": "x"})), 400, "custom_params.sgl_kvc.budget"),
    ("kvc-budget-negative", "POST", COMP, comp(**kvc({"budget": -5})), 400, "custom_params.sgl_kvc.budget"),
    ("kvc-budget-float", "POST", CHAT, chat(**kvc({"budget": 1.5})), 400, "custom_params.sgl_kvc.budget"),
    ("kvc-budget-bool", "POST", COMP, comp(**kvc({"budget": True})), 400, "custom_params.sgl_kvc.budget"),
    ("kvc-unknown-key", "POST", CHAT, chat(**kvc({"policy": "rkv", "ratio": 2})), 400, "custom_params.sgl_kvc.ratio"),
    ("kvc-list", "POST", COMP, comp(**kvc(["rkv"])), 400, "custom_params.sgl_kvc"),
    ("kvc-null", "POST", CHAT, chat(**kvc(None)), 400, "custom_params.sgl_kvc"),
    ("kvc-generate-policy", "POST", GEN, gen_sp(custom_params={"sgl_kvc": {"policy": "bogus"}}), 400,
     "sampling_params.custom_params.sgl_kvc.policy"),
    ("kvc-generate-budget", "POST", GEN, gen_sp(custom_params={"sgl_kvc": {"budget": "x"}}), 400,
     "sampling_params.custom_params.sgl_kvc.budget"),
    ("kvc-generate-batch", "POST", GEN,
     {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 2},
                                              {"max_new_tokens": 2, "custom_params": {"sgl_kvc": [1]}}]},
     400, "sampling_params[1].custom_params.sgl_kvc"),
    ("kvc-generate-custom-not-object", "POST", GEN, gen_sp(custom_params="rkv"), 400, "sampling_params.custom_params"),
    # -- routing
    ("unknown-route-get", "GET", "/v1/no-such-thing", None, 404, None),
    ("unknown-route-post", "POST", "/v1/chat/complete", chat(), 404, None),
    ("wrong-method-chat", "GET", CHAT, None, 405, None),
    ("wrong-method-comp", "DELETE", COMP, None, 405, None),
]


# Prompts read in chunks of 256; a request waits at most 50 ms for another to publish the shared
# document it declares (`test_no_request_waits_behind_another_tenants_document_past_the_bound`).
CHUNK, DOCUMENT_WAIT = 256, 0.05


@pytest.fixture(scope="module")
def rkv_server():
    cmd = [sys.executable, "-m", "sgl_kvc.launch", "--model-path", "demo", "--policy", "rkv",
           "--chunked-prefill-size", str(CHUNK), "--kv-document-wait", str(DOCUMENT_WAIT)]
    with ServerProcess.launch(cmd) as server:
        yield server


def send(server: ServerProcess, method: str, path: str, body: Any) -> requests.Response:
    kw: dict[str, Any] = {}
    if isinstance(body, bytes):
        kw = {"data": body, "headers": {"content-type": "application/json"}}
    elif body is not None:
        kw = {"json": body}
    return requests.request(method, server.url + path, timeout=60, **kw)


def assert_error(r: requests.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("application/json"), r.headers["content-type"]
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == status and err["param"] == param, err
    assert err["type"] == "invalid_request_error", err
    message = err["message"]
    assert isinstance(message, str) and len(message) > 10, err
    assert not LEAKS.search(message), f"internals in message: {message!r}"
    return err


@pytest.mark.parametrize(
    "method, path, body, status, param", [c[1:] for c in MATRIX], ids=[c[0] for c in MATRIX]
)
def test_hostile_request_gets_openai_error(rkv_server, method, path, body, status, param) -> None:
    assert_error(send(rkv_server, method, path, body), status, param)


def test_messages_say_what_is_wrong(rkv_server) -> None:
    msg = lambda body, path=CHAT: send(rkv_server, "POST", path, body).json()["error"]["message"]  # noqa: E731
    assert "20" in msg(chat(logprobs=True, top_logprobs=1000)) and "1000" in msg(chat(logprobs=True, top_logprobs=1000))
    assert "JSON object" in msg(b"[]") and "array" in msg(b"[]")
    assert "not valid JSON" in msg(b"{not json")
    assert "nested too deeply" in msg(DEEP)
    assert "null" in msg(chat(**kvc(None)))  # JSON's name for it, not Python's
    assert str(OOV) in msg(comp(prompt=[OOV]), COMP)
    assert "POST /v1/chat/complete" in send(rkv_server, "POST", "/v1/chat/complete", {}).json()["error"]["message"]
    r = send(rkv_server, "GET", CHAT, None)
    assert "POST" in r.json()["error"]["message"] and r.headers.get("allow") == "POST"


def test_openai_client_gets_bad_request_with_param(rkv_server) -> None:
    client = openai.OpenAI(base_url=rkv_server.url + "/v1", api_key="none", max_retries=0)
    for kwargs, param in [
        ({"n": 0}, "n"),
        ({"logprobs": True, "top_logprobs": 1000}, "top_logprobs"),
        ({"extra_body": kvc({"policy": "bogus"})}, "custom_params.sgl_kvc.policy"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="m", messages=HI, max_tokens=2, **kwargs)
        assert info.value.param == param, info.value.body
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt=[OOV], max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.post("/no-such-route", cast_to=object, body={})


def test_valid_edge_values_are_accepted(rkv_server) -> None:
    for path, body in [
        (CHAT, chat(n=2, temperature=2, top_p=1, logprobs=True, top_logprobs=20, presence_penalty=-2)),
        (COMP, comp(n=2, best_of=2, logprobs=5, temperature=0, frequency_penalty=2)),
        (CHAT, chat(logit_bias={"5": -100}, max_completion_tokens=1)),
        (CHAT, chat(**kvc({"policy": "snapkv", "budget": 16}))),
        (COMP, comp(prompt=[[1, 2, 3], [4, 5]], **kvc({"policy": "none"}))),
        (GEN, {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, **kvc({"budget": 16})}}),
        (GEN, gen_sp(custom_params={"other_plugin": [1, 2]})),
    ]:
        r = send(rkv_server, "POST", path, body)
        assert r.status_code == 200, (path, body, r.text[:300])


def test_streaming_passes_through_and_disconnects_leave_nothing_running(rkv_server) -> None:
    body = chat(max_tokens=4, stream=True, **kvc({"policy": "rkv", "budget": 16}))
    r = send(rkv_server, "POST", CHAT, body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line for line in r.text.split("\n") if line.startswith("data: ")]  # not splitlines: U+2028 in a token
    assert events[-1] == "data: [DONE]"
    # An error chunk has an "error" key; a generated token may well contain the word itself.
    assert all("error" not in json.loads(e[len("data: "):]) for e in events[:-1])
    # Clients that hang up mid-stream: their requests are aborted, not left running.
    long = chat(max_tokens=2000, stream=True, ignore_eos=True)
    for _ in range(3):
        with requests.post(rkv_server.url + CHAT, json=long, stream=True, timeout=60) as s:
            lines = s.iter_lines()
            for _ in range(3):
                next(lines)
    assert rkv_server.wait_idle(timeout_s=60)["requests"]["running"] == 0


def test_policy_none_server_refuses_oov_and_compression_settings(kvc_server) -> None:
    assert_error(send(kvc_server, "POST", COMP, comp(prompt=[OOV])), 400, None)
    assert_error(send(kvc_server, "POST", GEN, {"input_ids": [-1]}), 400, "input_ids")
    err = assert_error(send(kvc_server, "POST", CHAT, chat(**kvc({"policy": "rkv"}))), 400,
                       "custom_params.sgl_kvc.policy")
    assert "--policy none" in err["message"]
    # per-request "none" is what such a server does anyway
    assert send(kvc_server, "POST", COMP, comp(**kvc({"policy": "none"}))).status_code == 200
    assert send(kvc_server, "GET", "/health", None).status_code == 200


def test_no_request_waits_behind_another_tenants_document_past_the_bound(rkv_server) -> None:
    """A request waits for another's publication of its document at most --kv-document-wait (50 ms
    here). On this server documents are cut between chunks: a first request with a prompt of its
    own choosing (40 chunks past the document) read whole, as it asks for its last prompt token's
    log-probability, publishes nothing (`DocumentPlan.publishes_whole`: it would keep other entries
    than the key's cuts), so it holds no one back: another tenant's request of the same document,
    in the same batch, publishes it itself, at once. Where the publisher reads the document itself
    in 40 chunks (a document that long), the waiter stops waiting after 50 ms (`waited_out`); SGLang,
    reading one prompt in chunks at a time, admits it beside the publisher's last chunk, by when the
    document is out: it starts from it. Before, a waiter waited until the publisher had read its
    whole prompt, whatever its length. A later request starts from each document; the pool adds up."""
    import random

    rng = random.Random(60)
    doc = [rng.randrange(10, 2000) for _ in range(128)]
    long = doc + [rng.randrange(10, 2000) for _ in range(40 * CHUNK + 60 - len(doc))]
    question = [rng.randrange(10, 2000) for _ in range(16)]

    def sampling(n: int, tokens: int) -> dict:
        document = {"prompt_policy": "streamingllm", "document": {"tokens": tokens, "ratio": 0.3}}
        return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True, **kvc(document)}

    before = rkv_server.stats()["documents"]
    r = send(rkv_server, "POST", GEN, {
        "input_ids": [long, doc + question], "sampling_params": [sampling(2, len(doc)), sampling(4, len(doc))],
        "return_logprob": [True, False], "logprob_start_len": [len(long) - 1, -1],
    })
    assert r.status_code == 200, r.text[:300]
    reader, other = r.json()
    assert len(reader["meta_info"]["input_token_logprobs"]) == 1 and len(other["output_ids"]) == 4
    after = rkv_server.stats()["documents"]
    assert after["waited_out"] == before["waited_out"], after  # no one waited behind the reader
    assert after["compressions"] == before["compressions"] + 1 and after["hits"] == before["hits"], after
    r = send(rkv_server, "POST", GEN, {"input_ids": doc + question[::-1], "sampling_params": sampling(2, len(doc))})
    assert r.status_code == 200 and r.json()["meta_info"]["cached_tokens"] == len(doc), r.text[:300]

    # a document of 40 chunks, read by its publisher in as many rounds
    before = rkv_server.stats()["documents"]
    r = send(rkv_server, "POST", GEN, {
        "input_ids": [long + question, long + question[::-1]],
        "sampling_params": [sampling(2, len(long)), sampling(2, len(long))],
    })
    assert r.status_code == 200, r.text[:300]
    # one publishes it, the other (whichever SGLang admits second) finds it out by its admission
    assert sorted(out["meta_info"]["cached_tokens"] for out in r.json()) == [0, len(long)], r.text[-300:]
    after = rkv_server.stats()["documents"]
    assert after["waited_out"] == before["waited_out"] + 1, after
    assert after["compressions"] == before["compressions"] + 1 and after["hits"] == before["hits"] + 1, after
    stats = rkv_server.wait_idle()
    assert stats["pool"]["free_tokens"] + stats["pool"]["cached_tokens"] == stats["pool"]["total_tokens"], stats


def test_server_still_serves_after_the_matrix(rkv_server) -> None:
    # Runs last in this module (pytest keeps file order): everything above hit this server.
    r = send(rkv_server, "POST", CHAT, chat(max_tokens=8, messages=[{"role": "user", "content": "still there?"}]))
    assert r.status_code == 200, r.text[:300]
    assert r.json()["choices"][0]["message"]["role"] == "assistant"
    assert send(rkv_server, "GET", "/health", None).status_code == 200
    assert rkv_server.wait_idle()["requests"]["running"] == 0
    log = rkv_server.log_path.read_text(errors="replace")
    assert "Scheduler hit an exception" not in log and "IndexError" not in log
