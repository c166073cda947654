"""Per-process state of this project and the `/v1/kvc/stats` snapshot built from it.

State hangs off live SGLang objects (the scheduler, the model runner) rather than module
globals, and every number in the snapshot is read from the scheduler process that owns it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX

from sgl_kvc.adapter.documents import DocumentRegistry, registry_of
from sgl_kvc.adapter.kvzip.forwards import ReconstructionStats
from sgl_kvc.adapter.memory.fp8_pool import pool_bytes
from sgl_kvc.adapter.memory.kv_memory import DOCUMENT_BYTES_ATTR, RESERVED_ATTR
from sgl_kvc.adapter.moments.compressor import Compressor
from sgl_kvc.adapter.scheduling.requests import on_release
from sgl_kvc.adapter.telemetry.metrics import CompressionStats, maybe_metrics
from sgl_kvc.config import KvcConfig

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.model_executor.model_runner import ModelRunner

_RUNTIME_ATTR = "_sgl_kvc_runtime"
_COMPRESSOR_ATTR = "_sgl_kvc_compressor"


def compressor_of(model_runner: ModelRunner, config: KvcConfig) -> Compressor | None:
    """The process's compressor, made at first use; None with `--policy none`, which is plain
    SGLang: it builds none and reads nothing of the KV pool (a pool layout sgl-kvc does not know,
    a hybrid model's, serves as SGLang serves it)."""
    if not config.compressing:
        return None
    compressor = getattr(model_runner, _COMPRESSOR_ATTR, None)
    if compressor is None:
        compressor = Compressor(config, model_runner)
        setattr(model_runner, _COMPRESSOR_ATTR, compressor)
    return compressor


def is_health_check(req: Req) -> bool:
    """SGLang's own `/health` check: a one-token generate it runs whenever the worker is idle. A
    gateway polls every worker, so counting these would add requests nobody sent (a prefix hit
    rate skewed, a worker never idle)."""
    return str(req.rid).startswith(HEALTH_CHECK_RID_PREFIX)


def client_requests(reqs: Iterable[Req]) -> int:
    return sum(1 for req in reqs if not is_health_check(req))


@dataclass
class PrefixStats:
    """Prompt tokens of finished requests, and how many of them came from the prefix cache.
    SGLang's own health checks are not counted (`is_health_check`)."""

    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    # tokens SGLang's prefill batches computed (what no prefix hit or shared document saved;
    # reconstruction forwards not counted)
    prefilled_tokens: int = 0

    def count(self, req: Req) -> None:
        # Retracted requests release their row too, and again when they finish: count at
        # finish only. SGLang computes `cached_tokens` once per request, at its first admission.
        if req.finished() and not is_health_check(req):
            self.requests += 1
            self.prompt_tokens += len(req.origin_input_ids)
            self.hit_tokens += int(req.cached_tokens)


@dataclass
class KvcRuntime:
    config: KvcConfig
    max_running: int = 0
    prefix: PrefixStats = field(default_factory=PrefixStats)
    retractions: int = 0  # SGLang's, on a server without a compressor (`--policy none`)
    metrics: Any = None  # and their counter, with --enable-metrics

    @classmethod
    def of(cls, scheduler: Scheduler, config: KvcConfig) -> "KvcRuntime":
        runtime = getattr(scheduler, _RUNTIME_ATTR, None)
        if runtime is None:
            runtime = cls(config)
            setattr(scheduler, _RUNTIME_ATTR, runtime)
            on_release(scheduler.req_to_token_pool, runtime.prefix.count)
        return runtime

    def retracted(self, n: int, model_runner: ModelRunner) -> None:
        """SGLang retracted `n` requests (counted here where no compressor counts them)."""
        if not n:
            return
        self.retractions += n
        if self.metrics is None:
            self.metrics = maybe_metrics(model_runner, self.config.policy) or False
        if self.metrics:
            self.metrics.retracted(n)

    def observe_plan(self, plan: Any) -> None:
        """Track the peak number of requests in flight from a `NextBatchPlan`."""
        running, batch = plan.running_batch, plan.batch_to_run
        n = client_requests(running.reqs)
        if batch is not None and batch is not running:
            n += client_requests(batch.reqs)  # a prefill batch runs while the decode batch waits
            mode = getattr(batch, "forward_mode", None)
            if mode is not None and mode.is_extend():
                self.prefix.prefilled_tokens += int(getattr(batch, "extend_num_tokens", 0) or 0)
        self.max_running = max(self.max_running, n)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def collect_stats(scheduler: Scheduler, runtime: KvcRuntime) -> dict[str, Any]:
    tree = scheduler.tree_cache
    prefix = runtime.prefix
    model_runner = scheduler.tp_worker.model_runner
    compressor = compressor_of(model_runner, runtime.config)
    store = compressor.store if compressor is not None else None
    graphs = store.graphs if store is not None else None
    compression = asdict(compressor.stats if compressor is not None else CompressionStats(retractions=runtime.retractions))
    # rows whose attention observations were lost to a failed write (emptied, never stale)
    compression["lost_observations"] = store.lost_observations if store is not None else 0
    # KVzip's reconstruction passes: forwards, tokens read, seconds, the most slots one held
    compression["reconstruction"] = asdict(
        compressor.reconstructor.stats if compressor is not None else ReconstructionStats())
    kv_pool = model_runner.token_to_kv_pool
    return {
        "policy": runtime.config.policy,
        "prompt_policy": runtime.config.prompt_policy_name,
        # sgl-kvc's FP8 pool names its format; SGLang's pools store model_runner.kv_cache_dtype
        "kv_cache_dtype": getattr(kv_pool, "kvc_dtype_name", None)
        or _dtype_name(model_runner.kv_cache_dtype),
        "kv_cache_scales": getattr(kv_pool, "kvc_scale_description", None),
        "pool": {
            "total_tokens": int(scheduler.max_total_num_tokens),
            "bytes": pool_bytes(kv_pool),  # K and V buffers, scales included
            "free_tokens": int(scheduler.token_to_kv_pool_allocator.available_size()),
            "cached_tokens": int(tree.evictable_size()),
            # sgl-kvc's own buffer (observation queries) in use, and what the KV budget
            # reserves for its queries and statistics (adapter/memory/kv_memory.py)
            "observation_bytes": store.query_buffer_bytes if store is not None else 0,
            # what the live requests' states hold (statistics, staged passes, tables): 0 when idle
            "request_state_bytes": store.state_bytes if store is not None else 0,
            "reserved_bytes": int(getattr(model_runner.memory_pool_config, RESERVED_ATTR, 0)),
        },
        "prefix_cache": {
            "backend": type(tree).__name__,
            "requests": prefix.requests,  # finished requests, counted below
            "prompt_tokens": prefix.prompt_tokens,
            "hit_tokens": prefix.hit_tokens,
            "prefilled_tokens": prefix.prefilled_tokens,
        },
        "compression": compression,
        # compressed documents shared through the prefix cache (adapter/documents/__init__.py)
        "documents": _documents(tree, model_runner),
        # per-head budgets: uniform, or policy / variable / layer (the unit pool)
        "head_budget": runtime.config.kv_head_budget if store is not None and store.unit_pools is not None else "uniform",
        # who computes decode attention: sgl-kvc's batched kernel (CPU, compressing servers) or
        # SGLang's backend; `layers` counts the layer calls the kernel served
        "decode_attention": {
            "kernel": "sgl-kvc batched" if store is not None and store.attends else "sglang",
            "layers": store.attended_layers if store is not None else 0,
            # decode steps read from buffers, as a CUDA graph replays them (`--kv-decode-graphs
            # on`), and those that ran eagerly, by reason (`core/graph_step.py`)
            "graph_steps": graphs.steps if graphs is not None else 0,
            "graph_replays": graphs.replays if graphs is not None else 0,
            "eager_steps": dict(graphs.eager) if graphs is not None else {},
        },
        "requests": {
            "running": client_requests(scheduler.running_batch.reqs),  # health checks left out
            "max_running": runtime.max_running,
            "max_running_limit": int(scheduler.max_running_requests),
        },
    }


def _documents(tree: Any, model_runner: Any) -> dict[str, Any]:
    registry = registry_of(tree)
    # the bytes the KV memory reserved for their metadata (adapter/memory/kv_memory.py), which
    # `metadata_bytes` stays within; 0: nothing reserved
    budget = getattr(model_runner.memory_pool_config, DOCUMENT_BYTES_ATTR, None)
    return {**(registry or DocumentRegistry()).snapshot(), "metadata_budget": int(budget or 0)}
