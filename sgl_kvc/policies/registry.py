"""Name -> policy class registry (the only module-level mutable state of the policy core)."""

from __future__ import annotations

from typing import TypeVar

from .base import Policy, PolicyParams

_REGISTRY: dict[str, type[Policy]] = {}

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
    return cls


def available_policies() -> list[str]:
    """Sorted names of all registered policies (includes 'none')."""
    return sorted(_REGISTRY)


def policy_class(name: str) -> type[Policy]:
    """The class registered as ``name``; ValueError naming the choices otherwise."""
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(
            f"unknown KV-cache policy {name!r}; choose one of: {', '.join(available_policies())}"
        )
    return cls


def get_policy(name: str, params: PolicyParams | None = None) -> Policy:
    """Instantiate the policy registered as ``name``; ValueError naming the choices otherwise."""
    return policy_class(name)(params if params is not None else PolicyParams())
