"""`main`: the launcher's command line read and checked, the machine set up (the CPU ranks'
threads, a GPU's checks), SGLang's plugins loaded, sgl-kvc's HTTP routes mounted and SGLang's
server run with the argument list built for this machine."""

from __future__ import annotations

import logging
import os
import sys

from sgl_kvc.launcher import machine
from sgl_kvc.launcher.cli import parse_args
from sgl_kvc.launcher.cpu_processes import CPU_FORK_ENV, fork_workers_on_cpu, os_threads, set_cpu_threads_bind
from sgl_kvc.launcher.flags import has_flag, sglang_flags
from sgl_kvc.launcher.refusals import allocation_warning, gpu_unsupported, torch_native_on_gpu
from sgl_kvc.launcher.sglang_argv import EMULATED_BF16_DTYPE, build_sglang_argv

# The launcher's one logger, under the name it has always logged as (`python -m sgl_kvc.launch`).
logger = logging.getLogger("sgl_kvc.launch")


def main(argv: list[str] | None = None) -> None:
    """`python -m sgl_kvc.launch ARGV` (default: `sys.argv[1:]`): serves until SGLang's server
    stops; a usage error or a set-up sgl-kvc cannot serve exits first, in one line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    on_gpu = machine.cuda_available()
    if not on_gpu:
        # Before SGLang is first imported (`parse_args` reads its flags with its parser): its
        # device checks are cached at import.
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    config, rest = parse_args(argv)
    gpu_kit = False
    if not on_gpu:
        set_cpu_threads_bind(rest)
    else:
        import torch

        problem = gpu_unsupported(config, torch.cuda.get_device_capability())
        try:
            import sgl_kernel  # (stand-ins never answer on a GPU machine)

            gpu_kit = bool(getattr(sgl_kernel, "__sgl_kvc_gpu_stub__", False))
        except ImportError as e:
            problem = problem or str(e)
        if problem:
            sys.exit(f"python -m sgl_kvc.launch: error: {problem}")
    if on_gpu and (warning := torch_native_on_gpu(config, rest)):
        logger.warning(warning)
    if warning := allocation_warning(config):
        logger.warning(warning)
    gpu_kit = on_gpu and gpu_kit
    native_bf16 = on_gpu or machine.native_bf16()
    flashinfer = not on_gpu or machine.flashinfer_installed()
    from sglang.launch_server import run_server
    from sglang.srt.entrypoints.http_server import app

    # SGLang's imports (and torch's) start idle threads of their own; what starts one after this
    # (building the default or demo model runs torch's OpenMP pool) rules a fork out (`fork_is_safe`).
    threads_before_work = os_threads()
    sglang_argv = build_sglang_argv(
        rest, on_gpu, config.compressing, fp8_kv=config.fp8_kv is not None,
        kv_memory_gb=config.kv_cache_memory_gb is not None, unit_pool=config.variable_budget,
        native_bf16=native_bf16, flashinfer=flashinfer, gpu_kit=gpu_kit, decode_graphs=config.decode_graphs,
    )
    if config.graphs_refusal is not None:
        logger.warning("sgl-kvc: --kv-decode-graphs on: %s; decode CUDA graphs off", config.graphs_refusal)
    config.to_env()  # read by the plugin in this process and in SGLang's worker processes

    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    if not on_gpu and os.environ.get(CPU_FORK_ENV, "1") != "0":
        fork_workers_on_cpu(threads_before_work)
    from sgl_kvc.adapter import check

    problems = check(config)
    if problems:
        sys.exit("python -m sgl_kvc.launch: error: the installed SGLang is not the one sgl-kvc is "
                 "written for:\n  " + "\n  ".join(problems))
    server_args = prepare_server_args(sglang_argv)
    from sgl_kvc.server import mount

    mount(app)
    if not flashinfer and not sglang_flags(rest).sets("--attention-backend"):
        # After prepare_server_args: SGLang configures logging there.
        logger.info("sgl-kvc: FlashInfer is not installed: --attention-backend %s (SGLang's Triton kernels)",
                    server_args.attention_backend)
    if not native_bf16 and not sglang_flags(rest).sets("--dtype"):
        # After prepare_server_args: SGLang configures logging there.
        if has_flag(sglang_argv, "--dtype"):
            logger.info("sgl-kvc: --dtype %s: this CPU has no native bfloat16 (AVX512-BF16 or AMX); "
                        "--dtype bfloat16 decodes one request alone faster", EMULATED_BF16_DTYPE)
        else:
            logger.warning("sgl-kvc: this CPU has no native bfloat16 (AVX512-BF16 or AMX), but the model "
                           "in float32 would take over half of the free memory: its own dtype is kept")
    logger.info(
        "sgl-kvc: policy=%s (prompts: %s), dtype=%s, kv cache=%s, prefix cache backend=%s, "
        "attention backend=sgl_kvc(%s)",
        config.policy, config.prompt_policy_name if config.compressing else "-", server_args.dtype,
        config.fp8_kv or getattr(server_args, "kv_cache_dtype", "auto"),
        server_args.radix_cache_backend or "SGLang default",
        server_args.attention_backend,
    )
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
