"""Per-request compression settings in request bodies (see `sgl_kvc.request_settings`).

Two ways a client can ask for them:
- `kv_compression: {...}` on the OpenAI chat/completions routes: validated here and forwarded
  to the scheduler inside SGLang's `custom_params` under `CUSTOM_PARAMS_KEY`;
- `custom_params: {"sgl_kvc": {...}}` directly (or, on the native `/generate`,
  `sampling_params.custom_params`): SGLang forwards it as it is, so it is validated here too and
  a bad one is a 400 naming the field, before it can reach the scheduler.
These functions work on the parsed body; `sgl_kvc.server.body_guard` calls them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from sgl_kvc.config import KvcConfig
from sgl_kvc.request_settings import (
    CUSTOM_PARAMS_KEY,
    FIELD,
    RequestCompression,
    RequestSettingError,
    allocation_warning,
    from_custom_params,
    multimodal_conflict,
    parse_kv_compression,
    server_conflict,
)
from sgl_kvc.request_settings import json_type_name
from sgl_kvc.server.documents import name_messages
from sgl_kvc.server.errors import format_param

CUSTOM_FIELD = f"custom_params.{CUSTOM_PARAMS_KEY}"


def check_settings_object(obj: Any, field: str, config: KvcConfig | None, chat: bool = False) -> RequestCompression:
    """Validate one settings object the client knows by `field`; raise `RequestSettingError`."""
    if not isinstance(obj, dict):
        # parse_kv_compression would say so too, but with a Python class name ("NoneType").
        raise RequestSettingError(field, f"{field} must be an object, got {json_type_name(obj)}")
    settings = parse_kv_compression(obj, field=field, chat=chat)
    conflict = server_conflict(settings, config, field)
    if conflict is not None:
        raise conflict
    return settings


def check_custom_params(custom: Any, prefix: str, config: KvcConfig | None) -> None:
    """Validate the `sgl_kvc` entry of a `custom_params` value found at `prefix` (the field
    path the client used); other entries are SGLang's or other plugins' business."""
    if custom is None:
        return
    field = f"{prefix}.custom_params" if prefix else "custom_params"
    if not isinstance(custom, dict):
        raise RequestSettingError(field, f"{field} must be an object, got {json_type_name(custom)}")
    if CUSTOM_PARAMS_KEY in custom:
        check_settings_object(custom[CUSTOM_PARAMS_KEY], f"{field}.{CUSTOM_PARAMS_KEY}", config)


# Chat content parts SGLang hands a multimodal processor (`protocol.ChatCompletionMessageContent*Part`)
MEDIA_PARTS = ("image_url", "video_url", "audio_url", "input_audio")
# `/generate`'s media fields (`GenerateReqInput.contains_mm_input`)
GENERATE_MEDIA = ("image_data", "video_data", "audio_data")


def chat_media(data: dict) -> str | None:
    """The field of the first image, video or audio part of a chat body's messages, or None."""
    messages = data.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") in MEDIA_PARTS:
                return format_param(["messages", i, "content", j])
    return None


def _check_media(settings: RequestCompression, config: KvcConfig | None, field: str) -> None:
    """A multimodal request whose prompt policy cannot score it (KVzip) is a 400 naming the
    prompt policy's field (`request_settings.multimodal_conflict`)."""
    conflict = multimodal_conflict(settings, config, field)
    if conflict is not None:
        raise conflict


def check_generate_body(data: dict, config: KvcConfig | None, multimodal: bool = False) -> None:
    """`/generate`: `sampling_params` is one object or one per prompt of a batch. `multimodal`:
    the served model has a multimodal processor (media in the body reach its prompt)."""
    params = data.get("sampling_params")
    media = multimodal and any(data.get(name) not in (None, [], "") for name in GENERATE_MEDIA)
    if isinstance(params, dict):
        check_custom_params(params.get("custom_params"), "sampling_params", config)
        if media:
            _check_media(from_custom_params(params.get("custom_params")), config,
                         f"sampling_params.custom_params.{CUSTOM_PARAMS_KEY}")
    elif isinstance(params, list):
        for i, one in enumerate(params):
            if isinstance(one, dict):  # other shapes are left to SGLang's own validation
                prefix = format_param(["sampling_params", i]) or "sampling_params"
                check_custom_params(one.get("custom_params"), prefix, config)
                if media:
                    _check_media(from_custom_params(one.get("custom_params")), config,
                                 f"{prefix}.custom_params.{CUSTOM_PARAMS_KEY}")
    elif media:  # the server's own settings
        _check_media(RequestCompression(), config, f"sampling_params.custom_params.{CUSTOM_PARAMS_KEY}")


def body_warning(data: dict, config: KvcConfig | None, generate: bool) -> str | None:
    """The allocation warning (`request_settings.allocation_warning`) of a checked body's
    compression settings (on `/generate`, any prompt's of a batch), or None."""
    if generate:
        params = data.get("sampling_params")
        customs = [one.get("custom_params") if isinstance(one, dict) else None
                   for one in (params if isinstance(params, list) and params else [params])]
    else:
        customs = [data.get("custom_params")]
    for custom in customs:
        own = custom.get(CUSTOM_PARAMS_KEY) if isinstance(custom, dict) else None
        # checked already; its document decides nothing of it (and may name chat messages); a
        # shape left to SGLang's own validation counts as none (the server's settings)
        own = {k: v for k, v in own.items() if k != "document"} if isinstance(own, dict) else None
        if warning := allocation_warning(from_custom_params(None if own is None else {CUSTOM_PARAMS_KEY: own}), config):
            return warning
    return None


def apply_openai_settings(data: dict, config: KvcConfig | None, chat: bool = False,
                          multimodal: bool = False) -> bool:
    """Chat/completions body: validate `custom_params.sgl_kvc`, then move a `kv_compression`
    object into `custom_params` (it wins over a direct one). On the chat route a document named
    by messages gets its message count (`server/documents.py`; its tokens are counted from SGLang's
    own prompt of the request, `adapter/documents/chat_documents.py`). `multimodal`: the served model has
    a multimodal processor (a chat message's image, video or audio parts reach its prompt). True
    when `data` was changed."""
    check_custom_params(data.get("custom_params"), "", config)
    media = multimodal and chat and chat_media(data) is not None
    if FIELD not in data:
        if media:
            custom = data.get("custom_params")
            direct = isinstance(custom, dict) and CUSTOM_PARAMS_KEY in custom
            _check_media(from_custom_params(custom), config, CUSTOM_FIELD if direct else FIELD)
        return False
    settings = check_settings_object(data.pop(FIELD), FIELD, config, chat)
    if media:
        _check_media(settings, config, FIELD)
    if chat and settings.document is not None:
        settings = replace(settings, document=name_messages(data, settings.document, f"{FIELD}.document"))
    custom = data.get("custom_params") or {}
    data["custom_params"] = {**custom, CUSTOM_PARAMS_KEY: settings.to_custom_params()}
    return True
