"""The three compression moments, run by the scheduler between forward steps.

(a) right after prefill: policies that compress after prefill (SnapKV, KV-Compress, H2O, ...)
    and any request whose prompt is over its budget;
(b) before a decode step: when a request's cache reaches its policy's trigger (R-KV: budget +
    buffer, §3.1), compress it back to the budget;
(c) when SGLang's decode memory check fails: compress running requests that are over their
    budget (largest first) until the step fits; SGLang retracts only if memory is still short.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from sgl_kvc.adapter import failpoints
from sgl_kvc.adapter.compaction import (
    CompactionSkipped,
    compact_request,
    compact_request_per_head,
)
from sgl_kvc.adapter.invariants import InvariantViolation
from sgl_kvc.adapter.metrics import maybe_metrics
from sgl_kvc.adapter.requests import abort_running, is_middle_chunk, request_settings
from sgl_kvc.adapter.state import KvcStore, ReqKvState
from sgl_kvc.adapter.tp import ScoreReducer, tp_rank
from sgl_kvc.config import KvcConfig
from sgl_kvc.policies import (
    HeadSelection,
    LayerView,
    Policy,
    carry_stats_per_head,
    get_policy,
    select_per_head,
)

logger = logging.getLogger(__name__)

STATE_ATTR = "_sgl_kvc_state"
TRACE_ENV = "SGLKVC_TRACE"  # a file: one JSON line per compaction (tests and debugging)
# Policies are cached per (name, budget); under --kv-budget-ratio every length gives a new
# budget, so the cache is an LRU of this many entries rather than unbounded.
POLICY_CACHE_SIZE = 64


@dataclass
class CompressionStats:
    passes: int = 0
    evicted_tokens: int = 0
    seconds: float = 0.0
    prefill_passes: int = 0
    decode_passes: int = 0
    preempt_passes: int = 0
    avoided_retractions: int = 0
    retractions: int = 0
    skipped: int = 0
    failed_requests: int = 0  # requests aborted because sgl-kvc raised while handling them
    max_pass_seconds: float = 0.0  # the longest compression work in one scheduler step: the worst stall
    staged_passes: int = 0  # passes spread over several scheduler steps (--kv-pass-work)


@dataclass
class PendingPass:
    """A per-head pass spread over scheduler steps (`--kv-pass-work`): each step scores and
    selects some layers of the n0 entries the request held when it began; the compaction runs
    when every layer has chosen. Entries appended meanwhile (the tail) are kept by every head.
    Per-head selection makes this exact: a layer's choice does not depend on the other layers,
    and the window queries are taken when the pass begins, as a one-step pass would read them."""

    moment: str
    policy: Policy
    n0: int
    target: int
    positions: torch.Tensor
    queries: list[torch.Tensor | None]
    indices: list[torch.Tensor] = field(default_factory=list)  # per layer done: [H_kv, target]
    seconds: float = 0.0


class Compressor:
    """One per scheduler process. Owns the policies, the store and the counters."""

    def __init__(self, config: KvcConfig, model_runner: Any) -> None:
        self.config = config
        self.stats = CompressionStats()
        pool = model_runner.token_to_kv_pool
        self.num_layers = int(getattr(pool, "start_layer", 0)) + int(pool.layer_num)
        self.first_layer = int(getattr(pool, "start_layer", 0))
        self.store = KvcStore(
            self.num_layers, config.kv_window, model_runner.req_to_token_pool.req_to_token, pool,
            first_layer=self.first_layer,
        )
        self._policies: OrderedDict[tuple[str, int], Policy] = OrderedDict()
        # With tensor parallelism each rank sees only its own KV heads: scores are averaged over
        # the TP group before choosing, so every rank keeps the same tokens (same row layout).
        self.reduce_scores = ScoreReducer.for_sglang_tp_group()
        if failpoints.active("tp_local_scores"):
            self.reduce_scores = None  # planted: each rank chooses from its own heads
        self.tp_rank = tp_rank()
        self._trace_path = os.environ.get(TRACE_ENV)
        self.scheduler: Any = None  # set by the scheduler hooks; read for the other running batch
        self._work_left = 0  # cost units a staged pass may still spend in this step
        self._step_seconds = 0.0  # compression work in this step so far
        self.metrics = maybe_metrics(model_runner, config.policy)
        backend = model_runner.attn_backend
        if config.compressing and hasattr(backend, "kvc_store"):
            # Only a compressing server observes attention: with --policy none the backend does
            # exactly what SGLang's does (per-request compression is refused on such a server).
            backend.kvc_store = self.store

    # --- per request --------------------------------------------------------------------------
    def policy(self, name: str, budget: int) -> Policy:
        key = (name, budget)
        policy = self._policies.get(key)
        if policy is None:
            policy = self._policies[key] = get_policy(name, self.config.policy_params(budget))
            if len(self._policies) > POLICY_CACHE_SIZE:
                self._policies.popitem(last=False)
        else:
            self._policies.move_to_end(key)
        return policy

    def new_state(self, req: Any) -> ReqKvState:
        settings = request_settings(req)
        name = settings.policy or self.config.policy
        budget = settings.budget or self.config.kv_budget
        ratio = None if settings.budget else self.config.kv_budget_ratio
        return ReqKvState(
            policy=self.policy(name, budget), budget=budget, budget_ratio=ratio,
            selection=settings.selection or self.config.kv_selection,
        )

    def state(self, req: Any) -> ReqKvState | None:
        return getattr(req, STATE_ATTR, None)

    def begin_extend(self, batch: Any) -> None:
        """Before a prefill (chunk): give requests seen for the first time their state."""
        for req in batch.reqs:
            if getattr(req, STATE_ATTR, None) is None and not req.finished():
                self._guarded(req, "start", self._begin, req)

    def _begin(self, req: Any) -> None:
        state = self.new_state(req)
        self.store.begin(req.kv.req_pool_idx, state)
        setattr(req, STATE_ATTR, state)

    def forget(self, req: Any) -> None:
        """A retracted request restarts from its tokens: fresh, uncompressed state."""
        if getattr(req, STATE_ATTR, None) is not None:
            setattr(req, STATE_ATTR, None)

    def decode_position_offsets(self, req_pool_indices: torch.Tensor) -> torch.Tensor | None:
        """Per-request RoPE offsets of a decode batch (on the device), or None if all are 0."""
        if not self.store.offset_rows:
            return None
        return self.store.offsets[req_pool_indices]

    # --- the three moments ----------------------------------------------------------------------
    def after_prefill(self, batch: Any) -> None:
        self._new_step()
        for i, req in enumerate(batch.reqs):
            # A request between two chunks of its prompt is never compacted: its earlier chunks
            # are in the radix tree as exact KV and the next chunk extends exactly them.
            if req.finished() or is_middle_chunk(batch, req):
                continue
            state = self.state(req)
            if state is None or state.policy.name == "none":
                continue
            self._guarded(req, "compress", self._after_prefill_one, batch, i, state)

    def _after_prefill_one(self, batch: Any, i: int, state: ReqKvState) -> None:
        n = int(batch.seq_lens_cpu[i])
        budget = state.effective_budget(n)
        target = self.policy(state.policy.name, budget).prefill_target_length(n)
        if target is None and n > budget:
            target = budget  # any policy, with a prompt over budget
        if target is not None and target < n:
            self._start_pass(batch, i, state, target, "prefill")

    def before_decode(self, batch: Any) -> None:
        self._new_step()
        for i, req in enumerate(batch.reqs):
            state = self.state(req)
            if state is None or state.policy.name == "none" or req.finished():
                continue
            self._guarded(req, "compress", self._before_decode_one, batch, i, state)

    def _before_decode_one(self, batch: Any, i: int, state: ReqKvState) -> None:
        if state.pending is not None:
            self._advance(batch, i, state)
            return
        n = int(batch.seq_lens_cpu[i])
        target = self.policy(state.policy.name, state.effective_budget(n)).target_length(n)
        if target is not None and target < n:
            self._start_pass(batch, i, state, target, "decode")

    def before_retract(self, batch: Any) -> bool:
        """Compress over-budget requests until the next decode step fits. True if it fits."""
        order = sorted(range(len(batch.reqs)), key=lambda j: -int(batch.seq_lens_cpu[j]))
        compressed = False
        for i in order:
            req = batch.reqs[i]
            state = self.state(req)
            if state is None or state.policy.name == "none" or req.finished():
                continue
            n = int(batch.seq_lens_cpu[i])
            budget = state.effective_budget(n)
            if n > budget:
                done = self._guarded(req, "compress", self._compress, batch, i, state, budget, "preempt")
                compressed |= bool(done)
                if batch.check_decode_mem():
                    if compressed:
                        self.stats.avoided_retractions += 1
                        if self.metrics:
                            self.metrics.avoided_retraction()
                    return True
        return batch.check_decode_mem()

    # --- failure isolation ----------------------------------------------------------------------
    def _guarded(self, req: Any, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run sgl-kvc work for ONE request. An exception aborts that request (with a message
        the client sees) instead of propagating into SGLang's event loop, where it would stop
        every request of the server."""
        try:
            return fn(*args)
        except InvariantViolation:
            raise  # SGLKVC_CHECK=1 exists to stop the server on a broken pool or tree
        except Exception as e:  # noqa: BLE001 - the point is to contain anything
            logger.exception("sgl-kvc failed to %s request %s; aborting it", what, req.rid)
            self.stats.failed_requests += 1
            setattr(req, STATE_ATTR, None)  # never touched by sgl-kvc again
            if getattr(req.kv, "req_pool_idx", None) is not None:
                self.store.set_offset(req.kv.req_pool_idx, 0)
            abort_running(req, f"sgl-kvc could not {what} this request ({type(e).__name__}); "
                          "the server log has details")
            return None

    # --- one compression ------------------------------------------------------------------------
    def _compress(self, batch: Any, i: int, state: ReqKvState, target: int, moment: str) -> bool:
        """A whole pass in this step (the preempt moment, the shared selection, staging off)."""
        t0 = time.perf_counter()
        self._check_failpoint(batch.reqs[i])
        state.pending = None  # a staged pass in progress is superseded
        row = batch.reqs[i].kv.req_pool_idx
        n = int(batch.seq_lens_cpu[i])
        policy = self.policy(state.policy.name, state.effective_budget(n))
        positions = state.positions(n)
        views = [self._view(batch, row, layer, n, positions, state) for layer in self._layers()]
        if state.per_head:
            # Every (layer, KV head) keeps its own `target` best entries. Each TP rank holds whole
            # KV heads, so it chooses for its own heads alone; every rank keeps `target` slots.
            chosen: HeadSelection | torch.Tensor = select_per_head(policy, views, min(target, n))
        else:
            chosen = policy.select(views, target, reduce=self.reduce_scores).cpu()
        done = self._apply(batch, i, state, policy, moment, positions, views, chosen)
        self._account(time.perf_counter() - t0)
        return done

    def _start_pass(self, batch: Any, i: int, state: ReqKvState, target: int, moment: str) -> bool:
        """Begin a pass that may take several steps (per head, `--kv-pass-work` > 0)."""
        if not state.per_head or self.config.kv_pass_work <= 0:
            return self._compress(batch, i, state, target, moment)
        self._check_failpoint(batch.reqs[i])
        row = batch.reqs[i].kv.req_pool_idx
        n = int(batch.seq_lens_cpu[i])
        state.pending = PendingPass(
            moment=moment,
            policy=self.policy(state.policy.name, state.effective_budget(n)),
            n0=n,
            target=min(target, n),
            positions=state.positions(n),
            queries=[self.store.queries(row, layer, n) for layer in self._layers()],
        )
        return self._advance(batch, i, state)

    def _advance(self, batch: Any, i: int, state: ReqKvState) -> bool:
        """Score the layers that fit in this step's work (the step's first layer always runs, so
        every step makes progress), and compact once every layer has chosen. True if the
        request was compacted."""
        t0 = time.perf_counter()
        p = state.pending
        assert p is not None
        row = batch.reqs[i].kv.req_pool_idx
        layers = list(self._layers())
        cost = p.policy.score_cost(p.n0)  # one layer
        while len(p.indices) < len(layers) and (
            self._work_left >= cost or self._work_left == self.config.kv_pass_work
        ):  # a layer fits in what is left of this step's work, or it is the step's first
            layer = layers[len(p.indices)]
            view = self._view(
                batch, row, layer, p.n0, p.positions, state, queries=p.queries[len(p.indices)]
            )
            p.indices.append(select_per_head(p.policy, [view], p.target).indices[0])
            self._work_left -= cost
        if len(p.indices) < len(layers):
            p.seconds += self._account(time.perf_counter() - t0)
            return False
        state.pending = None
        n = int(batch.seq_lens_cpu[i])
        indices = torch.stack(p.indices)  # [L, H_kv, target] over the first n0 entries
        if n > p.n0:  # the tail appended since the pass began: every head keeps it
            tail = torch.arange(p.n0, n, device=indices.device)
            indices = torch.cat([indices, tail.expand(*indices.shape[:2], n - p.n0)], dim=-1)
        lengths = torch.full(indices.shape[:2], indices.shape[-1], dtype=torch.int64)
        selection = HeadSelection(indices=indices, lengths=lengths, n=n)
        positions = state.positions(n)
        views = (
            [self._view(batch, row, layer, n, positions, state) for layer in layers]
            if p.policy.uses_stats else []
        )  # fmt: skip
        done = self._apply(batch, i, state, p.policy, p.moment, positions, views, selection, p.n0)
        self._account(time.perf_counter() - t0)
        if done and p.seconds:  # it took more than one step
            self.stats.staged_passes += 1
        return done

    def _check_failpoint(self, req: Any) -> None:
        if failpoints.active("compress_raise") and str(req.rid).startswith(failpoints.RID_PREFIX):
            raise failpoints.PlantedFault(f"planted fault compressing {req.rid}")

    def _apply(
        self, batch: Any, i: int, state: ReqKvState, policy: Policy, moment: str,
        positions: torch.Tensor, views: list[LayerView], chosen: HeadSelection | torch.Tensor,
        began_at: int | None = None,
    ) -> bool:
        """Compact the request to `chosen` and update its state. False if it was skipped.
        `began_at`: the entries a staged pass scored (the rest is the tail it keeps)."""
        req = batch.reqs[i]
        row = req.kv.req_pool_idx
        n = int(batch.seq_lens_cpu[i])
        logical_len = state.logical_len(n)
        try:
            running = getattr(self.scheduler, "running_batch", None)
            others = (running,) if running is not None and running is not batch else ()
            if isinstance(chosen, HeadSelection):
                result = compact_request_per_head(batch, i, chosen, others)
            else:
                result = compact_request(batch, i, chosen, others)
        except CompactionSkipped as e:
            logger.debug("compression of %s skipped: %s", req.rid, e)
            self.stats.skipped += 1
            return False
        if isinstance(chosen, HeadSelection):
            if policy.uses_stats:
                state.stats = self._with_gaps(carry_stats_per_head(policy, views, chosen))
            full = positions.expand(chosen.num_layers, chosen.num_heads, n)
            state.kept_positions = full.gather(-1, chosen.indices.cpu())
        else:
            if policy.uses_stats:
                state.stats = [
                    policy.carry_stats(v, chosen.to(v.keys.device)) if v is not None else None
                    for v in self._with_gaps(views)
                ]
            state.kept_positions = positions[chosen]
        if self._trace_path:
            self._trace(req, moment, policy.name, n, logical_len, state.kept_positions,
                        n if began_at is None else began_at)
        state.offset = logical_len - result.kept
        self.store.set_offset(row, state.offset)
        state.passes += 1
        self.store.trim_queries(row, result.kept)
        self.stats.passes += 1
        self.stats.evicted_tokens += n - result.kept
        setattr(self.stats, f"{moment}_passes", getattr(self.stats, f"{moment}_passes") + 1)
        if self.metrics:
            self.metrics.compressed(moment, n - result.kept)
        return True

    def _new_step(self) -> None:
        self._work_left = self.config.kv_pass_work
        self._step_seconds = 0.0

    def _account(self, seconds: float) -> float:
        """Time spent compressing: the step's total is the stall it caused the scheduler."""
        self.stats.seconds += seconds
        self._step_seconds += seconds
        self.stats.max_pass_seconds = max(self.stats.max_pass_seconds, self._step_seconds)
        if self.metrics:
            self.metrics.spent(seconds)
        return seconds

    def retracted(self, n: int) -> None:
        self.stats.retractions += n
        if self.metrics:
            self.metrics.retracted(n)

    def _trace(
        self, req: Any, moment: str, policy: str, n: int, logical_len: int, kept, began_at: int
    ) -> None:
        """`kept_positions`: a list (shared selection) or, per head, [layer][KV head] lists
        (this rank's layers and heads). `began_at`: physical length when the pass began."""
        event = {
            "rid": req.rid,
            "tp_rank": self.tp_rank,
            "moment": moment,
            "policy": policy,
            "selection": "per-head" if kept.dim() > 1 else "shared",
            "logical_len": logical_len,
            "physical_len": n,
            "began_at": began_at,
            "kept_positions": kept.tolist(),
        }
        with open(self._trace_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(event) + "\n")

    def _layers(self) -> range:
        return range(self.first_layer, self.num_layers)

    def _with_gaps(self, items: list[Any]) -> list[Any]:
        return [None] * self.first_layer + list(items)

    def _view(
        self, batch: Any, row: int, layer: int, n: int, positions: torch.Tensor, state: ReqKvState,
        queries: torch.Tensor | None | str = "current",
    ) -> LayerView:
        """Layer `layer` of the request's first n entries. `queries`: the window queries taken
        when a staged pass began (default: the current ones)."""
        pool = batch.token_to_kv_pool_allocator.get_kvcache()
        slots = batch.req_to_token_pool.req_to_token[row, :n].long()
        keys = pool.get_key_buffer(layer)[slots]
        stats = state.stats[layer] if layer < len(state.stats) else None
        if stats is not None:
            stats = stats[:, :n]  # a staged pass scores the entries it began with
        if positions.dim() > 1:  # per head: [L, H_kv, n] over this rank's layers
            positions = positions[layer - self.first_layer]
        return LayerView(
            keys=keys,
            queries=self.store.queries(row, layer, n) if isinstance(queries, str) else queries,
            positions=positions.to(keys.device),
            stats=stats,
        )
