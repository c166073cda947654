"""Per-request compression state and the observation store shared by scheduler and attention.

`KvcStore` lives on the attention backend object of a scheduler process. The attention backend
writes into it during forward passes (observation-window queries, attention statistics); the
compressor reads it between steps. Rows are SGLang's `req_pool_idx` (the `req_to_token` row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from sgl_kvc.policies import DEFAULT_SELECTION, Policy

STATS_BLOCK = 256  # query rows per block when accumulating prefill attention statistics
DECODE_STATS_ELEMS = 1 << 24  # bound on the padded key block of a batched decode statistic


@dataclass(frozen=True)
class DecodeStep:
    """The requests of one decode step whose policy keeps attention statistics, taken from the
    scheduler's host-side batch once per step (no device sync), with their device copies made
    once for every layer: `picked` are batch indices, `rows` their `req_to_token` rows,
    `lens` their cached entries."""

    picked: list[int]
    rows: list[int]
    lens: list[int]
    picked_t: Tensor
    rows_t: Tensor
    lens_t: Tensor

    @classmethod
    def build(cls, rows: list[int], lens: list[int], stats_rows: set[int], device: Any) -> "DecodeStep":
        picked = [i for i, row in enumerate(rows) if row in stats_rows]
        rows, lens = [rows[i] for i in picked], [lens[i] for i in picked]

        def dev(x: list[int]) -> Tensor:
            return torch.tensor(x, dtype=torch.int64).to(device, non_blocking=True)

        return cls(picked, rows, lens, dev(picked), dev(rows), dev(lens))


@dataclass
class ReqKvState:
    """What the compressor knows about one request, beyond SGLang's own `Req`.

    Physical index j (its slot is `req_to_token[row, j]`) holds the token at logical position
    `kept_positions[..., j]` for j < k (the number of entries kept by the last compaction), and
    `j + offset` after that: every token appended since the last compaction sits at its logical
    position minus `offset`. `kept_positions` is [k] after a shared compaction (the same token in
    every layer and head) and [L, H_kv, k] after a per-head one (entry j of head h of layer l is
    its own token: layer l's KV head h of slot `req_to_token[row, j]` holds it).
    """

    policy: Policy
    budget: int
    budget_ratio: float | None = None
    selection: str = DEFAULT_SELECTION
    kept_positions: Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    offset: int = 0
    stats: list[Tensor | None] = field(default_factory=list)
    passes: int = 0
    pending: Any = None  # the compressor's PendingPass while a staged pass is under way

    @property
    def compressed(self) -> bool:
        return self.passes > 0

    @property
    def per_head(self) -> bool:
        return self.selection == "per-head"

    def positions(self, n: int) -> Tensor:
        """Logical positions of the n cached entries: [n], or [L, H_kv, n] once per-head."""
        kept = self.kept_positions[..., :n]
        k = kept.shape[-1]
        tail = torch.arange(k, n, dtype=torch.int64) + self.offset
        if kept.dim() > 1:
            tail = tail.expand(*kept.shape[:-1], n - k)
        return torch.cat([kept, tail], dim=-1) if k else tail

    def logical_len(self, n: int) -> int:
        """Tokens the request has processed, for n cached entries (the newest is at n-1+offset,
        or, right after a compaction, the kept entries end at offset + k)."""
        return n + self.offset

    def effective_budget(self, n: int) -> int:
        if self.budget_ratio is None:
            return self.budget
        return max(self.policy.params.window + 1, math.ceil(self.budget_ratio * self.logical_len(n)))


class KvcStore:
    """Observation-window queries and attention statistics, per `req_to_token` row.

    Per-step work stays on the device and never syncs with the host: queries go into a ring
    buffer (a write index per row, no shifting), query counts and RoPE position offsets are
    device tensors indexed by the batch's rows.
    """

    def __init__(
        self, num_layers: int, window: int, req_to_token: Tensor, kv_pool: object, first_layer: int = 0
    ) -> None:
        self.num_layers = num_layers
        self.first_layer = first_layer  # the layer whose call advances the per-row counters
        self.req_to_token = req_to_token  # SGLang's [rows, max_len] slot table
        self.kv_pool = kv_pool  # SGLang's KV pool (get_key_buffer(layer_id) -> [slots, H_kv, d])
        self.window = window
        # KV heads of this rank (a pass's cost is split per head)
        self.kv_heads = int(kv_pool.get_key_buffer(first_layer).shape[1]) if kv_pool is not None else 1
        self.states: dict[int, ReqKvState] = {}
        self.stats_rows: set[int] = set()  # rows whose policy accumulates attention statistics
        rows, device = req_to_token.shape[0], req_to_token.device
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
        self.extend_rows: list[int] = []  # rows of the current extend batch, set before it

    def begin_decode(self, rows: list[int], lens: list[int]) -> None:
        """Before a decode forward: which of its requests (`req_to_token` rows, cached entries
        from the host-side batch) keep statistics."""
        self.decode_step = (
            DecodeStep.build(rows, lens, self.stats_rows, self.req_to_token.device)
            if self.stats_rows else None
        )  # fmt: skip

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

    def set_offset(self, row: int, offset: int) -> None:
        self.offsets[row] = offset
        if offset:
            self.offset_rows.add(row)
        else:
            self.offset_rows.discard(row)

    # --- observation-window queries -----------------------------------------------------------
    def _buffer(self, rows: int, q: Tensor) -> Tensor:
        have = 0 if self._queries is None else self._queries.shape[0]
        if have < self._need:  # grow by doubling, up to SGLang's row count
            capacity = min(max(self._need, 2 * have), rows)
            grown = q.new_zeros((capacity, self.num_layers, self.window, q.shape[1], q.shape[2]))
            if self._queries is not None:
                grown[:have] = self._queries
            self._queries = grown
        return self._queries

    @property
    def query_buffer_bytes(self) -> int:
        q = self._queries
        return 0 if q is None else q.numel() * q.element_size()

    def record_decode(self, layer: int, rows: Tensor, q: Tensor, pool_rows: int) -> None:
        """q: [B, H_q, d], one new query per row."""
        buf = self._buffer(pool_rows, q)
        if layer == self.first_layer:
            self._head[rows] = (self._head[rows] + 1) % self.window
            self._count[rows] = (self._count[rows] + 1).clamp_(max=self.window)
        buf[self._top - rows, layer, self._head[rows]] = q.to(buf.dtype)

    def record_extend(self, layer: int, row: int, q: Tensor, pool_rows: int) -> None:
        """q: [e, H_q, d], the queries of one request's extend (chunk), in order."""
        buf = self._buffer(pool_rows, q)
        m = min(q.shape[0], self.window)
        if layer == self.first_layer:
            self._head[row] = (self._head[row] + m) % self.window
            self._count[row] = (self._count[row] + m).clamp_(max=self.window)
        buf[self._top - row, layer, self._ring(row, m)] = q[-m:].to(buf.dtype)

    def _ring(self, row: int, m: int) -> Tensor:
        """Ring indices of a row's last m queries, oldest first."""
        steps = torch.arange(1 - m, 1, device=self._head.device)
        return (self._head[row] + steps) % self.window

    def queries(self, row: int, layer: int, n: int) -> Tensor | None:
        """The last min(count, window, n) queries of a row, oldest first."""
        if self._queries is None:
            return None
        m = min(int(self._count[row]), n)
        if m == 0:
            return None
        return self._queries[self._top - row, layer, self._ring(row, m)]

    def trim_queries(self, row: int, n: int) -> None:
        """After compaction to n tokens, fewer queries than tokens may remain valid."""
        self._count[row] = self._count[row].clamp(max=n)

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

    def accumulate_decode(self, layer: int, step: DecodeStep, q: Tensor, key_buffer: Tensor, scale: float) -> None:
        """One decode query per request (q: [B_all, H_q, d]; `step` picks the requests whose
        policy keeps statistics): their attention over their own keys in one padded batched
        computation per block of requests, not a loop."""
        h_q, d = q.shape[1], q.shape[2]
        h_kv = key_buffer.shape[1]
        device = key_buffer.device
        block = max(1, DECODE_STATS_ELEMS // max(1, max(step.lens) * h_q * d))
        for start in range(0, len(step.rows), block):
            end = start + block
            b_rows, b_lens = step.rows[start:end], step.lens[start:end]
            n_max = max(b_lens)
            slots = self.req_to_token[step.rows_t[start:end], :n_max].long().to(device)  # [b, n_max]
            keys = key_buffer[slots].float()  # [b, n_max, H_kv, d]
            qb = q[step.picked_t[start:end].to(q.device)].float().reshape(len(b_rows), h_kv, -1, d)
            logits = torch.einsum("bkgd,bnkd->bkgn", qb, keys) * scale
            pad = torch.arange(n_max, device=device)[None, :] >= step.lens_t[start:end].to(device)[:, None]
            logits.masked_fill_(pad[:, None, None, :], -math.inf)
            probs = torch.softmax(logits, dim=-1).unsqueeze(3)  # [b, H_kv, G, 1, n_max]
            by_policy: dict[type, list[int]] = {}  # requests may choose their own policy
            for j, row in enumerate(b_rows):
                state = self.states.get(row)
                if state is not None and state.policy.uses_stats:
                    by_policy.setdefault(type(state.policy), []).append(j)
            for js in by_policy.values():
                # What this step adds, for all of the policy's requests in one computation;
                # then per request only its old statistic (widened by the new token) is added.
                policy = self.states[b_rows[js[0]]].policy
                added = policy.contribution(probs[js] if len(js) < len(b_rows) else probs)
                for k, j in enumerate(js):
                    state, n = self.states[b_rows[j]], b_lens[j]
                    new = added[k, :, :n].clone()  # a copy: the block is not kept alive
                    old = state.stats[layer]
                    if old is not None:
                        new[:, : old.shape[1]] += old
                    state.stats[layer] = new
