# Source on the GPU machine before serving with the kit (`. gpu/env.sh`): SGLang 0.5.23 on CUDA
# without sgl-kernel, FlashInfer or the Rust extensions (shared/gpu-serve/FEASIBILITY.md, sec. 2).

# RMSNorm, SiluAndMul, RoPE and clamp_position run forward_native (torch), not sgl_kernel/JIT.
export SGLANG_FORCE_FUSED_OP_BACKEND=torch
# engine.py asserts sglang-kernel>=0.4.9 whenever CUDA is on; the kit has only a stub.
export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
# The Rust radix-tree core is left out of the slim wheel (it links another torch's libtorch).
export SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python
# The slim wheel has no Rust extensions: fail at once instead of trying a cargo build.
export SGLANG_RUST_BUILD_MODE=never
# FlashInfer is not installed; belt and braces so no code path probes for it.
export SGLANG_IS_FLASHINFER_AVAILABLE=false
# Commands on the device run in the repo root, where ./sgl_kvc (a source folder without the
# kernels/ and server/ packages the wheel maps into it) would shadow the installed sgl_kvc for
# `python -m sgl_kvc.launch`: keep the working directory off sys.path (Python >= 3.11).
export PYTHONSAFEPATH=1
