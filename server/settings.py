"""Read the `kv_compression` object of OpenAI request bodies (see `sgl_kvc.request_settings`).

An ASGI middleware on the chat and completions routes: it validates the object, answers a bad
one with an OpenAI-style 400 naming the field, and forwards a good one to the scheduler inside
SGLang's `custom_params`. Bodies without the field pass through unchanged.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from sgl_kvc.config import KvcConfig
from sgl_kvc.request_settings import (
    CUSTOM_PARAMS_KEY,
    FIELD,
    RequestSettingError,
    parse_kv_compression,
)
from sgl_kvc.server.errors import openai_error

ROUTES = ("/v1/chat/completions", "/v1/completions")


class KvCompressionBody:
    def __init__(self, app: Callable[..., Any], config: KvcConfig | None = None) -> None:
        self.app = app
        self.config = config if config is not None else KvcConfig.from_env()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope["path"] not in ROUTES:
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay(b"", receive, message), send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        if isinstance(data, dict) and FIELD in data:
            try:
                body = self._rewrite(data)
            except RequestSettingError as e:
                await openai_error(400, str(e), param=e.param)(scope, receive, send)
                return
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
            scope = {**scope, "headers": headers + [(b"content-length", str(len(body)).encode())]}
        await self.app(scope, _replay(body, receive), send)

    def _rewrite(self, data: dict) -> bytes:
        settings = parse_kv_compression(data.pop(FIELD))
        wants = settings.policy not in (None, "none") or settings.budget is not None
        if wants and (self.config is None or not self.config.compressing):
            raise RequestSettingError(
                f"{FIELD}.policy" if settings.policy else f"{FIELD}.budget",
                "this server was started with --policy none: per-request compression needs a "
                "server started with a compressing policy (e.g. --policy rkv)",
            )
        custom = data.get("custom_params") or {}
        if not isinstance(custom, dict):
            raise RequestSettingError("custom_params", "custom_params must be an object")
        data["custom_params"] = {**custom, CUSTOM_PARAMS_KEY: settings.to_custom_params()}
        return json.dumps(data).encode()


def _replay(body: bytes, receive: Callable, first: dict | None = None) -> Callable:
    """A `receive` that yields the (rewritten) body once, then defers to the client's."""
    pending = [first] if first is not None else [
        {"type": "http.request", "body": body, "more_body": False}
    ]

    async def replay() -> dict:
        if pending:
            return pending.pop()
        return await receive()

    return replay
