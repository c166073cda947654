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
as `document.tokens`, in place of `messages`, before the request leaves the HTTP process. That holds
for the usual templates as long as the client resends earlier turns as they were. Where it does not
(a template that rewrites earlier turns, as Qwen3's drops their reasoning; a tokenizer that merges
tokens across the boundary), the request declares no document: it reads its prompt whole,
compressed by its own settings, and `/v1/kvc/stats` counts it (`documents.history_rewritten`).
"""

from __future__ import annotations

from typing import Any

from sgl_kvc.adapter.sglang_api import Hook
from sgl_kvc.request_settings import CUSTOM_PARAMS_KEY, FIELD, RequestSettingError

TARGET = "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._convert_to_internal_request"
PARAM = f"{FIELD}.document.messages"
REWRITTEN_ATTR = "_sgl_kvc_history_rewritten"  # on SGLang's TokenizerManager: `count_rewritten`


def hook_table() -> list[Hook]:
    """Installed in every SGLang process; it only runs in the HTTP server's."""
    return [Hook(TARGET, _around_convert, "AROUND", ("request", "raw_request"),
                 "a chat document's tokens, counted from SGLang's own prompt of the request")]


def document_messages(request: Any) -> int | None:
    """The messages a chat request names as its document (`server/documents.py` wrote the count
    into its `custom_params`), or None."""
    custom = getattr(request, "custom_params", None)
    settings = custom.get(CUSTOM_PARAMS_KEY) if isinstance(custom, dict) else None
    document = settings.get("document") if isinstance(settings, dict) else None
    m = document.get("messages") if isinstance(document, dict) else None
    return m if isinstance(m, int) and not isinstance(m, bool) else None


def _around_convert(original: Any, serving: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    m = document_messages(request)
    if m is None:
        return original(serving, request, *args, **kwargs)
    # A copy before SGLang's conversion edits the request (its reasoning and template settings),
    # so that the document's messages go through the very same edits.
    prefix = request.model_copy(deep=True)
    adapted, processed = original(serving, request, *args, **kwargs)
    whole = adapted.input_ids
    if request.input_ids is not None or not _token_ids(whole):
        raise RequestSettingError(PARAM, _refusal("its prompt is not the messages rendered into token ids here "
                                                  "(its input_ids are given, or its prompt is multimodal text)"))
    document = _render_prefix(serving, prefix, m, original, *args, **kwargs)
    if not 0 < len(document) < len(whole) or list(whole[: len(document)]) != document:
        # The template renders the messages otherwise inside the whole conversation (it rewrites
        # earlier turns, as Qwen3's drops their reasoning, or the tokenizer merges tokens across
        # the boundary): no document is the start of this prompt. The request reads it whole,
        # compressed as its own settings say, and the stats count it (`documents.history_rewritten`).
        _drop_document(adapted)
        count_rewritten(serving.tokenizer_manager)
        return adapted, processed
    _set_tokens(adapted, len(document))
    _check_prompt(adapted, len(whole))
    return adapted, processed


def _check_prompt(adapted: Any, prompt_len: int) -> None:
    """A document its prompt cannot compress (it keeps every token, or the prompt ends with it) is
    a 400 naming its messages, here, before a streamed request's stream starts. Found only in the
    scheduler, it was an error event inside a 200 stream, its field unnamed (`tests/hostile_documents.py`)."""
    from sgl_kvc.config import KvcConfig
    from sgl_kvc.request_settings import document_prompt_conflict, from_custom_params

    config = KvcConfig.from_env()
    spec = from_custom_params(adapted.sampling_params.get("custom_params")).document
    if config is None or spec is None:
        return
    conflict = document_prompt_conflict(spec, prompt_len, config, f"{FIELD}.document", tokens_field=PARAM)
    if conflict is not None:
        raise RequestSettingError(conflict.param, f"Invalid '{conflict.param}': {conflict}.")


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


def _set_tokens(adapted: Any, tokens: int) -> None:
    """`document.tokens` in the request's custom params (new dicts: SGLang's request shares the
    client's), in place of `messages`."""
    sp = adapted.sampling_params
    custom = dict(sp.get("custom_params") or {})
    settings = dict(custom[CUSTOM_PARAMS_KEY])
    document = {k: v for k, v in settings["document"].items() if k != "messages"}
    document["tokens"] = tokens
    settings["document"] = document
    custom[CUSTOM_PARAMS_KEY] = settings
    adapted.sampling_params = {**sp, "custom_params": custom}


def _drop_document(adapted: Any) -> None:
    """The request's custom params without its document (new dicts: SGLang's request shares the
    client's)."""
    sp = adapted.sampling_params
    custom = dict(sp.get("custom_params") or {})
    custom[CUSTOM_PARAMS_KEY] = {k: v for k, v in custom[CUSTOM_PARAMS_KEY].items() if k != "document"}
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
