"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}`.

SGLang answers errors with a flat `{"object": "error", "message", "type", "param", "code"}`;
for a malformed body its message embeds pydantic's repr and a server file path, and routing
errors (unknown path, wrong method) are FastAPI's `{"detail": ...}`. OpenAI's API (and so every
client written against it) uses the `error` envelope with a message a person can act on. This
module:
- turns pydantic validation errors into one human sentence and a `param` naming the field as the
  client sent it (`describe_validation_errors`; also used by `sgl_kvc.server.body_guard`), on the
  OpenAI routes and on SGLang's native `/generate`;
- answers 404/405 with the envelope on every path, and any uncaught exception with a JSON 500
  that carries no Python text (the traceback still goes to the server log);
- wraps SGLang's flat error bodies on the OpenAI routes and `/generate` into the envelope (an ASGI
  middleware, so streamed responses pass through untouched), naming the field of a refusal where
  its message says which (`refusal_param`).
SGLang's other native routes, `/v1/messages` (Anthropic format) and `/v1/responses` keep their
formats for validation errors.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Awaitable, Callable, Mapping, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sgl_kvc.request_settings import json_type_name

logger = logging.getLogger(__name__)

OPENAI_PREFIXES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/embeddings")
# SGLang's native generate route: its validation errors otherwise carry a server file path.
NATIVE_ROUTES = ("/generate",)
INTERNAL_ERROR_MESSAGE = (
    "The server had an error while processing your request; the server log has the details."
)
# The prefix of SGLang's OpenAI handlers' catch-all message (`serving_base.handle_request`).
SGLANG_CATCH_ALL = "Internal server error:"
_MAX_MESSAGE = 500
# A refusal of sgl-kvc's raised inside SGLang's handlers (which pass on a ValueError's message only:
# `adapter/scheduling/request_guard.py`, `adapter/documents/chat_documents.py`) or in its scheduler (unquoted there)
# names its field as the message's start.
_NAMED_PARAM = re.compile(r"Invalid '([A-Za-z_][\w.\[\]]*)': |Invalid ((?:kv_compression|custom_params\.sgl_kvc)[\w.]*): ")
# SGLang's own refusals that name no field (OpenAI's clients read `param`), and the field each is
# about: `prompt` and `max_tokens` as the request's client named them (`body_guard.client_fields`).
_SGLANG_REFUSALS = (
    (re.compile(r"The input \(\d+ tokens\) is longer than the model's context length"), "prompt"),
    (re.compile(r"Input length \(\d+ tokens\) exceeds the maximum allowed length"), "prompt"),
    (re.compile(r"Requested token count exceeds the model's maximum context length"), "max_tokens"),
    (re.compile(r"logprob_start_len=-?\d+ is higher than the number of input tokens"), "logprob_start_len"),
    (re.compile(r"LoRA adapter .* was requested, but LoRA is not enabled"), "lora_path"),
    (re.compile(r"^The system message should be a single text"), "prompt"),  # a conversation template's
    # `/generate`'s shapes (`GenerateReqInput.normalize_batch_and_arguments`): the field is named
    (re.compile(r"^(?:Every |The )?(text|input_ids|input_embeds|lora_path|rid|extra_key|cache_salt) should be",
                re.IGNORECASE), None),
    (re.compile(r"^Cannot use list (\w+) with parallel_sample_num"), None),
)
# The scope key under which `body_guard` leaves the names the client gave its prompt and output
# length (`client_fields`).
FIELDS_SCOPE_KEY = "sgl_kvc.fields"
_DEFAULT_FIELDS = {
    "/v1/chat/completions": {"prompt": "messages", "max_tokens": "max_tokens"},
    "/v1/completions": {"prompt": "prompt", "max_tokens": "max_tokens"},
    "/generate": {"prompt": "text", "max_tokens": "sampling_params.max_new_tokens"},
}
# On SGLang's native `/generate` a client sends sgl-kvc's settings in its sampling parameters.
_GENERATE_SETTINGS = "sampling_params.custom_params.sgl_kvc"
_NO_BODY = object()


def is_openai_path(path: str) -> bool:
    return path.startswith(OPENAI_PREFIXES)


def error_type(status: int) -> str:
    """OpenAI's `type` for a status: clients branch on it, not on SGLang's free-form names."""
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(
    status: int, message: str, *, type_: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": type_ or error_type(status),
            "param": param,
            "code": status,
        }
    }


def openai_error(
    status: int,
    message: str,
    *,
    type_: str = "invalid_request_error",
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content=error_body(status, message, type_=type_, param=param),
        headers=dict(headers) if headers else None,
    )


# ---------------------------------------------------------------- validation errors, humanized

_EXPECTED = {
    "int": "an integer",
    "float": "a number",
    "decimal": "a number",
    "string": "a string",
    "str": "a string",
    "bool": "a boolean",
    "list": "an array",
    "tuple": "an array",
    "set": "an array",
    "frozen_set": "an array",
    "dict": "an object",
    "model": "an object",
    "model_attributes": "an object",
    "dataclass": "an object",
    "typed_dict": "an object",
    "none_required": "null",
}
_TYPE_ERROR = re.compile(r"^(?P<kind>[a-z_]+?)_(type|parsing|from_float)$")


def format_param(path: Sequence[str | int]) -> str | None:
    """`("messages", 0, "role")` -> `messages[0].role` (the field as the client wrote it)."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or None


def _client_path(loc: Sequence[Any], body: Any) -> list[str | int]:
    """The part of a pydantic error location that names the client's own fields.

    Pydantic puts union member names (`list[int]`, `function-after[validate_...(), Model]`,
    model class names) into locations; they are internals, and the body itself tells which
    parts are the client's keys and indices.
    """
    loc = list(loc)
    if loc and loc[0] == "body":
        loc = loc[1:]
    out: list[str | int] = []
    node = body
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        if node is _NO_BODY:
            # No body to walk (should not happen): keep what looks like a plain key/index.
            if isinstance(part, int) or (isinstance(part, str) and part.isidentifier()):
                out.append(part)
            continue
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            out.append(part)
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            out.append(part)
            node = node[part]
        elif last and isinstance(node, dict) and isinstance(part, str) and part.isidentifier():
            out.append(part)  # a missing (required) field of an object the client sent
        # else: a union member or validator name: skip it
    return out


def _strip_prefix(msg: str) -> str:
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix) :]
    return msg.strip()


def _expected(err: Mapping[str, Any]) -> str | None:
    kind = str(err.get("type", ""))
    if kind in _EXPECTED:
        return _EXPECTED[kind]
    m = _TYPE_ERROR.match(kind)
    if m and m.group("kind") in _EXPECTED:
        return _EXPECTED[m.group("kind")]
    return None


def _sentence(text: str) -> str:
    text = text.strip()
    if len(text) > _MAX_MESSAGE:
        text = text[:_MAX_MESSAGE] + "..."
    return text if text.endswith((".", "?", "!")) else text + "."


def describe_validation_errors(
    errors: Sequence[Mapping[str, Any]], body: Any = _NO_BODY
) -> tuple[str, str | None]:
    """One human message and the `param` it is about, from pydantic/FastAPI errors.

    Only the first field with a problem is described (as OpenAI does); a union that failed
    in every member (several errors for one field) reads as one "expected A or B" sentence.
    """
    if not errors:
        return "The request body is not valid for this endpoint.", None
    first = errors[0]
    loc = list(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return "We could not parse the JSON body of your request: it is not valid JSON.", None
    if loc and loc[0] in ("header", "query", "path", "cookie"):
        where = {"header": "header", "query": "query parameter"}.get(loc[0], loc[0])
        name = str(loc[-1])
        detail = _strip_prefix(str(first.get("msg", "")))
        return _sentence(f"Invalid {where} '{name}': {detail}"), name

    path = _client_path(loc, body)
    param = format_param(path)
    same = [e for e in errors if _client_path(e.get("loc", ()), body) == path]
    shown = param or "request body"

    if first.get("type") == "missing":
        return f"Missing required parameter: '{shown}'.", param
    if first.get("type") == "extra_forbidden":
        return f"Unrecognized request argument supplied: '{shown}'.", param
    if first.get("type") == "int_parsing_size":
        return f"Invalid '{shown}': the integer is too large.", param
    if first.get("type") == "literal_error":
        expected = (first.get("ctx") or {}).get("expected")
        if expected:
            return _sentence(f"Invalid value for '{shown}': expected {expected}"), param

    expected = [_expected(e) for e in same]
    if all(expected):
        names = list(dict.fromkeys(expected))  # keep order, drop repeats
        got = json_type_name(first.get("input")) if "input" in first else None
        sentence = f"Invalid type for '{shown}': expected {' or '.join(names)}"
        if got and got not in names:
            sentence += f", but got {got} instead"
        return _sentence(sentence), param
    # A value error raised by a validator (SGLang's messages are written for people), or one
    # of pydantic's constraint messages ("Input should be greater than 0").
    for e in same:
        if _expected(e) is None:
            detail = _strip_prefix(str(e.get("msg", "")))
            return _sentence(f"Invalid value for '{shown}': {detail}"), param
    return _sentence(f"Invalid value for '{shown}'"), param


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    body = getattr(exc, "body", _NO_BODY)
    message, param = describe_validation_errors(exc.errors(), body)
    return openai_error(400, message, param=param)


# ------------------------------------------------------------------- envelope for flat errors


def refusal_param(message: str, path: str, fields: Mapping[str, str] | None = None) -> str | None:
    """The field a 400's `message` is about, as the client of `path` named it, or None: sgl-kvc's
    refusals name it at their start; SGLang's own, found by `tests/hostile_documents.py` without
    one (a prompt past the context or the longest input, an output past the context, a
    `logprob_start_len` past the prompt, a LoRA adapter on a server without LoRA), by the table."""
    named = _NAMED_PARAM.match(message)
    if named:
        param = named.group(1) or named.group(2)
        if path in NATIVE_ROUTES:  # sgl-kvc's settings as a `/generate` client sends them
            for prefix in ("kv_compression", "custom_params.sgl_kvc"):
                if param == prefix or param.startswith(prefix + "."):
                    return _GENERATE_SETTINGS + param[len(prefix):]
        return param
    names = {**_DEFAULT_FIELDS.get(path, {}), **(fields or {})}
    for pattern, what in _SGLANG_REFUSALS:
        found = pattern.search(message)
        if found:
            return found.group(1).lower() if what is None else names.get(what, what)
    return None


class OpenAIErrorEnvelope:
    """Rewrite flat SGLang JSON error bodies on OpenAI routes and `/generate` into
    `{"error": {...}}`, naming the field of a refusal where the message says it."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not (is_openai_path(path) or path in NATIVE_ROUTES):
            await self.app(scope, receive, send)
            return
        fields = scope.get(FIELDS_SCOPE_KEY)
        held: dict[str, Any] = {}
        body = bytearray()

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                is_json = headers.get(b"content-type", b"").startswith(b"application/json")
                if message["status"] >= 400 and is_json:
                    # Only error bodies are held (they are small); anything else, streams
                    # included, goes to the client as it comes.
                    held["start"] = message
                    return
            elif message["type"] == "http.response.body" and "start" in held:
                body.extend(message.get("body", b""))
                if message.get("more_body"):
                    return
                await _send_rewritten(send, held["start"], bytes(body), path, fields)
                return
            await send(message)

        await self.app(scope, receive, send_wrapper)


def _envelope(data: Any, status: int, path: str = "", fields: Mapping[str, str] | None = None) -> Any:
    if not isinstance(data, dict):
        return data
    if isinstance(data.get("error"), dict):
        err = dict(data["error"])
    elif "message" in data:
        err = {k: data.get(k) for k in ("message", "type", "param", "code")}
    else:
        return data
    message = err.get("message")
    if isinstance(message, str) and message.startswith(SGLANG_CATCH_ALL):
        # SGLang's catch-all puts `str(exception)` of an unexpected error into the body; the
        # log has it, the client gets a sentence. (Other 5xx messages, such as a request
        # aborted with a reason, are written for clients and stay.)
        message = INTERNAL_ERROR_MESSAGE
    elif not isinstance(message, str) or not message:
        message = json.dumps(message) if message else "The request failed."
    # SGLang's types are free-form ("BadRequest", "400", "Bad Request"): OpenAI's set instead.
    param = err.get("param")
    if not isinstance(param, str):
        param = refusal_param(message, path, fields) if status == 400 else None
    return error_body(status, message, param=param)


async def _send_rewritten(send: Callable, start: dict, body: bytes, path: str = "",
                          fields: Mapping[str, str] | None = None) -> None:
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    new = _envelope(data, start["status"], path, fields)
    if new is not data:
        body = json.dumps(new).encode()
    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
    headers.append((b"content-length", str(len(body)).encode()))
    await send({**start, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# ------------------------------------------------------------------------------ installation


async def _routing_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # Starlette's router raises its own HTTPException for unknown paths and methods; SGLang's
    # handler is registered for FastAPI's subclass only, so these reached FastAPI's default
    # `{"detail": ...}`. (FastAPI's HTTPException still goes to SGLang's handler: the most
    # specific class wins.)
    status = exc.status_code
    if status == 404 and exc.detail in (None, "Not Found"):
        message = f"Invalid URL ({request.method} {request.url.path}): no such route."
    elif status == 405:
        allowed = (exc.headers or {}).get("Allow")
        message = f"Method {request.method} is not allowed on {request.url.path}" + (
            f"; allowed: {allowed}." if allowed else "."
        )
    elif status >= 500:
        message = INTERNAL_ERROR_MESSAGE
    else:
        message = str(exc.detail) if exc.detail else "The request failed."
    return openai_error(status, message, type_=error_type(status), headers=exc.headers)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    # Starlette calls this from its outermost middleware and then re-raises, so the traceback
    # is still logged by the server; the client gets JSON instead of "Internal Server Error".
    logger.error(
        "unhandled error on %s %s: %s", request.method, request.url.path, type(exc).__name__
    )
    return openai_error(500, INTERNAL_ERROR_MESSAGE, type_="server_error")


def install(app: FastAPI) -> None:
    sglang_handler = app.exception_handlers.get(RequestValidationError)

    async def handle_validation(request: Request, exc: RequestValidationError):
        path = request.url.path
        if is_openai_path(path) or path in NATIVE_ROUTES or sglang_handler is None:
            return _validation_error(exc)
        return await sglang_handler(request, exc)

    app.add_exception_handler(RequestValidationError, handle_validation)
    app.add_exception_handler(StarletteHTTPException, _routing_error)
    if Exception not in app.exception_handlers and 500 not in app.exception_handlers:
        app.add_exception_handler(Exception, _internal_error)
    app.add_middleware(OpenAIErrorEnvelope)
