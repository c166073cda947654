"""Check request bodies before SGLang sees them, so that no body can crash a request handler.

An ASGI middleware on `POST /v1/chat/completions`, `POST /v1/completions` and SGLang's native
`POST|PUT /generate`. It reads the body once and answers with an OpenAI-style 4xx
(`sgl_kvc.server.errors`) when the body is:
- larger than `MAX_BODY_BYTES` (413), not JSON, nested deeper than `MAX_DEPTH`, or not a JSON
  object (SGLang's own model validators call `.get` on the body: a 500 for an array or null);
- on the OpenAI routes, not a valid request for SGLang's own pydantic model (the same model
  FastAPI validates with next; the message names the field, without pydantic internals), or
  outside OpenAI's documented ranges, which SGLang does not check (`server/openai_ranges.py`);
- carrying invalid per-request compression settings (`kv_compression`, `custom_params.sgl_kvc`;
  `sgl_kvc.server.settings`), or an `extra_key` / `cache_salt` in the namespace of sgl-kvc's
  shared documents;
- asking a server without LoRA for an adapter (`lora_path`, `model` as `base:adapter`), or, on
  `/generate`, for prompt log-probabilities from a `logprob_start_len` below -1;
- with images, video or audio for a multimodal model, compressed by a prompt policy that cannot
  score them (KVzip, per request or the server's; the scheduler refuses it too, on every entry
  point).
A good body goes on unchanged (or with `kv_compression` moved into `custom_params`); the
response, streamed or not, is untouched but for one header (`x-sgl-kvc-warning`) where the
request's prompt policy is served with less than its own allocation
(`request_settings.allocation_warning`: KVzip with uniform head budgets), so that no request loses
quality silently. Out-of-vocabulary token ids are checked later, where every entry point passes
(`sgl_kvc.adapter.scheduling.request_guard`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

import orjson

from sgl_kvc.config import KvcConfig
from sgl_kvc.request_settings import (
    REQUEST_SETTINGS, SETTINGS_SCOPE_KEY, WARNING_HEADER, BodySettings, RequestSettingError, json_type_name,
)
from sgl_kvc.server.errors import FIELDS_SCOPE_KEY, describe_validation_errors, openai_error
from sgl_kvc.server.openai_ranges import CHAT_RANGES, COMPLETION_RANGES, check_ranges, shown
from sgl_kvc.server.settings import body_warning, generate_settings, openai_settings

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"
ROUTES = {CHAT: ("POST",), COMPLETIONS: ("POST",), GENERATE: ("POST", "PUT")}
# Long prompts, token-id lists and base64 images fit easily; a body that would exhaust the
# HTTP process's memory does not.
MAX_BODY_BYTES = 64 << 20
# Real requests (chat messages, tool JSON schemas) nest a few dozen levels; SGLang walks
# bodies recursively (validation, pickling to the scheduler), so deeper ones are refused.
MAX_DEPTH = 128


class BodyError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


# -------------------------------------------------------------------------- body inspection


def _depth_exceeds(data: Any, limit: int) -> bool:
    """True when `data` nests containers deeper than `limit` (iterative: no recursion)."""
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def _request_model(route: str) -> Any:
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    return ChatCompletionRequest if route == CHAT else CompletionRequest


def _validate_openai(route: str, data: dict, body: bytes) -> None:
    from pydantic import ValidationError

    model = _request_model(route)
    try:
        # SGLang's "before" validators edit the dict they get: validate a fresh copy (parsing
        # again is faster than a deep copy), keep `data` as the client sent it.
        parsed = model.model_validate(orjson.loads(body))
    except ValidationError as e:
        message, param = describe_validation_errors(e.errors(), data)
        raise BodyError(400, message, param) from None
    except Exception:  # noqa: BLE001 - a validator that trips over an unexpected type
        # (e.g. `response_format: "json"` makes SGLang call `.get` on a string): FastAPI
        # would answer 500 with Python's text; the field is unknown here, so say what we can.
        kind = "chat completion" if route == CHAT else "completion"
        raise BodyError(
            400,
            f"The request body is not a valid {kind} request: one of its fields has the wrong "
            "type or shape (check the types against the API reference).",
        ) from None
    # __dict__, not attributes: reading the deprecated `max_tokens` attribute warns.
    problem = check_ranges(vars(parsed), CHAT_RANGES if route == CHAT else COMPLETION_RANGES, best_of=route == COMPLETIONS)
    if problem is not None:
        raise BodyError(400, *problem)


@dataclass(frozen=True)
class CheckedBody:
    """A body that passed the checks: what to forward (the client's bytes, or rewritten), what the
    client named its prompt and output length (`client_fields`), the request's compression
    settings as parsed here, once (the later hooks of the request read them), and what the
    response is to say of how the request is served (`body_warning`), or None."""

    body: bytes
    fields: dict[str, str]
    settings: BodySettings
    warning: str | None = None


def inspect_body(route: str, body: bytes, config: KvcConfig | None) -> CheckedBody:
    """The checked body, or `BodyError` for the client."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        if "depth" in str(e).lower() or "recursion" in str(e).lower():
            raise BodyError(400, _too_deep()) from None
        raise BodyError(
            400, "We could not parse the JSON body of your request: it is not valid JSON."
        ) from None
    if _depth_exceeds(data, MAX_DEPTH):
        raise BodyError(400, _too_deep())
    if not isinstance(data, dict):
        raise BodyError(
            400, f"The request body must be a JSON object, got {json_type_name(data)}."
        )
    _check_namespaces(data)
    _check_lora(route, data)
    fields = client_fields(route, data)
    try:
        if route == GENERATE:
            settings = generate_settings(data, config, multimodal=_multimodal())
            _check_generate_token_ids(data.get("input_ids"))
            _check_logprob_start(data)
            changed = False
        else:
            _validate_openai(route, data, body)
            settings, changed = openai_settings(data, config, chat=route == CHAT, multimodal=_multimodal())
    except RequestSettingError as e:
        raise BodyError(400, _sentence(f"Invalid '{e.param}': {e}"), e.param) from None
    return CheckedBody(orjson.dumps(data) if changed else body, fields, settings, body_warning(settings, config))


def _check_namespaces(data: dict) -> None:
    """`extra_key` and `cache_salt` (one value, or one per prompt of a batch) outside the namespace
    sgl-kvc's shared documents keep their tree nodes in: a 400 naming the field. (The node's key
    cannot be forged anyway, `adapter/documents.DocumentNamespace`; every other entry point is
    refused in `adapter/scheduling/request_guard.py`, without a `param`.)"""
    from sgl_kvc.adapter.documents import reserved_namespace

    for name in ("extra_key", "cache_salt"):
        value = data.get(name)
        values = value if isinstance(value, list) else [value]
        for i, one in enumerate(values):
            param = f"{name}[{i}]" if values is value else name
            message = reserved_namespace(param, one)
            if message is not None:
                raise BodyError(400, message, param)


def client_fields(route: str, data: dict) -> dict[str, str]:
    """What the client named its prompt and its output length in this body: SGLang's own refusals
    of them name no field, `sgl_kvc.server.errors` names it from these (`FIELDS_SCOPE_KEY`)."""
    if route == CHAT:
        return {"prompt": "messages",
                "max_tokens": "max_completion_tokens" if data.get("max_completion_tokens") is not None else "max_tokens"}
    if route == COMPLETIONS:
        return {"prompt": "prompt", "max_tokens": "max_tokens"}
    return {"prompt": "input_ids" if data.get("input_ids") is not None else "text",
            "max_tokens": "sampling_params.max_new_tokens"}


def _check_logprob_start(data: dict) -> None:
    """`/generate`: a `logprob_start_len` below -1 with `return_logprob` (one value, or one per
    prompt of a batch) is a 400 naming it. SGLang took it, and its scheduler loop asserted when it
    processed the prefill's log-probabilities: the server exited, plain SGLang's too (found by
    `tests/hostile_documents.py`). `adapter/scheduling/request_guard.py` refuses it on every other entry point."""
    from sgl_kvc.adapter.scheduling.request_guard import logprob_start_message

    starts, asks = data.get("logprob_start_len"), data.get("return_logprob")
    values = starts if isinstance(starts, list) else [starts]
    for i, start in enumerate(values):
        if isinstance(asks, list):
            ask = (asks[i] if i < len(asks) else None) if values is starts else any(a is True for a in asks)
        else:
            ask = asks
        param = f"logprob_start_len[{i}]" if values is starts else "logprob_start_len"
        message = logprob_start_message(ask, start, param)
        if message is not None:
            raise BodyError(400, message, param)


def _check_lora(route: str, data: dict) -> None:
    """A LoRA adapter (`lora_path`, one or one per prompt of a batch; on the OpenAI routes also
    `model` as `base:adapter`) asked of a server started without `--enable-lora`: a 400 naming the
    field. SGLang refuses it too, without naming one (and on a streamed `/generate`, as an error
    event inside a 200 stream) (found by `tests/hostile_documents.py`)."""
    manager = _tokenizer_manager()
    if manager is None or getattr(manager, "enable_lora", True):
        return
    model = data.get("model") if route != GENERATE else None
    if isinstance(model, str) and ":" in model:
        served = str(getattr(manager, "served_model_name", ""))
        adapter = None if model == served else (model[len(served) + 1:] if model.startswith(served + ":")
                                                else model.split(":", 1)[1]).strip() or None
        if adapter is not None:
            raise BodyError(400, f"Invalid 'model': it names the LoRA adapter {shown(adapter)}, but this "
                                 "server serves no LoRA adapters (it was started without --enable-lora).", "model")
    paths = data.get("lora_path")
    values = paths if isinstance(paths, list) else [paths]
    for i, path in enumerate(values):
        if isinstance(path, str) and path:
            param = f"lora_path[{i}]" if values is paths else "lora_path"
            raise BodyError(400, f"Invalid '{param}': this server serves no LoRA adapters (it was started "
                                 f"without --enable-lora), got {shown(path)}.", param)


def _tokenizer_manager() -> Any:
    """SGLang's tokenizer manager, once it is up (None before, or outside a server). Never
    imports SGLang's server from here: when it is not loaded there is no model."""
    http_server = sys.modules.get("sglang.srt.entrypoints.http_server")
    try:
        return http_server.get_global_state().tokenizer_manager
    except Exception:  # noqa: BLE001 - not started yet, or another layout: SGLang still checks
        return None


def _vocab_size() -> int | None:
    """The served model's vocabulary size, once SGLang's tokenizer manager is up."""
    manager = _tokenizer_manager()
    try:
        return None if manager is None else int(manager.model_config.vocab_size)
    except Exception:  # noqa: BLE001 - another layout: the hook still checks
        return None


def _multimodal() -> bool:
    """Whether the served model has a multimodal processor (SGLang's tokenizer manager feeds
    images, video and audio to its prompt; a text model's server ignores them)."""
    # not started yet: the scheduler still refuses such a request
    return getattr(_tokenizer_manager(), "mm_processor", None) is not None


def _check_generate_token_ids(input_ids: Any) -> None:
    """`/generate` with `input_ids`: refuse out-of-vocabulary ids with a 400 here, because a
    streamed `/generate` reports the later check (`sgl_kvc.adapter.scheduling.request_guard`, which
    covers every entry point) as an error event inside a 200 stream."""
    if not isinstance(input_ids, list) or not input_ids:
        return
    vocab = _vocab_size()
    if vocab is None:
        return
    from sgl_kvc.adapter.scheduling.request_guard import out_of_vocab_message

    batch = input_ids if isinstance(input_ids[0], list) else [input_ids]
    for i, ids in enumerate(batch):
        if not isinstance(ids, list):
            continue  # a shape SGLang's own validation refuses
        message = out_of_vocab_message(ids, vocab)
        if message is not None:
            param = f"input_ids[{i}]" if batch is input_ids else "input_ids"
            raise BodyError(400, message, param)


def _too_deep() -> str:
    return f"The request body is nested too deeply (more than {MAX_DEPTH} levels)."


def _sentence(text: str) -> str:
    return text if text.endswith(".") else text + "."


# ------------------------------------------------------------------------------ middleware


class RequestBodyGuard:
    def __init__(self, app: Callable[..., Any], config: KvcConfig | None = None) -> None:
        self.app = app
        self.config = config if config is not None else KvcConfig.from_env()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        route = scope.get("path") if scope["type"] == "http" else None
        if route not in ROUTES or scope.get("method") not in ROUTES[route] or _encoded(scope):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > MAX_BODY_BYTES:
            await _reject(scope, receive, send, BodyError(413, _too_large()))
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                # The client left before sending its body: let SGLang see the disconnect.
                await self.app(scope, _replay(b"", receive, message), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                await _reject(scope, receive, send, BodyError(413, _too_large()))
                return
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        del chunks
        try:
            checked = inspect_body(route, body, self.config)
        except BodyError as e:
            await _reject(scope, receive, send, e)
            return
        if checked.warning is not None:
            send = _with_header(send, WARNING_HEADER, checked.warning)
        scope = {**scope, FIELDS_SCOPE_KEY: checked.fields, SETTINGS_SCOPE_KEY: checked.settings}
        if checked.body is not body:
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(checked.body)).encode()))
            scope = {**scope, "headers": headers}
        # The request's task (and the tasks it starts) sees its settings; the chat conversion,
        # which SGLang runs in a thread, reads them from the scope.
        token = REQUEST_SETTINGS.set(checked.settings)
        try:
            await self.app(scope, _replay(checked.body, receive), send)
        finally:
            REQUEST_SETTINGS.reset(token)


def _with_header(send: Callable, name: str, value: str) -> Callable:
    """`send` with one more header on the response's start, streamed or not."""
    async def sending(message: dict) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (name.encode(), value.encode())]}
        await send(message)

    return sending


def _too_large() -> str:
    return f"The request body is too large (the limit is {MAX_BODY_BYTES >> 20} MiB)."


async def _reject(scope: dict, receive: Callable, send: Callable, e: BodyError) -> None:
    await openai_error(e.status, e.message, param=e.param)(scope, receive, send)


def _encoded(scope: dict) -> bool:
    # A compressed body is SGLang's to decompress (its optional decompression middleware
    # runs inside this one); it is checked by SGLang's own validation only.
    for k, v in scope.get("headers", ()):
        if k.lower() == b"content-encoding" and v.strip().lower() not in (b"", b"identity"):
            return True
    return False


def _content_length(scope: dict) -> int | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == b"content-length":
            try:
                return int(v)
            except ValueError:
                return None
    return None


def _replay(body: bytes, receive: Callable, first: dict | None = None) -> Callable:
    """A `receive` that yields the (checked) body once, then defers to the client's, so a
    disconnect during a streamed response still reaches SGLang (which aborts the request)."""
    pending = [first] if first is not None else [
        {"type": "http.request", "body": body, "more_body": False}
    ]

    async def replay() -> dict:
        if pending:
            return pending.pop()
        return await receive()

    return replay
