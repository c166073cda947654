"""`sgl_kernel.kvcacheio` stub: names import, calls raise (see `sgl_kernel._stub`)."""

from sgl_kernel._stub import module_getattr

__getattr__ = module_getattr(__name__)
