"""Import-only stub of `sgl_kernel` for CUDA machines without the sglang-kernel wheel (sgl-kvc GPU kit).

`from sgl_kernel[.sub] import name` succeeds for any name and gives a `StubObject` that raises
`SglKernelStubCalled` when called. `sgl_kernel.utils.is_arch_support_pdl()` is real (False):
SGLang's triton attention backend calls it in `__init__`. `sgl_kernel.scalar_type` is absent on
purpose (ImportError), so SGLang's quantization utils take their mock path.
"""

from sgl_kernel._stub import install_submodule_finder, module_getattr

# A PEP 440 version that sorts below every real release: version gates see "too old".
__version__ = "0.0.0+sglkvc.stub"
__sgl_kvc_gpu_stub__ = True

__getattr__ = module_getattr(__name__)
install_submodule_finder()
