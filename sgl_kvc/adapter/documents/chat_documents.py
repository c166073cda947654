"""A chat request's shared document, counted from SGLang's own tokenization of that request.

On the chat route a client names its document by messages (`kv_compression.document.messages`,
by default every message but the last; `server/documents.py` checks the count). The scheduler knows
a document by its prompt tokens, D (`adapter/documents/__init__.py`). D must be exactly the tokens SGLang's
prompt of the request starts with for those messages, or the document covers part of a message, or
of the next one, and its key names other tokens than another request's with the same messages.

So D is not counted from a rendering of sgl-kvc's own: it is counted where SGLang renders and
tokenizes the request (`OpenAIServingChat._convert_to_internal_request`, which SGLang runs in an
executor thread, off the HTTP event loop). An AROUND hook there lets SGLang build the request's
prompt ids, then renders the request's first `messages` messages through the same code path, with
every argument the same (content parts joined as SGLang joins them, `name`, `tool_calls`,
`reasoning_content`, `tools`, `chat_template_kwargs` and the server's defaults, `--chat-template`,
the reasoning settings) except that the conversation stops there and asks for no answer
(`add_generation_prompt` false; with a named conversation template, `--chat-template chatml` for
instance, SGLang's own conversation without the blank assistant turn it appends). Those ids must be
the start of the request's prompt ids; D is their count, written into the request's `custom_params`
as `document.tokens`, in place of `messages`, before the request leaves the HTTP process: into the
settings the body guard parsed (`request_settings.PromptSettings`, found in the request's ASGI
scope), which the tokenizer's check then tests against the prompt. That holds
for the usual templates as long as the client resends earlier turns as they were. Where it does not
(a template that rewrites earlier turns, as Qwen3's drops their reasoning; a tokenizer that merges
tokens across the boundary), the request declares no document: it reads its prompt whole,
compressed by its own settings, and `/v1/kvc/stats` counts it (`documents.history_rewritten`).
"""

from __future__ import annotations

from typing import Any

from sgl_kvc.adapter.sglang_api import Hook
from sgl_kvc.request_settings import (
    CUSTOM_PARAMS_KEY, FIELD, SETTINGS_SCOPE_KEY, BodySettings, PromptSettings, RequestSettingError,
)

TARGET = "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._convert_to_internal_request"
PARAM = f"{FIELD}.document.messages"
REWRITTEN_ATTR = "_sgl_kvc_history_rewritten"  # on SGLang's TokenizerManager: `count_rewritten`


def hook_table() -> list[Hook]:
    """Installed in every SGLang process; it only runs in the HTTP server's."""
    return [Hook(TARGET, _around_convert, "AROUND", ("request", "raw_request"),
                 "a chat document's tokens, counted from SGLang's own prompt of the request")]


def _request_settings(raw_request: Any) -> tuple[BodySettings, PromptSettings] | None:
    """The chat request's settings as the body guard parsed them (its ASGI scope holds them), or
    None (no body guard ran: the request has no settings of sgl-kvc's to count)."""
    settings = getattr(raw_request, "scope", {}).get(SETTINGS_SCOPE_KEY) if raw_request is not None else None
    return None if not isinstance(settings, BodySettings) or not settings.prompts else (settings, settings.prompts[0])


def _around_convert(original: Any, serving: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    found = _request_settings(args[0] if args else kwargs.get("raw_request"))
    document = None if found is None else found[1].settings.document
    if document is None or document.tokens is not None:
        return original(serving, request, *args, **kwargs)
    body, settings = found
    # A copy before SGLang's conversion edits the request (its reasoning and template settings),
    # so that the document's messages go through the very same edits.
    prefix = request.model_copy(deep=True)
    adapted, processed = original(serving, request, *args, **kwargs)
    whole = adapted.input_ids
    if request.input_ids is not None or not _token_ids(whole):
        raise RequestSettingError(PARAM, _refusal("its prompt is not the messages rendered into token ids here "
                                                  "(its input_ids are given, or its prompt is multimodal text)"))
    ids = _render_prefix(serving, prefix, document.messages, original, *args, **kwargs)
    if not 0 < len(ids) < len(whole) or list(whole[: len(ids)]) != ids:
        # The template renders the messages otherwise inside the whole conversation (it rewrites
        # earlier turns, as Qwen3's drops their reasoning, or the tokenizer merges tokens across
        # the boundary): no document is the start of this prompt. The request reads it whole,
        # compressed as its own settings say, and the stats count it (`documents.history_rewritten`).
        counted = settings.without_document()
        count_rewritten(serving.tokenizer_manager)
    else:
        # checked against the prompt by the tokenizer's check (`request_guard`), as every request's
        counted = settings.counted(len(ids))
    body.update(settings, counted)
    _carry(adapted, counted)
    return adapted, processed


def _render_prefix(serving: Any, prefix: Any, m: int, original: Any, *args: Any, **kwargs: Any) -> list[int]:
    """SGLang's prompt ids of `prefix`'s first m messages, a conversation that ends there."""
    prefix.messages = prefix.messages[:m]
    prefix.continue_final_message = False
    name = serving.template_manager.chat_template_name
    if name is not None:
        # A named conversation template (`--chat-template chatml`): SGLang's conversation of the
        # messages, without the blank assistant turn it appends to ask for an answer, encoded as
        # SGLang encodes the whole conversation (`_apply_conversation_template`).
        from sglang.srt.parser.conversation import generate_chat_conv

        conv = generate_chat_conv(prefix, name)
        if conv.messages and conv.messages[-1][1] is None:
            conv.messages.pop()
        return list(serving.tokenizer_manager.tokenizer.encode(conv.get_prompt()))
    # The model's (or `--chat-template` file's) Jinja template, through SGLang's whole conversion
    # of the request, rendered as given and asking for no answer (what SGLang's /tokenize does
    # with `add_generation_prompt: false`).
    prefix._format_add_generation_prompt = False
    adapted, _ = original(serving, prefix, *args, **kwargs)
    ids = adapted.input_ids
    return [int(t) for t in ids] if _token_ids(ids) else []


def _token_ids(ids: Any) -> bool:
    return isinstance(ids, list) and bool(ids) and all(isinstance(t, int) for t in ids[:1])


def _carry(adapted: Any, settings: PromptSettings) -> None:
    """The request's custom params carry `settings` to the scheduler (new dicts: SGLang's request
    shares the client's)."""
    sp = adapted.sampling_params
    custom = {**(sp.get("custom_params") or {}), CUSTOM_PARAMS_KEY: settings.carried}
    adapted.sampling_params = {**sp, "custom_params": custom}


def count_rewritten(manager: Any) -> None:
    """One more chat request whose document messages its template rendered otherwise in the whole
    conversation (counted in the HTTP process, on SGLang's tokenizer manager)."""
    setattr(manager, REWRITTEN_ATTR, rewritten(manager) + 1)


def rewritten(manager: Any) -> int:
    """Chat requests read whole because their template rewrote their document's messages."""
    return int(getattr(manager, REWRITTEN_ATTR, 0))


def _refusal(why: str) -> str:
    return f"Invalid '{PARAM}': {why}; give {FIELD}.document.tokens instead (the document's prompt tokens)."
