"""`sgl_kernel.utils` stub: the one function SGLang calls outside a kernel launch is real."""

from sgl_kernel._stub import module_getattr


def is_arch_support_pdl() -> bool:
    """Programmatic dependent launch off: no kernel here would use it (triton_backend reads it)."""
    return False


__getattr__ = module_getattr(__name__)
