"""The project's own settings: one frozen dataclass, the single source of CLI defaults.

The launcher parses these flags, removes them from the argument list it hands to SGLang, and
passes the resulting `KvcConfig` to SGLang's worker processes through one environment variable
(they are separate interpreters; SGLang's own `ServerArgs` has no room for foreign fields).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

ENV_VAR = "SGLKVC_CONFIG"

# What the SGLang adapter can run today. A policy from the registry appears on the command line
# only once the scheduler hooks drive it: a flag that silently did nothing would be a lie.
ADAPTER_POLICIES: tuple[str, ...] = ("none",)


def policy_choices() -> list[str]:
    from sgl_kvc.policies import available_policies

    return [p for p in available_policies() if p in ADAPTER_POLICIES]


@dataclass(frozen=True)
class KvcConfig:
    """sgl-kvc settings for one server. Field metadata `help` becomes the flag's help line."""

    policy: str = field(
        default="none",
        metadata={"help": "KV-cache eviction policy ('none' behaves exactly like plain SGLang)."},
    )

    def __post_init__(self) -> None:
        choices = policy_choices()
        if self.policy not in choices:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {choices}")

    # --- transport to SGLang's worker processes -------------------------------------------
    def to_env(self) -> None:
        os.environ[ENV_VAR] = json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> "KvcConfig | None":
        """The config the launcher exported, or None when SGLang was started without it."""
        raw = os.environ.get(ENV_VAR)
        return None if raw is None else cls(**json.loads(raw))

    # --- command line ---------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("sgl-kvc")
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            kwargs: dict[str, Any] = {"default": f.default, "help": f.metadata.get("help", "")}
            if f.name == "policy":
                kwargs["choices"] = policy_choices()
            else:
                kwargs["type"] = type(f.default)
            group.add_argument(flag, dest=f.name, **kwargs)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "KvcConfig":
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls)})
