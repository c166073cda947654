"""Per-request compression settings in request bodies (see `sgl_kvc.request_settings`).

Two ways a client can ask for them:
- `kv_compression: {...}` on the OpenAI chat/completions routes: validated here and forwarded
  to the scheduler inside SGLang's `custom_params` under `CUSTOM_PARAMS_KEY`;
- `custom_params: {"sgl_kvc": {...}}` directly (or, on the native `/generate`,
  `sampling_params.custom_params`): SGLang forwards it as it is, so it is validated here too and
  a bad one is a 400 naming the field, before it can reach the scheduler.
These functions work on the parsed body; `sgl_kvc.server.body_guard` calls them. They parse each
settings object once and return what they parsed (`BodySettings`): the request's later hooks in
this process read that, not its `custom_params` again.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from sgl_kvc.config import KvcConfig
from sgl_kvc.request_settings import (
    CUSTOM_PARAMS_KEY,
    FIELD,
    BodySettings,
    PromptSettings,
    RequestCompression,
    RequestSettingError,
    allocation_warning,
    json_type_name,
    multimodal_conflict,
    parse_kv_compression,
    server_conflict,
)
from sgl_kvc.server.documents import name_messages
from sgl_kvc.server.errors import format_param

CUSTOM_FIELD = f"custom_params.{CUSTOM_PARAMS_KEY}"
GENERATE_FIELD = f"sampling_params.custom_params.{CUSTOM_PARAMS_KEY}"


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


def check_custom_params(custom: Any, prefix: str, config: KvcConfig | None) -> RequestCompression | None:
    """Validate the `sgl_kvc` entry of a `custom_params` value found at `prefix` (the field
    path the client used) and return it parsed, or None where it has none; other entries are
    SGLang's or other plugins' business."""
    if custom is None:
        return None
    field = f"{prefix}.custom_params" if prefix else "custom_params"
    if not isinstance(custom, dict):
        raise RequestSettingError(field, f"{field} must be an object, got {json_type_name(custom)}")
    if CUSTOM_PARAMS_KEY not in custom:
        return None
    return check_settings_object(custom[CUSTOM_PARAMS_KEY], f"{field}.{CUSTOM_PARAMS_KEY}", config)


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


def generate_settings(data: dict, config: KvcConfig | None, multimodal: bool = False) -> BodySettings:
    """`/generate`: `sampling_params` is one object or one per prompt of a batch; each prompt's
    settings, checked. `multimodal`: the served model has a multimodal processor (media in the body
    reach its prompt). A refusal names the prompt's own field (`sampling_params[1]...`); what later
    hooks refuse names `GENERATE_FIELD`, since they cannot tell which prompt of a batch it is."""
    params = data.get("sampling_params")
    media = multimodal and any(data.get(name) not in (None, [], "") for name in GENERATE_MEDIA)
    batch = isinstance(params, list) and bool(params)
    prompts = []
    for i, one in enumerate(params if batch else [params]):
        # other shapes are left to SGLang's own validation: the server's settings
        custom = one.get("custom_params") if isinstance(one, dict) else None
        prefix = (format_param(["sampling_params", i]) or "sampling_params") if batch else "sampling_params"
        settings = check_custom_params(custom, prefix, config) if isinstance(one, dict) else None
        if media:
            _check_media(settings or RequestCompression(), config, f"{prefix}.custom_params.{CUSTOM_PARAMS_KEY}")
        carried = None if settings is None else custom[CUSTOM_PARAMS_KEY]
        prompts.append(PromptSettings(settings or RequestCompression(), GENERATE_FIELD, carried))
    return BodySettings(prompts)


def body_warning(body: BodySettings, config: KvcConfig | None) -> str | None:
    """The allocation warning (`request_settings.allocation_warning`) of a checked body's
    compression settings (on `/generate`, any prompt's of a batch), or None."""
    return next((w for p in body.prompts if (w := allocation_warning(p.settings, config))), None)


def openai_settings(data: dict, config: KvcConfig | None, chat: bool = False,
                    multimodal: bool = False) -> tuple[BodySettings, bool]:
    """Chat/completions body: validate `custom_params.sgl_kvc`, then move a `kv_compression`
    object into `custom_params` (it wins over a direct one). On the chat route a document named
    by messages gets its message count (`server/documents.py`; its tokens are counted from SGLang's
    own prompt of the request, `adapter/documents/chat_documents.py`). `multimodal`: the served model has
    a multimodal processor (a chat message's image, video or audio parts reach its prompt). The
    request's settings, and True when `data` was changed."""
    custom = data.get("custom_params")
    direct = check_custom_params(custom, "", config)
    media = multimodal and chat and chat_media(data) is not None
    if FIELD not in data:
        field = FIELD if direct is None else CUSTOM_FIELD
        settings = direct or RequestCompression()
        if media:
            _check_media(settings, config, field)
        carried = None if direct is None else custom[CUSTOM_PARAMS_KEY]
        return BodySettings([PromptSettings(settings, field, carried)]), False
    settings = check_settings_object(data.pop(FIELD), FIELD, config, chat)
    if media:
        _check_media(settings, config, FIELD)
    if chat and settings.document is not None:
        settings = replace(settings, document=name_messages(data, settings.document, f"{FIELD}.document"))
    carried = settings.to_custom_params()
    data["custom_params"] = {**(custom or {}), CUSTOM_PARAMS_KEY: carried}
    return BodySettings([PromptSettings(settings, FIELD, carried)]), True
