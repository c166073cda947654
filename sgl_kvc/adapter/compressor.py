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
    CompactionResult,
    CompactionSkipped,
    compact_request,
    compact_requests_per_head,
    compact_requests_units,
)
from sgl_kvc.adapter.invariants import InvariantViolation
from sgl_kvc.adapter.metrics import maybe_metrics
from sgl_kvc.adapter.requests import abort_running, is_middle_chunk, request_settings
from sgl_kvc.adapter.state import KvcStore, ReqKvState, RequestTables
from sgl_kvc.adapter.tp import ScoreReducer, tp_rank
from sgl_kvc.config import KvcConfig
from sgl_kvc.policies import (
    HeadSelection,
    LayerView,
    Policy,
    carry_stats_per_head,
    get_policy,
    select_from_scores,
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
    max_compacted_together: int = 0  # most requests compacted by one batched move (same step)


@dataclass
class PendingPass:
    """A per-head pass spread over scheduler steps (`--kv-pass-work`): each step scores and
    selects some layers, or some KV heads of a layer, of the n0 entries the request held when it
    began; the compaction runs when every (layer, KV head) has chosen. Entries appended
    meanwhile (the tail) are kept by every head. Per-head selection makes this exact: a head's
    choice depends on no other head or layer, and the window queries are taken when the pass
    begins, as a one-step pass would read them."""

    moment: str
    policy: Policy
    n0: int
    target: int
    positions: torch.Tensor
    queries: list[torch.Tensor | None]
    indices: list[torch.Tensor] = field(default_factory=list)  # per layer done: [H_kv, target]
    heads: list[torch.Tensor] = field(default_factory=list)  # of the next layer, done: [target]
    seconds: float = 0.0
    # Variable budgets (unit pool): the per-head tables the pass scores, and the scores and
    # protected masks of the (layer, head)s done, in (layer, head) order; one sort at the end.
    tables: RequestTables | None = None
    scores: list[torch.Tensor] = field(default_factory=list)
    protected: list[torch.Tensor] = field(default_factory=list)


@dataclass
class DueCompaction:
    """A per-head selection made in this step, compacted together with the step's others."""

    i: int  # index in the batch
    state: ReqKvState
    policy: Policy
    moment: str
    selection: HeadSelection
    kept_positions: torch.Tensor  # [L, H_kv, k]
    stats: list[torch.Tensor | None] | None  # carried statistics (policies that keep them)
    began_at: int
    staged: bool
    units: torch.Tensor | None = None  # the request's tables [L, H_kv, N] (variable budgets)
    n: int = 0  # cache entries (row slots) when it was selected; 0: selection.n (no tables)


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
        self._due: list[DueCompaction] = []  # per-head compactions of the current moment
        self._step_seconds = 0.0  # compression work in this step so far
        self.metrics = maybe_metrics(model_runner, config.policy)
        backend = model_runner.attn_backend
        if config.compressing and hasattr(backend, "kvc_store"):
            # Only a compressing server observes attention: with --policy none the backend does
            # exactly what SGLang's does (per-request compression is refused on such a server).
            backend.kvc_store = self.store
            self.store.attends = config.kv_decode_attention == "batched" and backend.kvc_attends

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
        """Before a prefill (chunk): give requests seen for the first time their state, and tell
        the observation store the batch's rows (host-side: no device sync in the forward)."""
        self.store.extend_rows = [req.kv.req_pool_idx for req in batch.reqs]
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

    def begin_decode(self, batch: Any, fb: Any) -> None:
        """Before a decode forward: the step's statistics requests, from host-side data."""
        rows = [req.kv.req_pool_idx for req in batch.reqs]
        self.store.begin_decode(rows, fb.seq_lens_cpu.tolist())  # a CPU tensor: no device sync

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
        self._flush(batch)

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
        self._flush(batch)

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
                passes = state.passes
                self._guarded(req, "compress", self._start_pass, batch, i, state, budget, "preempt", True)
                self._flush(batch)
                compressed |= state.passes > passes
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
    def _start_pass(
        self, batch: Any, i: int, state: ReqKvState, target: int, moment: str, whole: bool = False
    ) -> None:
        """Begin a pass to `target` entries. Per head, a pass costing more than `--kv-pass-work`
        is spread over steps unless `whole` (the preempt moment) or staging is off."""
        self._check_failpoint(batch.reqs[i])
        if not state.per_head:
            self._compress_shared(batch, i, state, target, moment)
            return
        row = batch.reqs[i].kv.req_pool_idx
        n = int(batch.seq_lens_cpu[i])
        tables = self._tables(batch, row, n, state) if self.config.variable_budget else None
        state.pending = PendingPass(  # a staged pass in progress is superseded
            moment=moment,
            policy=self.policy(state.policy.name, state.effective_budget(n)),
            n0=n,
            target=min(target, n),
            positions=state.positions(n) if tables is None else tables.positions,
            queries=[self.store.queries(row, layer, n) for layer in self._layers()],
            tables=tables,
        )
        self._advance(batch, i, state, whole or self.config.kv_pass_work <= 0)

    def _advance(self, batch: Any, i: int, state: ReqKvState, whole: bool = False) -> None:
        """Score what fits in this step's work: whole layers, or one KV head at a time where a
        layer does not fit (the step's first head always runs, so every step makes progress;
        `whole`: everything). Once every (layer, KV head) has chosen, the compaction is due: it
        runs with the step's others in `_flush`. One layer's keys are held at a time. Every
        (layer, KV head) keeps its own `target` best entries; each TP rank holds whole KV heads
        and chooses for its own."""
        p = state.pending
        assert p is not None
        if p.tables is not None:
            self._advance_variable(batch, i, state, whole)
            return
        t0 = time.perf_counter()
        row = batch.reqs[i].kv.req_pool_idx
        layers = list(self._layers())
        layer_cost = p.policy.score_cost(p.n0)
        head_cost = -(-layer_cost // self.store.kv_heads)
        while len(p.indices) < len(layers):
            first = self._work_left == self.config.kv_pass_work
            whole_layer = not p.heads and (whole or self._work_left >= layer_cost)
            if not (whole_layer or whole or first or self._work_left >= head_cost):
                break
            layer = len(p.indices)
            view = self._view(batch, row, layers[layer], p.n0, p.positions, state, p.queries[layer])
            if whole_layer:
                p.indices.append(select_per_head(p.policy, [view], p.target).indices[0])
                self._work_left -= layer_cost
                continue
            sub = view.head(len(p.heads))
            p.heads.append(select_per_head(p.policy, [sub], p.target).indices[0, 0])
            self._work_left -= head_cost
            if len(p.heads) == view.n_kv_heads:
                p.indices.append(torch.stack(p.heads))
                p.heads = []
        if len(p.indices) < len(layers):
            p.seconds += self._account(time.perf_counter() - t0)
            return
        state.pending = None
        n = int(batch.seq_lens_cpu[i])
        indices = torch.stack(p.indices)  # [L, H_kv, target] over the first n0 entries
        if n > p.n0:  # the tail appended since the pass began: every head keeps it
            tail = torch.arange(p.n0, n, device=indices.device)
            indices = torch.cat([indices, tail.expand(*indices.shape[:2], n - p.n0)], dim=-1)
        lengths = torch.full(indices.shape[:2], indices.shape[-1], dtype=torch.int64)
        selection = HeadSelection(indices=indices, lengths=lengths, n=n)
        positions = state.positions(n)
        stats = None
        if p.policy.uses_stats:  # views made one layer at a time (a generator)
            views = (self._view(batch, row, layer, n, positions, state) for layer in layers)
            stats = self._with_gaps(carry_stats_per_head(p.policy, views, selection))
        full = positions.expand(selection.num_layers, selection.num_heads, n)
        self._due.append(DueCompaction(
            i=i, state=state, policy=p.policy, moment=p.moment, selection=selection,
            kept_positions=full.gather(-1, indices.cpu()), stats=stats, began_at=p.n0,
            staged=p.seconds > 0,
        ))  # fmt: skip
        self._account(time.perf_counter() - t0)

    def _advance_variable(self, batch: Any, i: int, state: ReqKvState, whole: bool = False) -> None:
        """`_advance` for variable budgets (KV-Compress §4.2): score one (layer, KV head) at a
        time, each from its own entries (after a variable compaction heads hold different
        numbers), as work allows; once all have scored, ONE sort over layer x head x entry
        chooses what the request keeps (`select_from_scores`, mode `--kv-head-budget`: variable,
        or layer for one sort per layer)."""
        t0 = time.perf_counter()
        p = state.pending
        tables = p.tables
        row = batch.reqs[i].kv.req_pool_idx
        num_layers, num_heads = tables.lens.shape
        while len(p.scores) < num_layers * num_heads:
            layer, head = divmod(len(p.scores), num_heads)
            cost = -(-p.policy.score_cost(int(tables.lens[layer, head])) // num_heads)
            first = self._work_left == self.config.kv_pass_work
            if not (whole or first or self._work_left >= cost):
                break
            view = self._head_view(row, tables, layer, head, state, p.queries[layer])
            p.scores.append(p.policy.score(view)[0])
            p.protected.append(p.policy.protected(view).cpu())
            self._work_left -= cost
        if len(p.scores) < num_layers * num_heads:
            p.seconds += self._account(time.perf_counter() - t0)
            return
        state.pending = None
        scores = torch.full((num_layers, num_heads, tables.width), -torch.inf)
        protected = torch.zeros(scores.shape, dtype=torch.bool)
        for k, (score, prot) in enumerate(zip(p.scores, p.protected)):
            scores[k // num_heads, k % num_heads, : score.numel()] = score.cpu()
            protected[k // num_heads, k % num_heads, : prot.numel()] = prot
        chosen = select_from_scores(scores, protected, p.target, lengths=tables.lens, mode=self.config.kv_head_budget)
        # Entries appended since the pass began (after each head's own columns): every head keeps them.
        n = int(batch.seq_lens_cpu[i])
        now = self._tables(batch, row, n, state)
        tail = torch.arange(n - p.n0)
        indices = torch.full((num_layers, num_heads, chosen.max_keep + tail.numel()), HeadSelection.PAD)
        indices[..., : chosen.max_keep] = chosen.indices
        indices.scatter_(-1, chosen.lengths[..., None] + tail, tables.lens[..., None] + tail)
        selection = HeadSelection(indices=indices, lengths=chosen.lengths + tail.numel(), n=now.width)
        safe = torch.where(selection.valid(), selection.indices, 0)
        stats = None
        if p.policy.uses_stats:
            stats = self._with_gaps([
                self._carry_head_stats(p.policy, row, now, layer, state, selection)
                for layer in range(num_layers)
            ])  # fmt: skip
        self._due.append(DueCompaction(
            i=i, state=state, policy=p.policy, moment=p.moment, selection=selection,
            kept_positions=now.positions.gather(-1, safe) * selection.valid(), stats=stats,
            began_at=p.n0, staged=p.seconds > 0, units=now.units, n=n,
        ))  # fmt: skip
        self._account(time.perf_counter() - t0)

    def _carry_head_stats(
        self, policy: Policy, row: int, tables: RequestTables, layer: int, state: ReqKvState,
        selection: HeadSelection,
    ) -> torch.Tensor:
        """Layer `layer`'s statistic after a variable compaction: [H_kv, max_keep], each head's
        kept columns of what the policy carries (KV-Compress: eq. 20 seeded), zero padded."""
        out = torch.zeros(selection.num_heads, selection.max_keep)
        for head in range(selection.num_heads):
            view = self._head_view(row, tables, layer, head, state)
            full = policy.carry_stats(view, torch.arange(view.n, device=view.keys.device))
            kept = selection.kept(layer, head)
            if full is not None:
                out[head, : kept.numel()] = full[0, kept.to(full.device)].cpu()
        return out

    def _tables(self, batch: Any, row: int, n: int, state: ReqKvState) -> RequestTables:
        layout = self.store.unit_layout
        assert layout is not None, "variable budgets are served from the unit pool"
        return state.tables(batch.req_to_token_pool.req_to_token[row, :n], *layout)

    def _head_view(
        self, row: int, tables: RequestTables, layer: int, head: int, state: ReqKvState,
        queries: torch.Tensor | None | str = "current",
    ) -> LayerView:
        """KV head `head` of local layer `layer` alone, from its own entries (its keys through
        the tables, its query group, its statistic and positions). `queries`: as in `_view`."""
        k_units, _ = self.store.unit_pools
        m = int(tables.lens[layer, head])
        keys = k_units[tables.units[layer, head, :m].to(k_units.device)].unsqueeze(1)  # [m, 1, d]
        layer_id = self.first_layer + layer
        q = self.store.queries(row, layer_id, m) if isinstance(queries, str) else queries
        if q is not None:
            group = q.shape[1] // int(tables.lens.shape[1])
            q = q[-m:, head * group : (head + 1) * group]
        stats = state.stats[layer_id] if layer_id < len(state.stats) else None
        if stats is not None:
            stats = stats[head : head + 1, :m]
        positions = tables.positions[layer, head, :m][None].to(keys.device)
        return LayerView(keys=keys, queries=q, positions=positions, stats=stats)

    def _flush(self, batch: Any) -> None:
        """Compact the requests whose per-head pass finished in this moment, together (one
        gather + scatter per layer for all of them)."""
        due, self._due = self._due, []
        if not due:
            return
        t0 = time.perf_counter()
        self.stats.max_compacted_together = max(self.stats.max_compacted_together, len(due))
        outcomes: list[CompactionResult | Exception]
        try:
            if due[0].units is not None:  # variable budgets: every pass of this server
                outcomes = compact_requests_units(
                    batch, [(d.i, d.selection, d.units) for d in due], self.store.unit_pools,
                    self._other_batches(batch),
                )
            else:
                outcomes = compact_requests_per_head(
                    batch, [(d.i, d.selection) for d in due], self._other_batches(batch)
                )
        except InvariantViolation:
            raise
        except Exception as e:  # noqa: BLE001 - each due request fails alone below
            outcomes = [e] * len(due)
        for d, outcome in zip(due, outcomes):
            self._guarded(batch.reqs[d.i], "compress", self._commit, batch, d, outcome)
        self._account(time.perf_counter() - t0)

    def _commit(self, batch: Any, d: DueCompaction, outcome: CompactionResult | Exception) -> None:
        if isinstance(outcome, CompactionSkipped):
            self._skipped(batch.reqs[d.i], outcome)
            return
        if isinstance(outcome, Exception):
            raise outcome
        if d.stats is not None:
            d.state.stats = d.stats
        d.state.kept_positions = d.kept_positions
        if outcome.units is not None:  # packed into the unit pool
            d.state.units, d.state.unit_lens, d.state.packed = outcome.units, d.selection.lengths, outcome.kept
        if d.staged:
            self.stats.staged_passes += 1
        n = d.n or d.selection.n  # a packed request's tables are wider than its row
        self._record(batch, d.i, d.state, d.policy.name, d.moment, n, outcome, d.began_at)

    def _compress_shared(self, batch: Any, i: int, state: ReqKvState, target: int, moment: str) -> None:
        """The shared selection: one set of tokens for every layer and head, in one step."""
        t0 = time.perf_counter()
        row = batch.reqs[i].kv.req_pool_idx
        n = int(batch.seq_lens_cpu[i])
        policy = self.policy(state.policy.name, state.effective_budget(n))
        positions = state.positions(n)
        views = [self._view(batch, row, layer, n, positions, state) for layer in self._layers()]
        chosen = policy.select(views, target, reduce=self.reduce_scores).cpu()
        try:
            result = compact_request(batch, i, chosen, self._other_batches(batch))
        except CompactionSkipped as e:
            self._skipped(batch.reqs[i], e)
            self._account(time.perf_counter() - t0)
            return
        if policy.uses_stats:
            state.stats = [
                policy.carry_stats(v, chosen.to(v.keys.device)) if v is not None else None
                for v in self._with_gaps(views)
            ]
        state.kept_positions = positions[chosen]
        self._record(batch, i, state, policy.name, moment, n, result, n)
        self._account(time.perf_counter() - t0)

    def _record(
        self, batch: Any, i: int, state: ReqKvState, policy: str, moment: str, n: int,
        result: CompactionResult, began_at: int,
    ) -> None:
        """After a compaction of request i from n entries: its offset, query count and the
        counters. `began_at`: the entries a staged pass scored (the rest is the tail it kept)."""
        req = batch.reqs[i]
        row = req.kv.req_pool_idx
        logical_len = state.logical_len(n)  # the offset is still the one before compaction
        if self._trace_path:
            self._trace(req, moment, policy, n, logical_len, state, result.kept, began_at)
        state.offset = logical_len - result.kept
        self.store.set_offset(row, state.offset)
        state.passes += 1
        self.store.trim_queries(row, result.kept)
        if result.freed:
            self._reopen_admission(batch)
        self.stats.passes += 1
        self.stats.evicted_tokens += n - result.kept
        setattr(self.stats, f"{moment}_passes", getattr(self.stats, f"{moment}_passes") + 1)
        if self.metrics:
            self.metrics.compressed(moment, n - result.kept)

    def _reopen_admission(self, batch: Any) -> None:
        """A compaction freed slots: let the scheduler try its waiting requests again. SGLang
        stops admitting once a request did not fit (`batch_is_full`) and reopens only when a
        request leaves; freed slots are the same news (sglang 0.5.23, `Scheduler
        .get_new_batch_prefill`). Without this, a request admitted while another's staged pass
        still held its whole prompt would keep the queue shut until that request finished."""
        for b in (batch, getattr(self.scheduler, "running_batch", None)):
            if b is not None and getattr(b, "batch_is_full", False):
                b.batch_is_full = False

    def _skipped(self, req: Any, e: CompactionSkipped) -> None:
        logger.debug("compression of %s skipped: %s", req.rid, e)
        self.stats.skipped += 1

    def _other_batches(self, batch: Any) -> tuple[Any, ...]:
        """The other running batch (read only by the invariant check)."""
        running = getattr(self.scheduler, "running_batch", None)
        return (running,) if running is not None and running is not batch else ()

    def _check_failpoint(self, req: Any) -> None:
        if failpoints.active("compress_raise") and str(req.rid).startswith(failpoints.RID_PREFIX):
            raise failpoints.PlantedFault(f"planted fault compressing {req.rid}")

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
        self, req: Any, moment: str, policy: str, n: int, logical_len: int, state: ReqKvState,
        physical_kept: int, began_at: int,
    ) -> None:
        """`kept_positions`: a list (shared selection) or, per head, [layer][KV head] lists
        (this rank's layers and heads; of different lengths under variable budgets).
        `began_at`: physical length when the pass began; `physical_kept`: slots kept."""
        kept = state.kept_positions
        positions = kept.tolist()
        if state.units is not None:
            lens = state.unit_lens.tolist()
            positions = [[p[: m] for p, m in zip(ps, ms)] for ps, ms in zip(positions, lens)]
        event = {
            "rid": req.rid,
            "tp_rank": self.tp_rank,
            "moment": moment,
            "policy": policy,
            "selection": "per-head" if kept.dim() > 1 else "shared",
            "logical_len": logical_len,
            "physical_len": n,
            "began_at": began_at,
            "physical_kept": physical_kept,
            "kept_positions": positions,
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
