"""The attention backend: SGLang's own backend for the device, with this project's layer on top.

Why wrap instead of registering a new backend name: SGLang 0.5.23 compares the backend *name*
in about eighty places (`"torch_native"` switches off Triton helpers on CPU, `"flashinfer"`
selects its planners, ...). A new name would silently take the wrong branch in many of them.
So `register()` re-registers the factories of the backends this project runs on, under their
own names, to build the same object with `KvcAttentionMixin` mixed into its class.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

logger = logging.getLogger(__name__)

# Backend the launcher selects per device (CPU: torch_native; CUDA: flashinfer).
WRAPPED_BACKENDS: tuple[str, ...] = ("torch_native", "flashinfer")


class KvcAttentionMixin:
    """Marks and extends a SGLang attention backend. Delegates every call for now; the
    compression work adds the capture of observation-window queries here."""

    __slots__ = ()  # no new instance layout: the backend's class is swapped in place
    kvc_wrapped_name: str = ""

    @property
    def kvc_name(self) -> str:
        return f"sgl_kvc({self.kvc_wrapped_name})"


@functools.cache
def _kvc_class(base: type, wrapped_name: str) -> type:
    # Single inheritance with the mixin's members copied in: CPython refuses `__class__`
    # assignment to a class with an extra base, even one that adds no instance layout.
    members = {k: v for k, v in vars(KvcAttentionMixin).items() if not k.startswith("__")}
    return type(
        f"Kvc{base.__name__}",
        (base,),
        {**members, "__slots__": (), "kvc_wrapped_name": wrapped_name, "__sgl_kvc__": True},
    )


def is_kvc_backend(backend: Any) -> bool:
    return bool(getattr(type(backend), "__sgl_kvc__", False))


def _wrap(name: str, factory: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def create(runner: Any) -> Any:
        backend = factory(runner)
        if not is_kvc_backend(backend):
            backend.__class__ = _kvc_class(type(backend), name)
            logger.info("sgl-kvc attention backend: %s", backend.kvc_name)
        return backend

    create.__sgl_kvc__ = True  # type: ignore[attr-defined]
    return create


def register() -> None:
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    for name in WRAPPED_BACKENDS:
        factory = ATTENTION_BACKENDS.get(name)
        if factory is not None and not getattr(factory, "__sgl_kvc__", False):
            ATTENTION_BACKENDS[name] = _wrap(name, factory)
