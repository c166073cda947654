"""A CPU server's processes: the thread binding SGLang needs where there are more CPU ranks than
NUMA nodes (`set_cpu_threads_bind`), and SGLang's scheduler and detokenizer forked from the
launcher instead of spawned (`fork_workers_on_cpu`, where `fork_is_safe`)."""

from __future__ import annotations

import argparse
import logging
import os

from sgl_kvc.config import KvcConfig
from sgl_kvc.launcher.flags import sglang_flags

# The launcher's one logger, under the name it has always logged as (`python -m sgl_kvc.launch`).
logger = logging.getLogger("sgl_kvc.launch")

THREADS_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"


def parallel_ranks(argv: list[str]) -> int:
    """Scheduler processes (and devices) one server uses: data x tensor x pipeline parallel ranks,
    as SGLang reads its flags among the server's flags `argv` (`sglang_flags`)."""
    parser = argparse.ArgumentParser(add_help=False)
    KvcConfig.add_cli_args(parser)
    flags = sglang_flags(parser.parse_known_args(argv)[1])  # (sgl-kvc's own flags are not SGLang's)
    return int(flags.get("--dp-size")) * int(flags.get("--tp-size")) * int(flags.get("--pp-size"))


def cpu_threads_bind(ranks: int, cpus: list[int], numa_nodes: int) -> str | None:
    """A value for SGLANG_CPU_OMP_THREADS_BIND where SGLang cannot start without one: it gives
    every CPU rank one NUMA node of its own and refuses more ranks than nodes (`--dp-size 2` on
    a one-node machine). The CPUs are split into `ranks` contiguous groups (one CPU each,
    shared round-robin, where there are fewer CPUs than ranks). None where SGLang's own
    placement applies."""
    if ranks <= max(numa_nodes, 1) or not cpus:
        return None
    if len(cpus) < ranks:
        groups = [[cpus[i % len(cpus)]] for i in range(ranks)]
    else:
        size = len(cpus) // ranks
        groups = [cpus[i * size:(i + 1) * size] for i in range(ranks - 1)]
        groups.append(cpus[(ranks - 1) * size:])

    def spell(group: list[int]) -> str:
        contiguous = group == list(range(group[0], group[-1] + 1))
        if len(group) == 1:
            return str(group[0])
        return f"{group[0]}-{group[-1]}" if contiguous else ",".join(map(str, group))

    return "|".join(spell(g) for g in groups)


def set_cpu_threads_bind(argv: list[str]) -> None:
    if os.environ.get(THREADS_BIND_ENV):
        return  # the user placed the ranks
    from sglang.srt.utils import get_cpu_ids_by_node

    ranks, cpus = parallel_ranks(argv), sorted(os.sched_getaffinity(0))
    bind = cpu_threads_bind(ranks, cpus, len(get_cpu_ids_by_node()))
    if bind is None:
        return
    os.environ[THREADS_BIND_ENV] = bind  # inherited by the scheduler processes
    # SGLang applies the bind only on CPUs with AMX; elsewhere every rank would start one
    # OpenMP thread per core and the ranks would contend for them (docs/scaling.md measures it).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(cpus) // ranks)))
    logger.info("sgl-kvc: %s=%s, OMP_NUM_THREADS=%s (more CPU ranks than NUMA nodes)",
                THREADS_BIND_ENV, bind, os.environ["OMP_NUM_THREADS"])


# `SGLKVC_CPU_FORK=0`: a CPU server's scheduler and detokenizer processes are spawned, as SGLang does.
CPU_FORK_ENV = "SGLKVC_CPU_FORK"


def os_threads() -> set[str]:
    """This process's OS threads (Linux: /proc/self/task; empty elsewhere)."""
    try:
        return set(os.listdir("/proc/self/task"))
    except OSError:
        return set()


def fork_is_safe(baseline: set[str], now: set[str], python_threads: int) -> bool:
    """Whether this process may fork SGLang's workers: no Python thread but this one and no OS
    thread started since `baseline` (taken before the launcher did any work but imports). A thread
    that exists at a fork is missing in the child with whatever it held: an OpenMP pool that a
    torch operation started (converting a model) hangs the child's first parallel region."""
    return bool(baseline) and python_threads == 1 and now <= baseline


def fork_workers_on_cpu(baseline: set[str]) -> None:
    """On a CPU, SGLang's scheduler and detokenizer are forked from this process, which has already
    imported SGLang, instead of spawned as fresh interpreters that import it again (a demo-model
    server was healthy after 12 s instead of 20, on a 2-core Xeon): after SGLang's own choice of `spawn`
    (`_set_envs_and_config`), where `fork_is_safe`. Not on a GPU (CUDA does not survive a fork)."""
    import multiprocessing
    import threading

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def after_set_envs(result, server_args, *args, **kwargs):
        if getattr(server_args, "device", None) == "cpu" and fork_is_safe(
            baseline, os_threads(), threading.active_count()
        ):
            multiprocessing.set_start_method("fork", force=True)
            logger.info("sgl-kvc: SGLang's worker processes are forked from the launcher (%s=0: spawned)",
                        CPU_FORK_ENV)
        return result

    HookRegistry.register("sglang.srt.entrypoints.engine._set_envs_and_config", after_set_envs, HookType.AFTER)
    HookRegistry.apply_hooks()

