"""The observation store shared by the attention backend and the compressor.

`KvcStore` lives on the attention backend object of a scheduler process. The attention backend
writes into it during forward passes (observation-window queries, attention statistics); the
compressor reads it between steps. Rows are SGLang's `req_pool_idx` (the `req_to_token` row).
Per-step work stays on the device and never syncs with the host: queries go into a ring
buffer (a write index per row, no shifting), query counts and RoPE position offsets are device
tensors indexed by the batch's rows.

A row whose observation failed in some layer (`lose_observations`) has its ring emptied: the
other layers' slots would otherwise keep an earlier step's (or the row's previous occupant's)
queries, and the request would be scored with them. It is scored with the queries recorded after
that, its own; a policy that needs queries and has none fails the request alone.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import Tensor

from sgl_kvc.core import graph_step
from sgl_kvc.core.decode import FUSED_BLOCK_BYTES, DecodeStep
from sgl_kvc.core.graph_step import GraphStep, GraphSteps
from sgl_kvc.core.host import host_tensor
from sgl_kvc.core.packed_rows import PackedRows, graph_width
from sgl_kvc.core.request_state import ReqKvState, RequestTables
from sgl_kvc.kernels.per_head_attention import HeadTables, flat_heads, fused_decode, per_head_extend
from sgl_kvc.policies import gqa_logits

logger = logging.getLogger(__name__)

STATS_BLOCK = 256  # query rows per block when accumulating prefill attention statistics


class KvcStore:
    """Observation-window queries and attention statistics, per `req_to_token` row."""

    def __init__(
        self, num_layers: int, window: int, req_to_token: Tensor, kv_pool: Any, first_layer: int = 0,
        plan: str | None = None,
    ) -> None:
        """`plan`: "fused" or "padded" forces the decode plan (`core/decode.py`; the torch kernel
        stands in for Triton where it cannot run, as on a CPU); None picks the device's: fused
        where the Triton kernel serves this pool (CUDA), padded elsewhere."""
        self.num_layers = num_layers
        self.first_layer = first_layer  # the layer whose call advances the per-row counters
        self.req_to_token = req_to_token  # SGLang's [rows, max_len] slot table
        self.kv_pool = kv_pool  # SGLang's KV pool (get_key_buffer(layer_id) -> [slots, H_kv, d])
        self.window = window
        # KV heads of this rank (a pass's cost is split per head) and key elements per entry
        key_shape = kv_pool.get_key_buffer(first_layer).shape if kv_pool is not None else (0, 1, 1)
        self.kv_heads = int(key_shape[1])
        self.token_elems = int(key_shape[1]) * int(key_shape[2])
        # Whether sgl-kvc's batched kernel computes decode attention (set by the compressor for
        # backends whose decode it replaces); otherwise only statistics requests are planned.
        self.attends = False
        # Whether a decode step reads the requests that hold nothing compressed as plain SGLang
        # reads them, where the dtype needs it (`DecodeStep`, `plain_decode`); else its kernel does.
        self.intact_as_sglang = True
        self.attended_layers = 0  # decode layer calls the kernel served (stats)
        # The unit pool's flat K [U, d] and V [U, d_v] (`--kv-head-budget variable`), else None.
        self.unit_pools: tuple[Any, Any] | None = (
            kv_pool.unit_buffers() if hasattr(kv_pool, "unit_buffers") else None
        )
        self.states: dict[int, ReqKvState] = {}
        self.stats_rows: set[int] = set()  # rows whose policy accumulates attention statistics
        rows, device = req_to_token.shape[0], req_to_token.device
        self.device = device
        # Whether decode runs a kernel that pads nothing (Triton on CUDA): then a step is one
        # block of the whole batch (`DecodeStep`), and a layer's attention one launch.
        self.fused = kv_pool is not None and self._fused_decode(kv_pool, plan)
        self.q_heads = 0  # query heads of this rank, once a query was seen (sizes fused blocks)
        self.block_bytes = FUSED_BLOCK_BYTES  # what a fused block may allocate per layer call
        # Ring buffer [capacity, layers, window, H_q, d] indexed by `_top - row`: SGLang hands out
        # request rows from the top of its free list and reuses freed ones first, so the
        # capacity needed follows the peak number of requests, not the row count SGLang reserves
        # (2048 rows of a 30-layer model's queries would outweigh a small KV pool).
        self._queries: Tensor | None = None
        self._top = rows - 1
        self._need = 1  # capacity the begun rows need
        self._head = torch.zeros(rows, dtype=torch.int64, device=device)  # slot of the newest
        self._count = torch.zeros(rows, dtype=torch.int64, device=device)
        # logical minus physical position of tokens appended since a row's last compaction
        self.offsets = torch.zeros(rows, dtype=torch.int64, device=device)
        self.offset_rows: set[int] = set()  # rows with a non-zero offset (host-side, no sync)
        self.decode_step: DecodeStep | None = None  # set by the scheduler before each decode
        self.decode_rows: list[int] = []  # rows of the current decode batch, set before it
        self.extend_rows: list[int] = []  # rows of the current extend batch, set before it
        self.lost_observations = 0  # rows whose observations were lost (a failed write), counted per event
        # Packed requests of the current extend batch (a prompt compacted between chunks on the
        # unit pool): their tables, new tokens included; they attend through them.
        self.extend_tables: dict[int, RequestTables] = {}
        # While a reconstruction forward runs (KVzip; `core/reconstruction.ReconstructionRound`):
        # its rows' queries are folded into their scores and nothing else is recorded for them.
        self.reconstruction: Any = None
        # Decode steps a CUDA graph can hold, once enabled (`enable_graphs`, `core/graph_step.py`).
        self.graphs: GraphSteps | None = None

    def _fused_decode(self, kv_pool: Any, plan: str | None) -> bool:
        """Whether this store plans decode steps fused: asked for (`plan`), or where the Triton
        kernel serves the pool; never where the pool cannot be read as flat units (then the
        padded plan serves, with the reason logged once)."""
        if plan == "padded" or (plan is None and self.device.type != "cuda"):
            return False
        try:
            if self.unit_pools is not None:
                k, v = self.unit_pools
            else:
                k, v = (flat_heads(b(self.first_layer)) for b in (kv_pool.get_key_buffer, kv_pool.get_value_buffer))
        except Exception as e:  # noqa: BLE001 - any pool layout sgl-kvc cannot view serves padded
            logger.warning("sgl-kvc: decode steps use the padded plan: %s cannot be read as flat units (%s: %s)",
                           type(kv_pool).__name__, type(e).__name__, e)
            return False
        return plan == "fused" or fused_decode(self.device, self.token_elems // max(1, self.kv_heads), k, v)

    @property
    def unit_layout(self) -> tuple[int, int] | None:
        """(layers of this rank, KV heads) on the unit pool, else None."""
        if self.unit_pools is None:
            return None
        return self.num_layers - self.first_layer, self.kv_heads

    # --- request lifecycle --------------------------------------------------------------------
    def begin(self, row: int, state: ReqKvState) -> None:
        self._need = max(self._need, self._top - row + 1)
        state.stats = [None] * self.num_layers
        self.states[row] = state
        self._count[row] = 0
        self.set_offset(row, 0)
        if state.policy.uses_stats:
            self.stats_rows.add(row)
        else:
            self.stats_rows.discard(row)

    def release(self, row: int) -> None:
        """The request of `row` finished, was aborted or retracted: drop what it held (its
        statistics, a staged pass's query copies, its tables); its queries are never read again
        (`begin` resets the row's count)."""
        self.states.pop(row, None)
        self.stats_rows.discard(row)
        self.set_offset(row, 0)
        if self.graphs is not None:
            self.graphs.release(row)

    @property
    def moment_holders(self) -> int:
        """Live requests holding prompt moments (Expected Attention's, `core/query_moments.py`)."""
        return sum(1 for state in self.states.values() if state.query_moments is not None)

    @property
    def state_bytes(self) -> int:
        """Bytes held by the live requests' states (statistics, pending passes, tables)."""
        total = 0
        for state in self.states.values():
            tensors = [t for t in state.stats if t is not None]
            if state.query_moments is not None:
                tensors += state.query_moments.tensors()
            if state.kept_positions is not None:
                tensors.append(state.kept_positions)
            if state.packed_entries is not None:
                total += state.packed_entries.nbytes
            if state.pending is not None:
                tensors += state.pending.tensors()
            for scores in (state.reconstruction, state.reconstructed):  # KVzip's scores, if any
                if scores is not None:
                    tensors += scores.tensors()
            total += sum(t.numel() * t.element_size() for t in tensors)
        return total

    def set_offset(self, row: int, offset: int) -> None:
        self.offsets[row] = offset
        if offset:
            self.offset_rows.add(row)
        else:
            self.offset_rows.discard(row)

    # --- observation-window queries -----------------------------------------------------------
    def _buffer(self, rows: int, q: Tensor) -> Tensor:
        self.q_heads = int(q.shape[1])
        have = 0 if self._queries is None else self._queries.shape[0]
        if have < self._need:  # grow by doubling, up to SGLang's row count
            capacity = min(max(self._need, 2 * have), rows)
            grown = q.new_zeros((capacity, self.num_layers, self.window, q.shape[1], q.shape[2]))
            if self._queries is not None:
                grown[:have] = self._queries
            self._queries = grown
        return self._queries

    def reserve_queries(self, q_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        """Allocate the ring for every row now: a decode step's writes then never allocate, and
        a CUDA graph that holds them keeps writing the buffer it captured (a grown ring would be
        a new tensor)."""
        rows = self.req_to_token.shape[0]
        self._need = rows
        self._buffer(rows, torch.empty(0, q_heads, head_dim, dtype=dtype, device=self.device))

    @property
    def query_buffer_bytes(self) -> int:
        q = self._queries
        return 0 if q is None else q.numel() * q.element_size()

    def record_decode(self, layer: int, rows: Tensor, q: Tensor, pool_rows: int) -> None:
        """q: [B, H_q, d], one new query per row. The first layer of the rank advances the rows'
        rings, after its write: a write that raises leaves them as they were."""
        buf = self._buffer(pool_rows, q)
        advance = layer == self.first_layer
        head = (self._head[rows] + 1) % self.window if advance else self._head[rows]
        buf[self._top - rows, layer, head] = q.to(buf.dtype)
        if advance:
            self._head[rows] = head
            self._count[rows] = (self._count[rows] + 1).clamp_(max=self.window)

    def record_extend(self, layer: int, row: int, q: Tensor, pool_rows: int) -> None:
        """q: [e, H_q, d], the queries of one request's extend (chunk), in order (the first layer
        advances the row's ring after its write, as `record_decode`)."""
        buf = self._buffer(pool_rows, q)
        m = min(q.shape[0], self.window)
        advance = layer == self.first_layer
        buf[self._top - row, layer, self._ring(row, m, ahead=m if advance else 0)] = q[-m:].to(buf.dtype)
        if advance:
            self._head[row] = (self._head[row] + m) % self.window
            self._count[row] = (self._count[row] + m).clamp_(max=self.window)

    def lose_observations(self, rows: list[int]) -> None:
        """The observation of `rows` failed in some layer: empty their rings (see the module doc)."""
        for row in rows:
            self._count[row] = 0
        self.lost_observations += len(rows)

    def _ring(self, row: int, m: int, ahead: int = 0) -> Tensor:
        """Ring indices of a row's last m queries, oldest first (`ahead`: after that many more)."""
        steps = torch.arange(1 - m + ahead, 1 + ahead, device=self._head.device)
        return (self._head[row] + steps) % self.window

    def window_queries(self, row: int, n: int) -> list[Tensor | None]:
        """The last min(count, window, n) queries of a row, oldest first, one tensor (or None)
        per layer of this rank. The row's count is read once (on CUDA a read is a device sync)
        for every layer, since a pass starts with every layer's queries."""
        layers = self.num_layers - self.first_layer
        m = 0 if self._queries is None else min(int(self._count[row]), n)
        if m == 0:
            return [None] * layers
        picked = self._queries[self._top - row, self.first_layer : self.num_layers][:, self._ring(row, m)]
        return list(picked.unbind(0))

    def trim_queries(self, row: int, n: int) -> None:
        """After compaction to n tokens, fewer queries than tokens may remain valid."""
        self._count[row] = self._count[row].clamp(max=n)

    # --- whole-prompt query moments ------------------------------------------------------------
    def add_query_moments(self, row: int, layer: int, q: Tensor, positions: Tensor, first: int) -> None:
        """Fold a chunk's queries q [e, H_q, d] (after RoPE, at logical `positions` [e], the first
        `first` on the host) into the row's query moments, if its prompt policy reads them."""
        state = self.states.get(row)
        if state is not None and state.query_moments is not None:
            state.query_moments.add(layer, q, positions, first)

    # --- attention statistics ------------------------------------------------------------------
    def accumulate(
        self, row: int, layer: int, q: Tensor, keys: Tensor, q_pos: Tensor, k_pos: Tensor, scale: float
    ) -> None:
        """Feed the softmax attention of queries q [e, H_q, d] (at physical indices q_pos) over
        keys [n, H_kv, d] (physical indices k_pos) to the row's policy statistic, causally."""
        state = self.states.get(row)
        if state is None or not state.policy.uses_stats:
            return
        h_kv, h_q = keys.shape[1], q.shape[1]
        for start in range(0, q.shape[0], STATS_BLOCK):
            qb = q[start : start + STATS_BLOCK]
            logits = gqa_logits(qb, keys, scale)  # [H_kv, G, q, n], no repeated keys
            causal = k_pos[None, :] > q_pos[start : start + STATS_BLOCK, None]
            logits.masked_fill_(causal, -math.inf)
            probs = torch.softmax(logits, dim=-1).reshape(h_q, qb.shape[0], -1)
            state.stats[layer] = state.policy.accumulate(state.stats[layer], probs, h_kv)

    # --- extend -------------------------------------------------------------------------------
    def begin_extend(self, rows: list[int], lens: list[int]) -> None:
        """Before an extend forward: its rows and, for its packed requests, their per-head tables
        over `lens` slots (the new tokens' slots are in the row already), from host-side data."""
        self.extend_rows = rows
        self.extend_tables = {}
        layout = self.unit_layout
        if layout is None:
            return
        for row, n in zip(rows, lens):
            state = self.states.get(row)
            if state is not None and state.packed_entries is not None:
                self.extend_tables[row] = state.tables(self.req_to_token[row, :n], *layout)

    def attend_extend(self, layer: int, row: int, q: Tensor, positions: Tensor, scale: float) -> Tensor:
        """Extend attention of a packed request (q: [e, H_q, d] at logical `positions`) through
        its per-head tables, causal by logical position; the attention feeds its statistic when
        its policy adds prefill attention (H2O, Batch-Max). Returns [e, H_q, d_v]."""
        tables, state = self.extend_tables[row], self.states[row]
        on_probs = None
        if state.policy.uses_stats and state.policy.accumulate_prefill and self.reconstruction is None:

            def on_probs(start: int, stop: int, probs: Tensor) -> None:  # [1, H_kv, G, q, N]
                h_kv = probs.shape[1]
                grouped = probs[0].reshape(-1, stop - start, probs.shape[-1])  # query head h: KV head h // G
                state.stats[layer] = state.policy.accumulate(state.stats[layer], grouped, h_kv)

        # its statistic indexes the tables' columns; the attention alone reads the layer's own
        units, lens, kept = tables.layer(layer - self.first_layer, own_width=on_probs is None)
        heads = HeadTables(units=units[None], lengths=lens[None], positions=kept[None])

        indptr = host_tensor([0, q.shape[0]], q.device)
        k_units, v_units = self.unit_pools
        return per_head_extend(q, indptr, positions, k_units, v_units, heads, scale, on_probs=on_probs,
                               q_max=q.shape[0])

    # --- decode ---------------------------------------------------------------------------------
    def enable_graphs(self, q_heads: int, head_dim: int, dtype: torch.dtype, arena_units: int) -> None:
        """Decode steps a CUDA graph can hold from now on (`core/graph_step.py`): the observation
        ring reserved for every row, and on the unit pool the packed rows' layout with an arena of
        `arena_units` units. Before SGLang captures its graphs."""
        self.reserve_queries(q_heads, head_dim, dtype)
        layout = self.unit_layout
        packed = None if layout is None else PackedRows(self.req_to_token.shape[0], *layout, arena_units, self.device)
        self.graphs = GraphSteps(packed=packed)
        self.decode_step = GraphStep(size=0, width=graph_width([]), attends=self.attends)

    def begin_decode(self, rows: list[int], lens: list[int]) -> None:
        """Before a decode forward: plan it from the batch's `req_to_token` rows and cached
        entries (host-side data: no device sync in the forward)."""
        self.decode_rows = rows
        if self.graphs is not None:
            step = self.graphs.plan(rows, lens, self.states, self.attends)
            if step is not None:
                self.decode_step = step
                if step.attends:
                    self.attended_layers += self.num_layers - self.first_layer
                return
        self.decode_step = (
            DecodeStep.build(rows, lens, self.states, self.req_to_token, self.token_elems, self.attends,
                             units=self.unit_layout, first_layer=self.first_layer, fused=self.fused,
                             kv_heads=self.kv_heads, num_layers=self.num_layers - self.first_layer,
                             group=max(1, self.q_heads // max(1, self.kv_heads)) if self.q_heads else 8,
                             block_bytes=self.block_bytes, intact_apart=self.intact_as_sglang)
            if self.attends or self.stats_rows else None
        )  # fmt: skip

    def attend_decode(
        self, layer: int, step: DecodeStep | GraphStep, q: Tensor, k_cache: Any, v_cache: Any, scale: float,
        out: Tensor, rows: Tensor | None = None, seq_lens: Tensor | None = None,
    ) -> None:
        """The step's decode attention through sgl-kvc's kernel (see `DecodeStep.attend`; a
        `GraphStep` reads the batch's `rows` and `seq_lens`, SGLang's device tensors, in place)."""
        if isinstance(step, GraphStep):
            graph_step.attend(step, layer - self.first_layer, q, k_cache, v_cache, scale, out, rows, seq_lens,
                              self.req_to_token, self.kv_heads, self.unit_pools, self.graphs.packed)
            return
        self.attended_layers += 1
        step.attend(layer, q, k_cache, v_cache, scale, out, self.unit_pools)
