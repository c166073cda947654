"""Per-request compression settings, in one place: the `kv_compression` object of a request body,
parsed; checked against the server's configuration; and resolved against it into what the request
runs with (`resolve`: policy, prompt policy, budget, selection). What a request holds at most is
`sgl_kvc/footprint.py`. Pure: no SGLang object is read here (the scheduler reads a request's
settings back from its `Req` in `adapter/kvc_req.py`).

    client.chat.completions.create(..., extra_body={"kv_compression": {"policy": "rkv", "budget": 256}})

`policy` compresses the generated tokens, `prompt_policy` the prompt (default: the one `policy`
names, see `--prompt-policy`).

The HTTP layer (`server/settings.py` walks the request bodies) parses it once per request
(`BodySettings`; a bad value is an OpenAI-style 400 naming the field), the HTTP process's later
hooks of that request read what it parsed, and it goes on to the scheduler inside SGLang's
`custom_params`, under `CUSTOM_PARAMS_KEY`, where it is parsed once more when the request enters
the queue (`adapter/kvc_req.admit`): a client can reach the scheduler past the HTTP layer.
"""

from __future__ import annotations

import math
from contextvars import ContextVar
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from sgl_kvc.core.request_state import Budget
from sgl_kvc.policies import (
    AUTO, SELECTIONS, available_policies, canonical_policy, decode_policies, policy_class, prompt_policy_error,
    prompt_policy_name,
)

if TYPE_CHECKING:
    from sgl_kvc.config import KvcConfig

FIELD = "kv_compression"
CUSTOM_PARAMS_KEY = "sgl_kvc"
MAX_BUDGET = 1 << 20
ALLOWED = ("policy", "prompt_policy", "budget", "selection", "document")
DOCUMENT_ALLOWED = ("tokens", "messages", "ratio", "budget")
DEFAULT_DOCUMENT_RATIO = 0.3  # KVzip's headline ratio (its Fig. 1), kvpress's leaderboard point


class RequestSettingError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class DocumentSpec:
    """`kv_compression.document`: the prompt's first `tokens` tokens are a document, compressed
    once without any question to `budget` entries per (layer, KV head), or to `ratio` of its
    tokens, and shared by every later request that begins with it (`adapter/documents/__init__.py`). On
    the chat route the document is named by messages instead (`messages`, by default all but the
    last): the HTTP layer counts their tokens (`server/documents.py`)."""

    tokens: int | None = None  # None only on the chat route before its messages are counted
    ratio: float | None = None
    budget: int | None = None
    messages: int | None = None  # chat: the first `messages` messages (default: all but the last)

    def entries(self, floor: int) -> int:
        """Entries per (layer, KV head) the compressed document keeps (never fewer than `floor`,
        what the prompt policy always keeps, + 1)."""
        if self.budget is not None:
            return max(floor, self.budget)
        ratio = DEFAULT_DOCUMENT_RATIO if self.ratio is None else self.ratio
        return max(floor, math.ceil(ratio * self.tokens))


@dataclass(frozen=True)
class RequestCompression:
    policy: str | None = None
    budget: int | None = None
    selection: str | None = None  # "per-head" or "shared" (see --kv-selection)
    prompt_policy: str | None = None  # "auto" or a policy (see --prompt-policy)
    document: DocumentSpec | None = None

    def policies(self, server_policy: str, server_prompt_policy: str) -> tuple[str, str]:
        """(decode policy, prompt policy as asked: a policy or "auto") of a request with these
        settings on a server started with `--policy server_policy --prompt-policy
        server_prompt_policy`. A request that names its policy alone gets that policy's own
        prompt policy, not the server's."""
        policy = self.policy or server_policy
        if self.prompt_policy is not None:
            return policy, self.prompt_policy
        return policy, AUTO if self.policy is not None else server_prompt_policy

    def to_custom_params(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if v is not None}
        if self.document is not None:
            out["document"] = {k: v for k, v in asdict(self.document).items() if v is not None}
        return out

    def resolve(self, config: "KvcConfig") -> "ResolvedCompression":
        """What a request with these settings runs with on a server started with `config`."""
        policy, prompt = self.policies(config.policy, config.prompt_policy)
        floor = config.policy_params().recent_kept + 1  # a ratio never cuts into the window
        budget = (Budget(self.budget, floor=floor) if self.budget is not None
                  else Budget(config.kv_budget, config.kv_budget_ratio, floor))
        return ResolvedCompression(
            policy=policy, prompt_policy=prompt, budget=budget,
            selection=self.selection or config.kv_selection,
        )


@dataclass(frozen=True)
class ResolvedCompression:
    """One request's settings resolved against the server's flags: every field has its value."""

    policy: str  # compresses the generated tokens (decode, preempt)
    prompt_policy: str  # as asked: a policy or "auto" (`prompt_policy_name` resolves "auto")
    budget: Budget
    selection: str

    @property
    def compressing(self) -> bool:
        return self.policy != "none"

    @property
    def prompt_policy_name(self) -> str:
        """The policy that compresses the prompt (prefill and chunk moments)."""
        return prompt_policy_name(self.policy, self.prompt_policy)


def parse_kv_compression(obj: Any, field: str = FIELD, chat: bool = False) -> RequestCompression:
    """Validate a `kv_compression` object; raise `RequestSettingError` naming the bad field
    (`field` is the name the caller knows the object by; `chat`: on the chat route, where a
    document may be named by messages)."""
    _check_object(obj, field, ALLOWED)
    policy = canonical_policy(obj.get("policy"))  # an earlier name is accepted
    if policy is not None and (not isinstance(policy, str) or policy not in decode_policies()):
        shown = f'"{policy}"' if isinstance(policy, str) else json_type_name(policy)
        what = ("a prompt policy (it compresses prompts only: give it as prompt_policy)"
                if policy in available_policies() else "unknown policy")
        raise RequestSettingError(
            f"{field}.policy",
            f"{what} {shown}; choose one of {', '.join(decode_policies())}",
        )
    budget = obj.get("budget")
    if budget is not None and (
        isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= MAX_BUDGET
    ):
        shown = str(budget) if isinstance(budget, (int, float)) and not isinstance(budget, bool) else json_type_name(budget)
        raise RequestSettingError(
            f"{field}.budget", f"budget must be an integer from 1 to {MAX_BUDGET}, got {shown}"
        )
    selection = obj.get("selection")
    if selection is not None and (not isinstance(selection, str) or selection not in SELECTIONS):
        shown = f'"{selection}"' if isinstance(selection, str) else json_type_name(selection)
        raise RequestSettingError(
            f"{field}.selection", f"unknown selection {shown}; choose one of {', '.join(SELECTIONS)}"
        )
    prompt_policy = canonical_policy(obj.get("prompt_policy"))
    choices = [AUTO, *(p for p in available_policies() if p != "none")]
    if prompt_policy is not None and (not isinstance(prompt_policy, str) or prompt_policy not in choices):
        shown = f'"{prompt_policy}"' if isinstance(prompt_policy, str) else json_type_name(prompt_policy)
        raise RequestSettingError(
            f"{field}.prompt_policy", f"unknown prompt policy {shown}; choose one of {', '.join(choices)}"
        )
    document = None if obj.get("document") is None else _parse_document(obj["document"], f"{field}.document", chat)
    return RequestCompression(policy=policy, budget=budget, selection=selection, prompt_policy=prompt_policy,
                              document=document)


def _check_object(obj: Any, field: str, allowed: tuple[str, ...]) -> None:
    """`obj` is a JSON object of `allowed` fields only, or the error names the field."""
    if not isinstance(obj, dict):
        raise RequestSettingError(field, f"{field} must be an object, got {json_type_name(obj)}")
    unknown = sorted(str(k) for k in set(obj) - set(allowed))
    if unknown:
        raise RequestSettingError(
            f"{field}.{unknown[0]}",
            f"unknown field(s) {', '.join(unknown)} in {field}; allowed: {', '.join(allowed)}",
        )


def _parse_document(obj: Any, field: str, chat: bool = False) -> DocumentSpec:
    _check_object(obj, field, DOCUMENT_ALLOWED)
    tokens, ratio, budget, messages = obj.get("tokens"), obj.get("ratio"), obj.get("budget"), obj.get("messages")
    for name, value in (("tokens", tokens), ("budget", budget), ("messages", messages)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BUDGET):
            raise RequestSettingError(f"{field}.{name}", f"{name} must be an integer from 1 to {MAX_BUDGET}, got "
                                      f"{value if isinstance(value, (int, float)) and not isinstance(value, bool) else json_type_name(value)}")
    if messages is not None and not chat:
        raise RequestSettingError(f"{field}.messages", f"{field}.messages names chat messages: give "
                                                       f"{field}.tokens, the document's prompt tokens, here")
    if messages is not None and tokens is not None:
        raise RequestSettingError(f"{field}.messages", f"give {field}.messages or {field}.tokens, not both")
    if tokens is None and not chat:
        raise RequestSettingError(f"{field}.tokens", f"{field}.tokens is required: how many prompt tokens the document is")
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < 1):
        raise RequestSettingError(f"{field}.ratio", f"ratio must be a number between 0 and 1 (exclusive), got "
                                  f"{ratio if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) else json_type_name(ratio)}")
    if ratio is not None and budget is not None:
        raise RequestSettingError(f"{field}.ratio", f"give {field}.ratio or {field}.budget, not both")
    return DocumentSpec(tokens=tokens, ratio=None if ratio is None else float(ratio), budget=budget, messages=messages)


WARNING_HEADER = "x-sgl-kvc-warning"  # the response header that carries `allocation_warning`


def allocation_warning(settings: RequestCompression, config: "KvcConfig | None") -> str | None:
    """Why a request with valid `settings` is served on a server started with `config` with less
    than its prompt policy's own allocation, in one line; None where it is not. A policy whose
    scores are made for one sort over every head (`Policy.global_sort`: KVzip) keeps, where every
    head keeps the same number of entries (`--kv-head-budget uniform`, or `auto` unresolved), one set of tokens for every
    head instead, which lost facts one sort keeps (docs/quality.md, "Which allocation each policy
    gets"). The HTTP layer sends it with the response (`WARNING_HEADER`), the launcher logs it for
    the server's own prompt policy: served, but never silently."""
    if config is None or not config.compressing or config.variable_budget:
        return None
    resolved = settings.resolve(config)
    if not resolved.compressing or resolved.selection != "per-head":
        return None
    name = resolved.prompt_policy_name
    if name == "none" or not policy_class(name).global_sort:
        return None
    return (f"prompt policy {name} on a server with uniform head budgets keeps one set of tokens for every head, "
            "not its one sort over every head, and can lose facts that sort keeps (docs/quality.md); "
            "a server with the unit pool (--kv-head-budget policy, the default on one rank with the "
            "torch_native or triton backend) serves it as its paper does")


def server_conflict(settings: RequestCompression, config: "KvcConfig | None", field: str = FIELD) -> RequestSettingError | None:
    """Why a server started with `config` (None: without sgl-kvc's config, plain SGLang) cannot
    serve valid `settings`, as the error naming the field; None if it can. Checked when a request
    is admitted, by the HTTP layer and again by the scheduler, so that a setting this server
    cannot serve is that request's 400 and never a failure later in a step it shares."""
    wants = [name for name, value in (("policy", settings.policy), ("budget", settings.budget),
                                      ("prompt_policy", settings.prompt_policy), ("document", settings.document))
             if value not in (None, "none")]
    if wants and (config is None or not config.compressing):
        return RequestSettingError(
            f"{field}.{wants[0]}",
            "this server was started with --policy none: per-request compression needs a "
            "server started with a compressing policy (e.g. --policy rkv)",
        )
    if config is not None:
        why = prompt_policy_error(*settings.policies(config.policy, config.prompt_policy))
        if why is not None:
            return RequestSettingError(f"{field}.prompt_policy", why)
    if settings.document is not None and config is not None:
        return document_conflict(settings.resolve(config), config, f"{field}.document")
    return None


def document_conflict(settings: "ResolvedCompression", config: "KvcConfig", field: str) -> RequestSettingError | None:
    """Why a request with these resolved settings cannot have its prompt's start compressed as a
    shared document on this server, or None."""
    prompt = settings.prompt_policy_name
    if not policy_class(prompt).question_free:
        free = ", ".join(p for p in available_policies() if policy_class(p).question_free)
        return RequestSettingError(field, f"a document is compressed before any question is read: its prompt "
                                          f"policy must need none ({free}), not {prompt}")
    if settings.selection != "per-head":
        return RequestSettingError(field, "shared documents need per-head selection (--kv-selection per-head, "
                                          "or \"selection\": \"per-head\")")
    return None


def document_floor(config: "KvcConfig") -> int:
    """Entries a compressed document always keeps: what its prompt policy always keeps (its sinks
    and window), + 1."""
    params = config.policy_params()
    return params.recent_kept + params.sink_tokens + 1


def document_prompt_conflict(spec: DocumentSpec, prompt_len: int, config: "KvcConfig",
                             field: str = f"{FIELD}.document", tokens_field: str | None = None
                             ) -> RequestSettingError | None:
    """Why the document `spec` (its `tokens` counted) cannot be compressed at the start of a
    prompt of `prompt_len` tokens, naming the field that decides it (`tokens_field`: the one that
    gives its tokens, `.messages` on the chat route), or None. Checked where the prompt is first
    tokenized, in the HTTP process (`adapter/scheduling/request_guard.py`, `adapter/documents/chat_documents.py`: a
    streamed request's refusal is a 4xx before its stream starts), and again when the request
    enters the scheduler's queue (`adapter/documents.request_key`)."""
    tokens_field = tokens_field or f"{field}.tokens"
    if spec.tokens >= prompt_len:
        return RequestSettingError(tokens_field, f"the document ({spec.tokens} tokens) must end before the "
                                                 f"prompt does ({prompt_len} tokens)")
    floor = document_floor(config)
    entries = spec.entries(floor)
    if entries < spec.tokens:
        return None
    # Name what would have to change: a document at most the floor long is too short whatever its
    # budget (before, every such refusal named `ratio`, which the client may not have sent).
    if floor >= spec.tokens:
        return RequestSettingError(tokens_field, f"the document ({spec.tokens} tokens) is too short to compress: "
                                                 f"a document keeps at least {floor} entries per head")
    name = "budget" if spec.budget is not None else "ratio"
    return RequestSettingError(f"{field}.{name}", f"the document ({spec.tokens} tokens) would keep {entries} "
                                                  "entries per head: nothing to compress")


def multimodal_conflict(settings: RequestCompression, config: "KvcConfig | None",
                        field: str = FIELD) -> RequestSettingError | None:
    """Why a request with these settings and images, video or audio in its prompt cannot be
    served here, naming the prompt policy's field; None if it can. KVzip (Kim et al. 2025,
    §3.2) scores a prompt by having the model repeat it as text: the pad values a multimodal
    processor puts where the media go would reach the embedding as token ids (a 500 on a CPU, a
    device-side assert that ends the server on CUDA). The request's own prompt policy or the
    server's (`--prompt-policy kvzip`) alike: another prompt policy sent with it is served."""
    if config is None or not config.compressing:
        return None
    resolved_ = settings.resolve(config)
    name = resolved_.prompt_policy_name
    if not resolved_.compressing or not policy_class(name).uses_reconstruction:
        return None
    whose = "this request's prompt_policy" if settings.prompt_policy not in (None, AUTO) else (
        "the server's prompt policy (--prompt-policy)")
    return RequestSettingError(
        f"{field}.prompt_policy",
        f"{whose} '{name}' cannot score a prompt with images, video or audio: KVzip has the model "
        f"repeat the prompt as text, which they are not; send another {field}.prompt_policy (e.g. "
        "\"snapkv\") with it, or a prompt without them",
    )


def from_custom_params(custom_params: Any) -> RequestCompression:
    """The settings carried in SGLang's `custom_params` under `CUSTOM_PARAMS_KEY`, validated
    again (a client can send `custom_params` itself, past the HTTP layer's `kv_compression`
    check). Raises `RequestSettingError`; the scheduler turns that into a per-request abort."""
    if not isinstance(custom_params, dict) or CUSTOM_PARAMS_KEY not in custom_params:
        return RequestCompression()
    return parse_kv_compression(
        custom_params[CUSTOM_PARAMS_KEY], field=f"custom_params.{CUSTOM_PARAMS_KEY}"
    )


@dataclass(frozen=True)
class PromptSettings:
    """One prompt's settings as the HTTP process parsed them from its request's body, once
    (`server/settings.py`). The request's later hooks in that process read them here, not from its
    `custom_params` again: the chat conversion counts a document's tokens into them
    (`adapter/documents/chat_documents.py`), the tokenizer's check tests the document against the
    prompt (`adapter/scheduling/request_guard.py`)."""

    settings: RequestCompression
    field: str  # the name the client knows them by, which a refusal of them names
    carried: Any  # the `sgl_kvc` object SGLang's request carries to the scheduler (None: none)
    messages: int | None = None  # chat: the messages that named the document, once its tokens are counted

    def counted(self, tokens: int) -> "PromptSettings":
        """These settings with their chat document's tokens counted (in place of its messages)."""
        document = self.settings.document
        settings = replace(self.settings, document=replace(document, tokens=tokens, messages=None))
        return PromptSettings(settings, self.field, settings.to_custom_params(), document.messages)

    def without_document(self) -> "PromptSettings":
        settings = replace(self.settings, document=None)
        return PromptSettings(settings, self.field, settings.to_custom_params())

    def document_conflict(self, prompt_len: int, config: "KvcConfig") -> RequestSettingError | None:
        """Why the document cannot be compressed at the start of this prompt of `prompt_len` tokens,
        naming the field the client gave it by (its messages on the chat route), or None; None too
        for a chat document whose tokens are not counted yet."""
        document = self.settings.document
        if document is None or document.tokens is None:
            return None
        by_messages = None if self.messages is None else f"{self.field}.document.messages"
        return document_prompt_conflict(document, prompt_len, config, f"{self.field}.document", by_messages)


@dataclass
class BodySettings:
    """Every prompt's settings of one HTTP request (one; on `/generate`, one per `sampling_params`
    of a batch), parsed once by the body guard and kept for the request's later hooks: in its ASGI
    scope (`SETTINGS_SCOPE_KEY`, read by the chat conversion, which SGLang runs in a thread) and in
    its context (`REQUEST_SETTINGS`, read by the tokenizer's check in the request's task)."""

    prompts: list[PromptSettings]

    def find(self, carried: Any) -> PromptSettings | None:
        """The settings of the prompt whose request carries the `sgl_kvc` object `carried`."""
        return next((p for p in self.prompts if p.carried == carried), None)

    def update(self, old: PromptSettings, new: PromptSettings) -> None:
        self.prompts = [new if p is old else p for p in self.prompts]


SETTINGS_SCOPE_KEY = "sgl_kvc.settings"
# A context variable, not a global: each request's task sees its own body's settings (None where
# the request came in another way than through the HTTP routes, the Python engine for instance).
REQUEST_SETTINGS: ContextVar[BodySettings | None] = ContextVar("sgl_kvc_request_settings", default=None)


def json_type_name(value: Any) -> str:
    """How a JSON client names a parsed value's type (never a Python class name)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return "a value of another type"
