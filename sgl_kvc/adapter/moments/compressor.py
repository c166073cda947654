"""The compression moments, run by the scheduler between forward steps.

(a) `prefill`, right after prefill: policies that compress after prefill (SnapKV, KV-Compress,
    H2O, ...) and any request whose prompt is over its budget;
(a') `chunk`, between two chunks of a long prompt (Batch-Max's prefill-time eviction, Algorithm
    1): the cache is cut back to the budget when the next chunk would not fit the memory left
    (`adapter/scheduling/chunk_pressure.py`; `chunk-always`: after every chunk, so the prompt never holds
    more than budget + one chunk); the next chunk's queries attend to what was kept, at logical
    positions;
(b) `decode`, before a decode step: when a request's cache reaches its policy's trigger (R-KV:
    budget + buffer, §3.1), compress it back to the budget;
(c) `preempt`, when SGLang's decode memory check fails: compress running requests that are over
    their budget (largest first) until the step fits; SGLang preempts (in its words, retracts)
    only if memory is still short.

A moment runs passes (`sgl_kvc.core.passes`): per-head passes are staged over scheduler steps
within `--kv-pass-work`, shared among the step's passes; the selections that finish in a
moment are compacted together, each kind by its own routine (`adapter/moments/compaction.py`), and
committed. Whatever fails for one request fails that request alone, and on every
tensor-parallel rank (`adapter/safety/failures.py`): each moment's hook ends by settling its failures.
A pass whose compaction could not have the fresh slots it copies into (admission reserved them,
`adapter/scheduling/admission.py`) is not scored: it is put off with a back-off, or, between two chunks, its
request fails alone.

`Compressor` holds what the moments share and composes them; each concern is a module of its own,
which takes the compressor as a `Host` (`host.py`): a request's state from its first forward to its
release (`request_life.py`), the RoPE offsets of rows at logical positions (`rope.py`), the
prefill and chunk moments (`prefill.py`), the decode and preempt moments (`decode.py`), a
moment's passes (`scoring.py`), and its compactions, the ranks' vote on them and each request's
commit (`commit.py`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

from sgl_kvc.adapter import documents, kvc_req
from sgl_kvc.adapter.kvzip.reconstruction import Reconstructor
from sgl_kvc.adapter.memory.kv_memory import DECODE_BYTES_ATTR, DOCUMENT_BYTES_ATTR, FORWARD_ENTRIES_ATTR, MOMENT_SLOTS_ATTR
from sgl_kvc.adapter.moments import decode, prefill, request_life, rope
from sgl_kvc.adapter.moments.request_life import drop, released
from sgl_kvc.adapter.moments.rope import rope_params
from sgl_kvc.adapter.safety.failures import FailureLedger
from sgl_kvc.adapter.safety.tp import RankVote, ScoreReducer, tp_rank
from sgl_kvc.adapter.scheduling.requests import on_release
from sgl_kvc.adapter.telemetry.metrics import CompressionStats, maybe_metrics
from sgl_kvc.adapter.telemetry.trace import CompactionTrace
from sgl_kvc.config import KERNEL_DECODE_ATTENTION, KvcConfig
from sgl_kvc.core.passes import DueCompaction
from sgl_kvc.core.request_state import ReqKvState
from sgl_kvc.core.store import KvcStore
from sgl_kvc.policies import Policy, get_policy

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

# Policies are cached per (name, budget); under --kv-budget-ratio every length gives a new
# budget, so the cache is an LRU of this many entries rather than unbounded.
POLICY_CACHE_SIZE = 64


class Compressor:
    """One per scheduler process. Owns the policies, the store and the counters."""

    def __init__(self, config: KvcConfig, model_runner: ModelRunner) -> None:
        self.config = config
        self.stats = CompressionStats()
        pool = model_runner.token_to_kv_pool
        self.first_layer = int(getattr(pool, "start_layer", 0))
        self.num_layers = self.first_layer + int(pool.layer_num)
        req_to_token_pool = model_runner.req_to_token_pool
        self.store = KvcStore(
            self.num_layers, config.kv_window, req_to_token_pool.req_to_token, pool, first_layer=self.first_layer,
        )
        on_release(req_to_token_pool, partial(released, self.store))
        self._policies: OrderedDict[tuple[str, int], Policy] = OrderedDict()
        self.rope = rope_params(model_runner)  # the model's RoPE, for the policies that read it
        # With tensor parallelism each rank sees only its own KV heads: a shared selection's
        # scores are averaged over the TP group first, so every rank keeps the same tokens.
        self.reduce_scores = ScoreReducer.for_sglang_tp_group()
        self.tp_rank = tp_rank()
        # A request that fails on any rank fails on all of them, in the same step.
        self.failures = FailureLedger(drop=partial(drop, self.store), vote=RankVote.for_sglang_tp_group())
        self.trace = CompactionTrace.from_env(self.tp_rank)
        # KVzip's reconstruction passes, run as SGLang extend forwards before their prompt passes;
        # with tensor parallelism the ranks vote on them before each forward (the model's
        # collectives need every rank in it)
        self.reconstructor = Reconstructor(config, self.store, vote=self.failures.vote)
        self.scheduler: Any = None  # set by the scheduler hooks (`serve`); read for the other running batch
        self._registry: Any = None  # the shared documents' registry `serve` wired
        self.due: list[DueCompaction] = []  # per-head and shared compactions of the current moment
        self.step_seconds = 0.0  # compression work in this step so far
        self.metrics = maybe_metrics(model_runner, config.policy)
        # Requests that may hold prompt moments at once (None: no KV-memory reservation ran, as
        # on a pool layout without one cost per token: not bounded here).
        pool_config = getattr(model_runner, "memory_pool_config", None)
        self.moment_slots: int | None = getattr(pool_config, MOMENT_SLOTS_ATTR, None)
        # The shared documents' metadata stays within what the KV memory reserved for it (None:
        # nothing was reserved, not bounded here), `KvcRadixCache.make_document_room`.
        self.document_bytes: int | None = getattr(pool_config, DOCUMENT_BYTES_ATTR, None)
        # A reconstruction forward attends to at most the entries whose keys were reserved.
        self.reconstructor.forward_entries = getattr(pool_config, FORWARD_ENTRIES_ATTR, None)
        # The fused decode plan's blocks stay within what the KV memory reserved for them.
        decode_bytes = getattr(pool_config, DECODE_BYTES_ATTR, None)
        if decode_bytes:
            self.store.block_bytes = decode_bytes
        backend = model_runner.attn_backend
        if config.compressing and hasattr(backend, "kvc_store"):
            # Only a compressing server observes attention: with --policy none the backend does
            # exactly what SGLang's does (per-request compression is refused on such a server).
            backend.kvc_store = self.store
            self.store.attends = config.kv_decode_attention in KERNEL_DECODE_ATTENTION and backend.kvc_attends
            self.store.intact_as_sglang = config.kv_decode_attention == "batched"
        if config.decode_graphs:  # before SGLang captures its decode graphs (`adapter/decode_graphs.py`)
            mc = model_runner.model_config
            group = int(mc.num_attention_heads) // int(mc.get_total_num_kv_heads())  # query heads per KV head
            units = self.store.unit_pools[0].shape[0] if self.store.unit_pools is not None else 0
            self.store.enable_graphs(q_heads=group * self.store.kv_heads, head_dim=int(mc.head_dim), dtype=mc.dtype,
                                     arena_units=units)

    def serve(self, scheduler: Any) -> None:
        """The scheduler this compressor runs in (set by its hooks, every step), and, once, its
        shared documents' registry: their metrics, their metadata's reservation and the ranks'
        vote, before anything is published."""
        self.scheduler = scheduler
        registry = documents.registry_of(getattr(scheduler, "tree_cache", None))
        if registry is not None and self._registry is not registry:
            self._registry = registry
            registry.metrics = self.metrics
            registry.metadata_budget = self.document_bytes
            registry.vote = self.failures.vote

    # --- per request --------------------------------------------------------------------------
    def policy(self, name: str, budget: int) -> Policy:
        key = (name, budget)
        policy = self._policies.get(key)
        if policy is None:
            params = replace(self.config.policy_params(budget), **self.rope)
            policy = self._policies[key] = get_policy(name, params)
            if len(self._policies) > POLICY_CACHE_SIZE:
                self._policies.popitem(last=False)
        else:
            self._policies.move_to_end(key)
        return policy

    def state(self, req: Req) -> ReqKvState | None:
        return kvc_req.of(req).state

    def state_from(self, req: Req, doc: documents.Document) -> ReqKvState:
        """`request_life.state_from`: the state `req` has once it goes on from `doc`."""
        return request_life.state_from(self, req, doc)

    def set_state(self, req: Req, state: ReqKvState) -> None:
        """`request_life.set_state`: `req`'s row is the one `state` describes now."""
        request_life.set_state(self, req, state)

    # --- before a forward ---------------------------------------------------------------------
    def begin_extend(self, batch: ScheduleBatch) -> None:
        """`request_life.begin_extend`: new requests' states, and the store's rows."""
        request_life.begin_extend(self, batch)

    def begin_decode(self, batch: ScheduleBatch, fb: ForwardBatch) -> None:
        """`request_life.begin_decode`: the decode step's plan."""
        request_life.begin_decode(self, batch, fb)

    def extend_position_offsets(self, batch: ScheduleBatch, fb: ForwardBatch) -> Any:
        """`rope.extend_position_offsets`: per-token RoPE offsets of an extend batch, or None."""
        return rope.extend_position_offsets(self.store, batch, fb)

    def decode_position_offsets(self, req_pool_indices: Any) -> Any:
        """`rope.decode_position_offsets`: per-request RoPE offsets of a decode batch, or None."""
        return rope.decode_position_offsets(self.store, req_pool_indices)

    # --- the moments ---------------------------------------------------------------------------
    def before_prefill_result(self, batch: ScheduleBatch) -> None:
        """`prefill.before_prefill_result`: the documents of the prompts read, published."""
        prefill.before_prefill_result(self, batch)

    def after_prefill(self, batch: ScheduleBatch) -> None:
        """`prefill.after_prefill`: the chunk and prefill moments of an extend."""
        prefill.after_prefill(self, batch)

    def before_decode(self, batch: ScheduleBatch) -> None:
        """`decode.before_decode`: the decode moment."""
        decode.before_decode(self, batch)

    def before_preempt(self, batch: ScheduleBatch) -> bool:
        """`decode.before_preempt`: compress until the next decode step fits. True if it fits."""
        return decode.before_preempt(self, batch)

    # --- accounting ---------------------------------------------------------------------------
    def account(self, seconds: float) -> float:
        """Time spent compressing: the step's total is the stall it caused the scheduler."""
        self.stats.seconds += seconds
        self.step_seconds += seconds
        self.stats.max_step_seconds = max(self.stats.max_step_seconds, self.step_seconds)
        if self.metrics:
            self.metrics.spent(seconds)
        return seconds

    def retracted(self, n: int) -> None:
        self.stats.retractions += n
        if self.metrics:
            self.metrics.retracted(n)

    def layers(self) -> range:
        return range(self.first_layer, self.num_layers)
