"""Per-request compression state and the observation store shared by scheduler and attention.

`KvcStore` lives on the attention backend object of a scheduler process. The attention backend
writes into it during forward passes (observation-window queries, attention statistics); the
compressor reads it between steps. Rows are SGLang's `req_pool_idx` (the `req_to_token` row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from sgl_kvc.policies import Policy

STATS_BLOCK = 256  # query rows per block when accumulating prefill attention statistics


@dataclass
class ReqKvState:
    """What the compressor knows about one request, beyond SGLang's own `Req`.

    Physical index j (its slot is `req_to_token[row, j]`) holds the token at logical position
    `kept_positions[j]` for j < len(kept_positions), and `j + offset` after that: every token
    appended since the last compaction sits at its logical position minus `offset`.
    """

    policy: Policy
    budget: int
    budget_ratio: float | None = None
    kept_positions: Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    offset: int = 0
    stats: list[Tensor | None] = field(default_factory=list)
    passes: int = 0

    @property
    def compressed(self) -> bool:
        return self.passes > 0

    def positions(self, n: int) -> Tensor:
        k = self.kept_positions.numel()
        tail = torch.arange(k, n, dtype=torch.int64) + self.offset
        return torch.cat([self.kept_positions[:n], tail]) if k else tail

    def effective_budget(self, n: int) -> int:
        if self.budget_ratio is None:
            return self.budget
        return max(self.policy.params.window + 1, math.ceil(self.budget_ratio * (n + self.offset)))


class KvcStore:
    """Observation-window queries and attention statistics, per `req_to_token` row."""

    def __init__(self, num_layers: int, window: int, req_to_token: Tensor, kv_pool: object) -> None:
        self.num_layers = num_layers
        self.req_to_token = req_to_token  # SGLang's [rows, max_len] slot table
        self.kv_pool = kv_pool  # SGLang's KV pool (get_key_buffer(layer_id) -> [slots, H_kv, d])
        self.window = window
        self.states: dict[int, ReqKvState] = {}
        self.stats_rows: set[int] = set()  # rows whose policy accumulates attention statistics
        self._queries: Tensor | None = None  # [rows, layers, window, H_q, d]
        self._count: dict[int, int] = {}

    # --- request lifecycle --------------------------------------------------------------------
    def begin(self, row: int, state: ReqKvState) -> None:
        state.stats = [None] * self.num_layers
        self.states[row] = state
        self._count[row] = 0
        if state.policy.uses_stats:
            self.stats_rows.add(row)
        else:
            self.stats_rows.discard(row)

    # --- observation-window queries -----------------------------------------------------------
    def _buffer(self, rows: int, q: Tensor) -> Tensor:
        if self._queries is None:
            self._queries = q.new_zeros(
                (rows, self.num_layers, self.window, q.shape[1], q.shape[2])
            )
        return self._queries

    def record_decode(self, layer: int, rows: Tensor, q: Tensor, pool_rows: int) -> None:
        """q: [B, H_q, d], one new query per row."""
        buf = self._buffer(pool_rows, q)
        if self.window > 1:
            buf[rows, layer, :-1] = buf[rows, layer, 1:].clone()
        buf[rows, layer, -1] = q.to(buf.dtype)
        if layer == 0:
            for r in rows.tolist():
                self._count[r] = min(self._count.get(r, 0) + 1, self.window)

    def record_extend(self, layer: int, row: int, q: Tensor, pool_rows: int) -> None:
        """q: [e, H_q, d], the queries of one request's extend (chunk), in order."""
        buf = self._buffer(pool_rows, q)
        m = min(q.shape[0], self.window)
        if m < self.window:
            buf[row, layer, :-m] = buf[row, layer, m:].clone()
        buf[row, layer, -m:] = q[-m:].to(buf.dtype)
        if layer == 0:
            self._count[row] = min(self._count.get(row, 0) + m, self.window)

    def queries(self, row: int, layer: int, n: int) -> Tensor | None:
        """The last min(count, window, n) queries of a row, oldest first."""
        m = min(self._count.get(row, 0), n)
        if self._queries is None or m == 0:
            return None
        return self._queries[row, layer, self.window - m :]

    def trim_queries(self, row: int, n: int) -> None:
        """After compaction to n tokens, fewer queries than tokens may remain valid."""
        self._count[row] = min(self._count.get(row, 0), n)

    # --- attention statistics ------------------------------------------------------------------
    def accumulate(
        self, row: int, layer: int, q: Tensor, keys: Tensor, q_pos: Tensor, k_pos: Tensor, scale: float
    ) -> None:
        """Feed the softmax attention of queries q [e, H_q, d] (at physical indices q_pos) over
        keys [n, H_kv, d] (physical indices k_pos) to the row's policy statistic, causally."""
        state = self.states.get(row)
        if state is None or not state.policy.uses_stats:
            return
        h_kv = keys.shape[1]
        group = q.shape[1] // h_kv
        k = keys.float().repeat_interleave(group, dim=1)  # [n, H_q, d]: query head h -> kv h // G
        for start in range(0, q.shape[0], STATS_BLOCK):
            qb = q[start : start + STATS_BLOCK].float()
            logits = torch.einsum("qhd,nhd->hqn", qb, k) * scale
            causal = k_pos[None, :] > q_pos[start : start + STATS_BLOCK, None]
            logits.masked_fill_(causal[None], -math.inf)
            probs = torch.softmax(logits, dim=-1)
            state.stats[layer] = state.policy.accumulate(state.stats[layer], probs, h_kv)
