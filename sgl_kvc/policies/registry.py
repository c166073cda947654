"""Name -> policy class registry (the only module-level mutable state of the policy core)."""

from __future__ import annotations

from typing import TypeVar

from .base import Policy, PolicyParams

_REGISTRY: dict[str, type[Policy]] = {}
_ALIASES: dict[str, str] = {}  # an earlier name -> the policy's name

P = TypeVar("P", bound=type[Policy])


def register_policy(cls: P) -> P:
    """Class decorator: register ``cls`` under ``cls.name`` (names are unique)."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__name__} needs a non-empty class attribute 'name'")
    existing = _REGISTRY.get(name)
    if existing is not None and existing is not cls:
        raise ValueError(f"policy name {name!r} already registered by {existing.__name__}")
    _REGISTRY[name] = cls
    for alias in getattr(cls, "aliases", ()):
        _ALIASES[alias] = name
    return cls


def canonical_policy(name: str) -> str:
    """The policy's name for ``name``, which may be an earlier name it still accepts (its
    ``aliases``: ``avgattn`` for ``batchmax``); anything else unchanged."""
    return _ALIASES.get(name, name) if isinstance(name, str) else name


def available_policies() -> list[str]:
    """Sorted names of all registered policies (includes 'none')."""
    return sorted(_REGISTRY)


def decode_policies() -> list[str]:
    """Sorted names of the policies that can be a request's policy (every one but the prompt
    policies, `Policy.prompt_only`)."""
    return [name for name in available_policies() if not _REGISTRY[name].prompt_only]


def policy_class(name: str) -> type[Policy]:
    """The class registered as ``name``; ValueError naming the choices otherwise."""
    cls = _REGISTRY.get(canonical_policy(name))
    if cls is None:
        raise ValueError(
            f"unknown KV-cache policy {name!r}; choose one of: {', '.join(available_policies())}"
        )
    return cls


def get_policy(name: str, params: PolicyParams | None = None) -> Policy:
    """Instantiate the policy registered as ``name``; ValueError naming the choices otherwise."""
    return policy_class(name)(params if params is not None else PolicyParams())


AUTO = "auto"


def prompt_policy_name(policy: str, prompt: str | None = None) -> str:
    """The policy that compresses the prompt of a request whose decode policy is ``policy``:
    ``prompt`` unless it is None or ``"auto"``, then the one ``policy`` names
    (:attr:`Policy.prompt_policy`), else ``policy`` itself."""
    if prompt is not None and prompt != AUTO:
        return prompt
    return policy_class(policy).prompt_policy or policy


def prompt_policy_error(policy: str, prompt: str) -> str | None:
    """Why ``prompt`` cannot compress the prompt of a request decoded under ``policy``, or None.

    A request keeps one attention statistic, its decode policy's (accumulated and carried over
    every compaction by that policy). A prompt policy that scores from its own statistic can
    therefore only be the decode policy too, except KV-Compress, which scores a prompt from the
    observation queries when the request keeps no statistic (a decode policy without one).
    """
    if policy_class(policy).prompt_only:
        return f"{policy!r} compresses prompts only: give it as the prompt policy, with a decode policy"
    if prompt == AUTO or policy == "none" or prompt == policy:
        return None
    if prompt == "none":
        return "'none' compresses nothing; to keep a prompt whole, give the request a budget above its length"
    cls, decode = policy_class(prompt), policy_class(policy)
    if cls.uses_stats and (cls.accumulate_prefill or decode.uses_stats):
        return (f"{prompt!r} scores from its own attention statistic, which a request keeps only "
                f"for its decode policy ({policy!r}): use it with policy {prompt!r}")
    return None
