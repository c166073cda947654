"""A shared document named by chat messages (`kv_compression.document` on the chat route).

The scheduler knows a document by its prompt tokens (`document.tokens`, see
`sgl_kvc/adapter/documents/__init__.py`); a chat client knows it by its messages: by default every message
but the last (`document.messages` to say how many). Here, before the body reaches SGLang, only the
count is checked and resolved (`document.messages` is written into the request's `custom_params`).
Nothing is rendered here: the tokens are counted from SGLang's own rendering and tokenization of
the request, off the event loop (`sgl_kvc/adapter/documents/chat_documents.py`), so that they are exactly the
tokens SGLang's prompt starts with for those messages, whatever its template, content parts, names,
tool calls or template arguments make of them.
"""

from __future__ import annotations

from dataclasses import replace

from sgl_kvc.request_settings import DocumentSpec, RequestSettingError


def name_messages(data: dict, spec: DocumentSpec, field: str) -> DocumentSpec:
    """`spec` with `messages` resolved from the chat body `data` (unchanged if it gives tokens):
    at least one message before the document's end and one after it."""
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
    return replace(spec, messages=m)
