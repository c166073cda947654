"""A shared document named by chat messages (`kv_compression.document` on the chat route).

The scheduler knows a document by its prompt tokens (`document.tokens`, see
`sgl_kvc/adapter/documents.py`); a chat client knows it by its messages: by default every message
but the last (`document.messages` to say how many). Here, before the body reaches SGLang, the
messages are rendered with the model's chat template, without and with what follows them, and the
document's tokens are counted: the first `messages` messages must render as a prefix of the whole
conversation's prompt (true of the usual templates; one that rewrites earlier turns is refused).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

from sgl_kvc.request_settings import DocumentSpec, RequestSettingError


def count_tokens(data: dict, spec: DocumentSpec, field: str) -> DocumentSpec:
    """`spec` with `tokens` counted from the chat body `data` (unchanged if it gives tokens)."""
    if spec.tokens is not None:
        return spec
    messages = data.get("messages")
    if not isinstance(messages, list) or len(messages) < 2:
        raise RequestSettingError(field, f"{field} names the messages before the last one: the conversation needs "
                                         "at least two")
    m = len(messages) - 1 if spec.messages is None else spec.messages
    if not 1 <= m < len(messages):
        raise RequestSettingError(f"{field}.messages", f"{field}.messages must leave at least one message after the "
                                                       f"document: from 1 to {len(messages) - 1}, got {m}")
    if data.get("tools"):
        raise RequestSettingError(f"{field}.messages", f"with tools the prompt is not the messages alone: give "
                                                       f"{field}.tokens")
    tokenizer = _tokenizer()
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise RequestSettingError(f"{field}.messages", f"this server has no chat template to count the document's "
                                                       f"tokens with: give {field}.tokens")
    document = _render(tokenizer, messages[:m], field, generation=False)
    whole = _render(tokenizer, messages, field, generation=True)
    if len(document) >= len(whole) or whole[: len(document)] != document:
        raise RequestSettingError(f"{field}.messages", f"this model's chat template does not render the first {m} "
                                                       f"message(s) as the start of the prompt: give {field}.tokens")
    return replace(spec, tokens=len(document), messages=None)


def _render(tokenizer: Any, messages: list, field: str, generation: bool) -> list[int]:
    plain = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):  # text parts only
            parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            content = "".join(parts) if len(parts) == len(content) else None
        if not isinstance(content, str):
            raise RequestSettingError(f"{field}.messages", f"the document's messages must be text: give {field}.tokens")
        plain.append({"role": message.get("role"), "content": content})
    ids = tokenizer.apply_chat_template(plain, tokenize=True, add_generation_prompt=generation)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _tokenizer() -> Any:
    """SGLang's tokenizer in this (HTTP) process, once it is up; None otherwise."""
    http_server = sys.modules.get("sglang.srt.entrypoints.http_server")
    try:
        return http_server.get_global_state().tokenizer_manager.tokenizer
    except Exception:  # noqa: BLE001 - not started yet, or --skip-tokenizer-init
        return None
