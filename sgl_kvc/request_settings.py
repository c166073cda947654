"""Per-request compression settings: the `kv_compression` object of a request body.

    client.chat.completions.create(..., extra_body={"kv_compression": {"policy": "rkv", "budget": 256}})

The HTTP layer validates it (a bad value is an OpenAI-style 400 naming the field) and forwards it
to the scheduler inside SGLang's `custom_params`, under `CUSTOM_PARAMS_KEY`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from sgl_kvc.policies import available_policies

FIELD = "kv_compression"
CUSTOM_PARAMS_KEY = "sgl_kvc"
MAX_BUDGET = 1 << 20


class RequestSettingError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class RequestCompression:
    policy: str | None = None
    budget: int | None = None

    def to_custom_params(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def parse_kv_compression(obj: Any) -> RequestCompression:
    """Validate a `kv_compression` object; raise `RequestSettingError` naming the bad field."""
    if not isinstance(obj, dict):
        raise RequestSettingError(FIELD, f"{FIELD} must be an object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - {"policy", "budget"})
    if unknown:
        raise RequestSettingError(
            f"{FIELD}.{unknown[0]}", f"unknown field(s) {unknown} in {FIELD}; allowed: policy, budget"
        )
    policy = obj.get("policy")
    if policy is not None and policy not in available_policies():
        raise RequestSettingError(
            f"{FIELD}.policy",
            f"unknown policy {policy!r}; choose one of {available_policies()}",
        )
    budget = obj.get("budget")
    if budget is not None and (
        isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= MAX_BUDGET
    ):
        raise RequestSettingError(
            f"{FIELD}.budget", f"budget must be an integer in [1, {MAX_BUDGET}], got {budget!r}"
        )
    return RequestCompression(policy=policy, budget=budget)


def from_custom_params(custom_params: Any) -> RequestCompression:
    """The settings the HTTP layer forwarded (already validated), or the empty default."""
    if isinstance(custom_params, dict) and isinstance(custom_params.get(CUSTOM_PARAMS_KEY), dict):
        return RequestCompression(**custom_params[CUSTOM_PARAMS_KEY])
    return RequestCompression()
