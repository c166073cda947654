"""Per-scheduler state of this project and the `/v1/kvc/stats` snapshot built from it.

The state hangs off the live `Scheduler` object (one per scheduler process / DP rank) rather
than a module global, and every number in the snapshot is read from that scheduler.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from sgl_kvc.config import KvcConfig

_ATTR = "_sgl_kvc_runtime"


@dataclass
class CompressionStats:
    passes: int = 0
    evicted_tokens: int = 0
    seconds: float = 0.0


@dataclass
class KvcRuntime:
    config: KvcConfig
    compression: CompressionStats = field(default_factory=CompressionStats)
    max_running: int = 0

    @classmethod
    def of(cls, scheduler: Any, config: KvcConfig) -> "KvcRuntime":
        runtime = getattr(scheduler, _ATTR, None)
        if runtime is None:
            runtime = cls(config)
            setattr(scheduler, _ATTR, runtime)
        return runtime

    def observe_plan(self, plan: Any) -> None:
        """Track the peak number of requests in flight from a `NextBatchPlan`."""
        running, batch = plan.running_batch, plan.batch_to_run
        n = len(running.reqs)
        if batch is not None and batch is not running:
            n += len(batch.reqs)  # a prefill batch runs while the decode batch waits
        self.max_running = max(self.max_running, n)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def collect_stats(scheduler: Any, runtime: KvcRuntime) -> dict[str, Any]:
    tree = scheduler.tree_cache
    prefix = getattr(tree, "prefix_stats", None)
    return {
        "policy": runtime.config.policy,
        "kv_cache_dtype": _dtype_name(scheduler.tp_worker.model_runner.kv_cache_dtype),
        "pool": {
            "total_tokens": int(scheduler.max_total_num_tokens),
            "free_tokens": int(scheduler.token_to_kv_pool_allocator.available_size()),
            "cached_tokens": int(tree.evictable_size()),
        },
        "prefix_cache": {
            "backend": type(tree).__name__,
            "prompt_tokens": prefix.prompt_tokens if prefix else 0,
            "hit_tokens": prefix.hit_tokens if prefix else 0,
        },
        "compression": asdict(runtime.compression),
        "requests": {
            "running": len(scheduler.running_batch.reqs),
            "max_running": runtime.max_running,
            "max_running_limit": int(scheduler.max_running_requests),
        },
    }
