"""The launcher's command line: sgl-kvc's own flags (`KvcConfig`) split from SGLang's, `--help`
for both, `--kv-head-budget auto` resolved for this machine and set-ups sgl-kvc cannot serve
refused as usage errors (`parse_args`)."""

from __future__ import annotations

import argparse
import logging
from dataclasses import replace

from sgl_kvc.config import KvcConfig
from sgl_kvc.launcher import machine
from sgl_kvc.launcher.flags import sglang_flags
from sgl_kvc.launcher.head_budget import resolve_head_budget
from sgl_kvc.launcher.refusals import KVC_POOL_BACKENDS, unsupported
from sgl_kvc.launcher.sglang_argv import default_attention_backend

# The launcher's one logger, under the name it has always logged as (`python -m sgl_kvc.launch`).
logger = logging.getLogger("sgl_kvc.launch")


def parse_args(argv: list[str]) -> tuple[KvcConfig, list[str]]:
    """sgl-kvc's config (`--kv-head-budget auto` resolved for this machine) and the SGLang flags
    left in `argv`; a bad value or a set-up sgl-kvc cannot serve is a usage error (exit status 2)."""
    parser = argparse.ArgumentParser(
        prog="python -m sgl_kvc.launch",
        add_help=False,
        description="SGLang's server with KV-cache compression. All SGLang flags apply.",
    )
    KvcConfig.add_cli_args(parser)
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        print("\nSGLang server flags (all accepted):\n")
        from sglang.srt.server_args import prepare_server_args

        prepare_server_args(["--help"])  # prints SGLang's help and exits
    ns, rest = parser.parse_known_args(argv)
    try:
        config = KvcConfig.from_cli_args(ns)
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits
    if config.fp8_kv is None and config.kv_cache_dtype != "auto":
        # `--kv-cache-dtype` is SGLang's flag; values other than our FP8 ones are SGLang's.
        rest = [*rest, "--kv-cache-dtype", config.kv_cache_dtype]
        config = replace(config, kv_cache_dtype="auto")
    backend = sglang_flags(rest).get("--attention-backend")
    if config.fp8_kv and backend not in (None, *KVC_POOL_BACKENDS):
        parser.error(
            f"--kv-cache-dtype {config.fp8_kv} needs --attention-backend {' or '.join(KVC_POOL_BACKENDS)} "
            f"(sgl-kvc's FP8 pool stores codes and scales, which {backend} does not read)"
        )

    on_gpu = machine.cuda_available()
    flashinfer = machine.flashinfer_installed() if on_gpu else True
    config, line = resolve_head_budget(config, rest, on_gpu, flashinfer, machine.gpu_capability() if on_gpu else None)
    if line:
        logger.warning(line)
    default = default_attention_backend(on_gpu, config.fp8_kv is not None, config.variable_budget, flashinfer)
    problem = unsupported(config, rest, default_backend=default)
    if problem:
        parser.error(problem)
    return config, rest

