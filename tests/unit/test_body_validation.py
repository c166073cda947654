"""The HTTP layer's body checks and error messages, without a server (and without SGLang:
the OpenAI request model is replaced by a small pydantic model with the same field types)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any, List, Literal, Optional, Union

import pytest
from pydantic import BaseModel, ValidationError, field_validator

from sgl_kvc.adapter.scheduling.request_guard import out_of_vocab_message
from sgl_kvc.config import KvcConfig
from sgl_kvc.server import body_guard
from sgl_kvc.server.body_guard import (
    CHAT,
    COMPLETIONS,
    GENERATE,
    MAX_DEPTH,
    BodyError,
    RequestBodyGuard,
    inspect_body,
)
from sgl_kvc.server.errors import _envelope, describe_validation_errors
from sgl_kvc.server.openai_ranges import Range

RKV = KvcConfig(policy="rkv")
NONE = KvcConfig(policy="none")


class Message(BaseModel):
    role: Literal["user", "assistant"]
    content: str


class FakeChat(BaseModel):
    """The field types of SGLang's ChatCompletionRequest that the range checks read."""

    messages: List[Message]
    model: str = "m"
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    logit_bias: Optional[dict] = None
    custom_params: Optional[dict] = None


class FakeCompletion(BaseModel):
    prompt: Union[List[int], List[List[int]], str, List[str]]
    n: int = 1
    best_of: Optional[int] = None
    logprobs: Optional[int] = None
    max_tokens: int = 16
    custom_params: Optional[dict] = None

    @field_validator("max_tokens")
    @classmethod
    def positive(cls, v: int) -> int:
        if v <= 0:
            raise ValueError("max_tokens must be positive")
        return v


@pytest.fixture(autouse=True)
def fake_models(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        body_guard, "_request_model", lambda route: FakeChat if route == CHAT else FakeCompletion
    )


def _body(obj: Any) -> bytes:
    return obj if isinstance(obj, bytes) else json.dumps(obj).encode()


def rejected(route: str, obj: Any, config: KvcConfig = RKV) -> BodyError:
    with pytest.raises(BodyError) as info:
        inspect_body(route, _body(obj), config)
    return info.value


def chat(**kw: Any) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], **kw}


# ---------------------------------------------------------------------------- body shape


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS, GENERATE])
@pytest.mark.parametrize(
    "raw, words",
    [
        (b"{not json", "not valid JSON"),
        (b"", "not valid JSON"),
        (b'{"a": NaN}', "not valid JSON"),
        (b"[]", "got an array"),
        (b"null", "got null"),
        (b'"text"', "got a string"),
        (b"3.5", "got a number"),
        (b"[" * 5000 + b"]" * 5000, "nested too deeply"),
        (b'{"a": ' * (MAX_DEPTH + 1) + b"1" + b"}" * (MAX_DEPTH + 1), "nested too deeply"),
    ],
)
def test_bodies_that_are_not_json_objects(route: str, raw: bytes, words: str) -> None:
    e = rejected(route, raw)
    assert e.status == 400 and e.param is None and words in e.message


def test_depth_limit_is_inclusive() -> None:
    ok = b'{"custom_params": ' + b'{"a": ' * (MAX_DEPTH - 2) + b"1" + b"}" * (MAX_DEPTH - 1)
    assert inspect_body(GENERATE, ok, RKV).body == ok


# ---------------------------------------------------------------------------------- ranges


@pytest.mark.parametrize(
    "route, fields, param",
    [
        (CHAT, {"n": 0}, "n"),
        (CHAT, {"n": "0"}, "n"),  # what pydantic turns it into is what is checked
        (CHAT, {"n": 129}, "n"),
        (CHAT, {"top_logprobs": -1}, "top_logprobs"),
        (CHAT, {"top_logprobs": 21}, "top_logprobs"),
        (CHAT, {"temperature": 2.01}, "temperature"),
        (CHAT, {"top_p": 0}, "top_p"),
        (CHAT, {"max_tokens": 0}, "max_tokens"),
        (CHAT, {"max_completion_tokens": -1}, "max_completion_tokens"),
        (CHAT, {"logit_bias": {"abc": 1}}, "logit_bias.abc"),
        (CHAT, {"logit_bias": {"7": -101}}, "logit_bias.7"),
        (COMPLETIONS, {"logprobs": 6}, "logprobs"),
        (COMPLETIONS, {"best_of": 0}, "best_of"),
        (COMPLETIONS, {"best_of": 21}, "best_of"),
        (COMPLETIONS, {"best_of": 2, "n": 3}, "best_of"),
    ],
)
def test_out_of_range_fields_name_the_field(route: str, fields: dict, param: str) -> None:
    obj = chat(**fields) if route == CHAT else {"prompt": "hi", **fields}
    e = rejected(route, obj)
    assert e.status == 400 and e.param == param
    assert e.message.startswith(f"Invalid '{param.split('.')[0]}")


def test_edges_of_the_ranges_pass_unchanged() -> None:
    body = _body(chat(n=128, temperature=0, top_p=1, top_logprobs=20, max_tokens=1,
                      logit_bias={"3": 100}))
    assert inspect_body(CHAT, body, RKV).body is body
    body = _body({"prompt": [1, 2], "n": 2, "best_of": 2, "logprobs": 5})
    assert inspect_body(COMPLETIONS, body, RKV).body is body


def test_range_messages() -> None:
    assert Range("n", 1, 128, integer=True).check(0) == "an integer between 1 and 128"
    assert Range("top_p", 0, 1, lo_open=True).check(float("nan")) is not None
    assert Range("top_k", 1, None, integer=True, also=(-1,)).check(-1) is None
    assert "(or -1)" in Range("top_k", 1, None, integer=True, also=(-1,)).check(0)


# ------------------------------------------------------------------ validation messages


def _errors(model: type[BaseModel], obj: Any) -> list[dict]:
    with pytest.raises(ValidationError) as info:
        model.model_validate(obj)
    return info.value.errors()


@pytest.mark.parametrize(
    "model, obj, param, words",
    [
        (FakeChat, {}, "messages", "Missing required parameter: 'messages'"),
        (FakeChat, chat(n="many"), "n", "expected an integer, but got a string"),
        (FakeChat, {"messages": "hi"}, "messages", "expected an array"),
        (FakeChat, {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "'user' or 'assistant'"),
        (FakeChat, {"messages": [{"role": "user"}]}, "messages[0].content", "Missing required"),
        (FakeCompletion, {"prompt": 5}, "prompt", "expected an array or a string, but got an integer"),
        (FakeCompletion, {"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens must be positive"),
        # orjson reads integers past 64 bits as floats
        (FakeCompletion, {"prompt": "x", "max_tokens": 1e30}, "max_tokens", "too large"),
    ],
)
def test_validation_errors_read_like_openai(model, obj, param: str, words: str) -> None:
    message, got = describe_validation_errors(_errors(model, obj), obj)
    assert got == param
    assert words in message
    for internal in ("list[int]", "Value error", "function-after", "str]", "int_parsing"):
        assert internal not in message


def test_header_errors_name_the_header() -> None:
    errors = [{"loc": ("header", "content-type"), "msg": "Unsupported Media Type", "type": "value_error"}]
    message, param = describe_validation_errors(errors)
    assert param == "content-type" and "Unsupported Media Type" in message


# ------------------------------------------------------------------- compression settings


@pytest.mark.parametrize(
    "value, param",
    [
        ({"policy": "bogus"}, "custom_params.sgl_kvc.policy"),
        ({"budget": "x"}, "custom_params.sgl_kvc.budget"),
        ({"budget": -5}, "custom_params.sgl_kvc.budget"),
        ({"budget": 1.5}, "custom_params.sgl_kvc.budget"),
        ({"budget": True}, "custom_params.sgl_kvc.budget"),
        ({"policy": "rkv", "extra": 1}, "custom_params.sgl_kvc.extra"),
        (["rkv"], "custom_params.sgl_kvc"),
        (None, "custom_params.sgl_kvc"),
    ],
)
def test_custom_params_settings_are_validated(value: Any, param: str) -> None:
    for route, obj in [(CHAT, chat()), (COMPLETIONS, {"prompt": "hi"})]:
        e = rejected(route, {**obj, "custom_params": {"sgl_kvc": value}})
        assert e.param == param and "NoneType" not in e.message
    e = rejected(GENERATE, {"text": "hi", "sampling_params": {"custom_params": {"sgl_kvc": value}}})
    assert e.param == "sampling_params." + param
    batch = {"text": ["a", "b"], "sampling_params": [{}, {"custom_params": {"sgl_kvc": value}}]}
    assert rejected(GENERATE, batch).param == "sampling_params[1]." + param


def test_compression_needs_a_compressing_server() -> None:
    e = rejected(CHAT, chat(custom_params={"sgl_kvc": {"budget": 8}}), NONE)
    assert e.param == "custom_params.sgl_kvc.budget" and "--policy none" in e.message
    body = _body(chat(custom_params={"sgl_kvc": {"policy": "none"}, "other": [1]}))
    assert inspect_body(CHAT, body, NONE).body is body


def test_kv_compression_moves_into_custom_params() -> None:
    out = inspect_body(CHAT, _body(chat(kv_compression={"policy": "rkv", "budget": 8},
                                         custom_params={"x": 1})), RKV)
    data = json.loads(out.body)
    assert "kv_compression" not in data
    assert data["custom_params"] == {"x": 1, "sgl_kvc": {"policy": "rkv", "budget": 8}}


def test_the_documents_namespace_is_reserved() -> None:
    """An `extra_key` or `cache_salt` in the namespace of sgl-kvc's shared documents' nodes is a
    400 naming the field, on every route, one value or one per prompt; any other passes unchanged.
    Every other entry point is refused by the tokenizer manager's hook (`request_guard`)."""
    from sgl_kvc.adapter.documents import NAMESPACE
    from sgl_kvc.adapter.scheduling import request_guard

    planted = NAMESPACE + "ab" * 32
    for field in ("extra_key", "cache_salt"):
        for route, obj in [(CHAT, chat()), (COMPLETIONS, {"prompt": "hi"}), (GENERATE, {"text": "hi"})]:
            e = rejected(route, {**obj, field: planted})
            assert e.status == 400 and e.param == field and field in e.message and "reserved" in e.message
        assert rejected(GENERATE, {"text": ["a", "b"], field: ["x", planted]}).param == f"{field}[1]"
        body = _body({"text": "hi", field: "tenant-" + planted})
        assert inspect_body(GENERATE, body, RKV).body is body
        one = SimpleNamespace(**{"extra_key": None, "cache_salt": None, field: planted})
        with pytest.raises(ValueError, match=field):
            request_guard._before_validate_one_request(SimpleNamespace(), one, None)
    request_guard._before_validate_one_request(SimpleNamespace(), SimpleNamespace(extra_key="a"), None)


# ------------------------------------------------------------------------ token ids, envelope


def test_out_of_vocab_message() -> None:
    assert out_of_vocab_message([0, 5, 9], 10) is None
    assert out_of_vocab_message([], 10) is None
    assert "10" in out_of_vocab_message([1, 10], 10) and "position 1" in out_of_vocab_message([1, 10], 10)
    assert "-1" in out_of_vocab_message([-1], 10)
    assert out_of_vocab_message([1, "x"], 10) is not None


def test_flat_sglang_errors_get_the_envelope() -> None:
    flat = {"object": "error", "message": "top_p must be in (0, 1]", "type": "BadRequestError",
            "param": None, "code": 400}
    assert _envelope(flat, 400) == {"error": {"message": "top_p must be in (0, 1]",
                                              "type": "invalid_request_error", "param": None, "code": 400}}
    crashed = {"object": "error", "message": "Internal server error: 'NoneType' object", "code": 500}
    err = _envelope(crashed, 500)["error"]
    assert "NoneType" not in err["message"] and err["type"] == "server_error"
    aborted = {"object": "error", "message": "Request aborted: compression failed", "code": 500}
    assert _envelope(aborted, 500)["error"]["message"] == "Request aborted: compression failed"
    assert _envelope([1], 400) == [1]


# --------------------------------------------------------------------------- the middleware


def _run(guard: RequestBodyGuard, scope: dict, messages: list[dict]) -> tuple[list[dict], list]:
    sent: list[dict] = []
    seen: list = []
    queue = list(messages)

    async def receive() -> dict:
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    async def app(scope: dict, receive, send) -> None:
        seen.append((scope, await receive()))

    guard.app = app
    asyncio.run(guard(scope, receive, send))
    return sent, seen


def _scope(path: str = CHAT, method: str = "POST", headers: list | None = None) -> dict:
    return {"type": "http", "path": path, "method": method, "headers": headers or []}


def test_middleware_rejects_and_forwards() -> None:
    guard = RequestBodyGuard(lambda *a: None, config=RKV)
    sent, seen = _run(guard, _scope(), [{"type": "http.request", "body": b"[]"}])
    assert not seen and sent[0]["status"] == 400
    assert json.loads(sent[1]["body"])["error"]["message"].startswith("The request body must be")

    body = _body(chat(kv_compression={"budget": 8}))
    sent, seen = _run(guard, _scope(headers=[(b"content-length", str(len(body)).encode())]),
                      [{"type": "http.request", "body": body[:10], "more_body": True},
                       {"type": "http.request", "body": body[10:]}])
    scope, message = seen[0]
    forwarded = message["body"]
    assert json.loads(forwarded)["custom_params"]["sgl_kvc"] == {"budget": 8}
    assert dict(scope["headers"])[b"content-length"] == str(len(forwarded)).encode()


def test_middleware_leaves_other_requests_alone() -> None:
    guard = RequestBodyGuard(lambda *a: None, config=RKV)
    for scope in (_scope(method="GET"), _scope(path="/v1/models"),
                  _scope(headers=[(b"content-encoding", b"gzip")])):
        sent, seen = _run(guard, scope, [{"type": "http.request", "body": b"[]"}])
        assert not sent and seen[0][1]["body"] == b"[]"
    # a client that disconnects before sending its body: SGLang sees the disconnect
    sent, seen = _run(guard, _scope(), [{"type": "http.disconnect"}])
    assert not sent and seen[0][1]["type"] == "http.disconnect"


def test_middleware_refuses_huge_bodies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(body_guard, "MAX_BODY_BYTES", 100)
    guard = RequestBodyGuard(lambda *a: None, config=RKV)
    sent, seen = _run(guard, _scope(headers=[(b"content-length", b"1000")]), [])
    assert sent[0]["status"] == 413 and not seen
    chunks = [{"type": "http.request", "body": b" " * 60, "more_body": True}] * 3
    sent, seen = _run(guard, _scope(), chunks)
    assert sent[0]["status"] == 413 and not seen


def _response_headers(config: KvcConfig, path: str, obj: dict) -> dict[bytes, bytes]:
    """The headers a response to `obj` goes out with, the app answering 200 in two messages."""
    sent: list[dict] = []
    queue = [{"type": "http.request", "body": _body(obj)}]

    async def receive() -> dict:
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    async def app(scope: dict, receive, send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: {}\n\n"})

    asyncio.run(RequestBodyGuard(app, config=config)(_scope(path), receive, send))
    assert sent[0]["status"] == 200 and sent[1]["body"] == b"data: {}\n\n"
    return dict(sent[0]["headers"])


def test_kvzip_on_uniform_head_budgets_is_warned_per_request() -> None:
    """KVzip's scores need one sort over every head (docs/quality.md): a request whose prompt
    policy is KVzip, its own or the server's, on a server whose heads all keep the same number of
    entries is served with a warning header; not with per-head budgets, another prompt policy, or
    shared selection (which the client chose). The response is otherwise unchanged."""
    warning = b"x-sgl-kvc-warning"
    kvzip = {"prompt_policy": "kvzip", "document": {"ratio": 0.3}}
    layer = KvcConfig(policy="rkv", kv_head_budget="layer")
    two = [{"role": "user", "content": "a document"}, {"role": "user", "content": "a question"}]
    got = _response_headers(RKV, CHAT, chat(messages=two, kv_compression=kvzip))
    assert b"--kv-head-budget policy" in got[warning] and got[b"content-type"] == b"text/event-stream"
    assert warning in _response_headers(RKV, COMPLETIONS, {"prompt": "a b", "kv_compression": {"prompt_policy": "kvzip"}})
    assert warning in _response_headers(RKV, GENERATE, {"text": "a", "sampling_params": [
        {}, {"custom_params": {"sgl_kvc": {"prompt_policy": "kvzip"}}}]})
    server_kvzip = KvcConfig(policy="snapkv", prompt_policy="kvzip")
    assert warning in _response_headers(server_kvzip, CHAT, chat())
    for config, obj in ((layer, chat(messages=two, kv_compression=kvzip)), (RKV, chat()),
                        (RKV, chat(kv_compression={"prompt_policy": "snapkv"})),
                        (RKV, chat(kv_compression={"prompt_policy": "kvzip", "selection": "shared"})),
                        (server_kvzip, chat(kv_compression={"prompt_policy": "snapkv"}))):
        assert warning not in _response_headers(config, CHAT, obj), obj
    # shapes left to SGLang's own validation are forwarded as before, with the server's settings
    for body in ({"text": "a", "sampling_params": [1, "x", None]}, {"text": "a", "sampling_params": "x"},
                 {"text": "a", "sampling_params": []}, {"text": "a", "sampling_params": [{"custom_params": None}]}):
        assert warning in _response_headers(server_kvzip, GENERATE, body)
        assert warning not in _response_headers(RKV, GENERATE, body)


class _ChatRequest:
    """What the chat conversion reads of SGLang's `ChatCompletionRequest`."""

    def __init__(self, messages: list[dict]) -> None:
        self.messages, self.input_ids, self.continue_final_message = messages, None, False

    def model_copy(self, deep: bool = False) -> "_ChatRequest":
        return _ChatRequest([dict(m) for m in self.messages])


def _converted(serving: Any, request: _ChatRequest, raw_request: Any) -> tuple[Any, None]:
    """SGLang's conversion of a chat request, as far as the hooks read it: a token per word of
    each message, one more asking for the answer; the custom params it forwards."""
    ids = [len(w) for m in request.messages for w in m["content"].split()]
    if getattr(request, "_format_add_generation_prompt", True) is not False:
        ids.append(7)
    custom = json.loads(raw_request.body)["custom_params"]
    return SimpleNamespace(input_ids=ids, sampling_params={"max_new_tokens": 2, "custom_params": custom}), None


@pytest.mark.parametrize("document, refused", [({"ratio": 0.3}, None),
                                                ({"budget": 100}, "kv_compression.document.budget")])
def test_a_chat_turns_settings_are_parsed_once_in_the_http_process(monkeypatch, document: dict,
                                                                   refused: str | None) -> None:
    """A chat turn over a document named by messages, through the body guard, then SGLang's
    conversion (in a thread, as SGLang runs it: the document's tokens are counted there) and its
    tokenizer's check (in the request's task: the document against the prompt). The body guard
    parses the settings; the conversion counts the tokens into what it parsed and the check reads
    that, neither parses the request's custom params again (before: three parses a turn, and the
    prompt checked twice). A document that cannot be compressed is still refused naming its field."""
    from sgl_kvc import request_settings
    from sgl_kvc.adapter.documents import chat_documents
    from sgl_kvc.adapter.scheduling import request_guard
    from sgl_kvc.config import ENV_VAR
    from sgl_kvc.server import settings

    parses: list[str] = []

    def counted(obj: Any, field: str = request_settings.FIELD, chat: bool = False):
        parses.append(field)
        return real(obj, field, chat)

    real = request_settings.parse_kv_compression
    monkeypatch.setattr(request_settings, "parse_kv_compression", counted)
    monkeypatch.setattr(settings, "parse_kv_compression", counted)
    monkeypatch.setenv(ENV_VAR, json.dumps({"policy": "rkv"}))
    words = " ".join(f"w{i}" for i in range(60))
    body = _body(chat(messages=[{"role": "user", "content": words}, {"role": "user", "content": "which one?"}],
                      kv_compression={"prompt_policy": "kvzip", "document": document}))
    served: list[Any] = []

    async def sglang(scope: dict, receive, send) -> None:
        raw_request = SimpleNamespace(scope=scope, body=(await receive())["body"])
        request = _ChatRequest(json.loads(raw_request.body)["messages"])
        adapted, _ = await asyncio.get_running_loop().run_in_executor(
            None, chat_documents._around_convert, _converted, SimpleNamespace(
                template_manager=SimpleNamespace(chat_template_name=None), tokenizer_manager=SimpleNamespace()),
            request, raw_request)
        try:
            request_guard._check_document(adapted, len(adapted.input_ids))
        except ValueError as e:
            served.append(e)
        else:
            served.append(adapted)

    guard = RequestBodyGuard(lambda *a: None, config=KvcConfig(policy="rkv"))
    guard.app = sglang
    sent: list[dict] = []
    asyncio.run(guard(_scope(), lambda: _received(body), _collected(sent)))
    assert parses == ["kv_compression"], (parses, sent)
    assert served, sent
    [out] = served
    if refused is None:
        assert out.sampling_params["custom_params"]["sgl_kvc"] == {"prompt_policy": "kvzip", "document": {"tokens": 60, "ratio": 0.3}}
    else:
        assert isinstance(out, ValueError) and f"Invalid '{refused}'" in str(out), out


async def _received(body: bytes) -> dict:
    return {"type": "http.request", "body": body}


def _collected(sent: list[dict]) -> Any:
    async def send(message: dict) -> None:
        sent.append(message)

    return send
