"""OpenAI-style errors on the OpenAI routes.

SGLang answers errors with a flat `{"object": "error", "message", "type", "param", "code"}`
and, for malformed bodies, a message that embeds pydantic's repr and a server file path.
OpenAI's API (and so every client written against it) uses `{"error": {"message", "type",
"param", "code"}}`. On the OpenAI chat/completions/models/embeddings routes this module:
- answers body-validation errors itself: 400, `invalid_request_error`, `param` naming the field;
- wraps SGLang's flat error bodies into the `error` envelope (an ASGI middleware, so streamed
  responses pass through untouched).
Other routes (SGLang's native API, `/v1/messages`, `/v1/responses`) keep SGLang's formats.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

OPENAI_PREFIXES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/embeddings")


def is_openai_path(path: str) -> bool:
    return path.startswith(OPENAI_PREFIXES)


def openai_error(
    status: int, message: str, *, type_: str = "invalid_request_error", param: str | None = None
) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": type_, "param": param, "code": status}},
    )


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        field = ".".join(loc)
        param = param or field or None
        msg = err.get("msg", "invalid value")
        parts.append(f"{field}: {msg}" if field else msg)
    return openai_error(400, "; ".join(parts) or "invalid request body", param=param)


class OpenAIErrorEnvelope:
    """Rewrite flat SGLang JSON error bodies on OpenAI routes into `{"error": {...}}`."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or not is_openai_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        held: dict[str, Any] = {}
        body = bytearray()

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                is_json = headers.get(b"content-type", b"").startswith(b"application/json")
                if message["status"] >= 400 and is_json:
                    held["start"] = message
                    return
            elif message["type"] == "http.response.body" and "start" in held:
                body.extend(message.get("body", b""))
                if message.get("more_body"):
                    return
                await _send_rewritten(send, held["start"], bytes(body))
                return
            await send(message)

        await self.app(scope, receive, send_wrapper)


async def _send_rewritten(send: Callable, start: dict, body: bytes) -> None:
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict) and "error" not in data and "message" in data:
        data = {
            "error": {
                "message": data["message"],
                "type": data.get("type") or "invalid_request_error",
                "param": data.get("param"),
                "code": data.get("code", start["status"]),
            }
        }
        body = json.dumps(data).encode()
    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
    headers.append((b"content-length", str(len(body)).encode()))
    await send({**start, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def install(app: FastAPI) -> None:
    sglang_handler = app.exception_handlers.get(RequestValidationError)

    async def handle_validation(request: Request, exc: RequestValidationError):
        if is_openai_path(request.url.path) or sglang_handler is None:
            return _validation_error(exc)
        return await sglang_handler(request, exc)

    app.add_exception_handler(RequestValidationError, handle_validation)
    app.add_middleware(OpenAIErrorEnvelope)
