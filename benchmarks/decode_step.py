"""A serving-shaped decode step: what a compressing server runs for one step, through the code
it calls (`KvcStore.begin_decode` plans the step; every layer then runs `attend_decode` and
`record_decode`), for B requests of mixed lengths in the budget + buffer cycle.

Used by `benchmarks.per_head_kernel` (on a GPU: time and kernel launches per step, the fused
plan against the padded blocks a CPU uses) and by its CPU smoke test.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

import torch

from sgl_kvc.core.request_state import Budget, ReqKvState
from sgl_kvc.core.store import KvcStore
from sgl_kvc.policies import PolicyParams, get_policy


@dataclass(frozen=True)
class StepShape:
    """A model's attention shape and the requests of one step (defaults: Llama-3-8B, budget 256
    + buffer 128, so each request holds between 256 and 384 entries)."""

    layers: int = 32
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    budget: int = 256
    buffer: int = 128
    window: int = 8
    dtype: torch.dtype = torch.bfloat16


@dataclass
class _Pool:
    """One K and one V buffer read by every layer (a step's cost does not depend on which)."""

    k: torch.Tensor
    v: torch.Tensor

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v


def serving_step(
    batch: int, shape: StepShape, policies: tuple[str, ...], device: torch.device | str,
    fused: bool | None = None, seed: int = 0, lengths: dict[int, int] | None = None,
) -> tuple[KvcStore, Callable[[], None], torch.Tensor]:
    """A store holding `batch` decoding requests (policies in turn, lengths uniform over the
    budget + buffer cycle, each with the statistic its policy keeps), `step()`, one decode
    step as the server runs it, and the tensor its attention writes (the last layer's output).
    `fused`: force the plan's kind (None: the device's own); `lengths`: requests (by index) of
    another length (a long one among short ones)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lens = [rng.randint(shape.budget, shape.budget + shape.buffer) for _ in range(batch)]
    for i, n in (lengths or {}).items():
        lens[i] = n
    width = max(lens)
    slots = sum(lens) + 1
    perm = (torch.randperm(slots - 1, generator=gen) + 1).to(torch.int32)  # slot 0: SGLang's padding slot
    r2t = torch.zeros(batch, width, dtype=torch.int32)
    start = 0
    for row, n in enumerate(lens):
        r2t[row, :n] = perm[start : start + n]
        start += n
    r2t = r2t.to(device)
    k, v = (torch.randn(slots, shape.kv_heads, shape.head_dim, generator=gen).to(device, shape.dtype)
            for _ in range(2))
    store = KvcStore(shape.layers, shape.window, r2t, _Pool(k, v))
    store.attends = True
    if fused is not None:
        store.fused = fused
    params = PolicyParams(budget=shape.budget, buffer=shape.buffer, window=shape.window)
    for row, n in enumerate(lens):
        state = ReqKvState(policy=get_policy(policies[row % len(policies)], params), budget=Budget(shape.budget),
                           device=device)
        store.begin(row, state)
        if state.policy.uses_stats:
            state.stats = [torch.rand(shape.kv_heads, n - 1, generator=gen).to(device) for _ in range(shape.layers)]
    store.reserve_queries(shape.q_heads, shape.head_dim, shape.dtype)
    rows = list(range(batch))
    row_index = torch.arange(batch, device=device)
    q = torch.randn(batch, shape.q_heads, shape.head_dim, generator=gen).to(device, shape.dtype)
    out = torch.empty_like(q)
    scale = shape.head_dim**-0.5

    def step() -> None:
        store.begin_decode(rows, lens)
        plan = store.decode_step
        for layer in range(shape.layers):
            store.attend_decode(layer, plan, q, store.kv_pool.k, store.kv_pool.v, scale, out)
            store.record_decode(layer, row_index, q, batch)

    return store, step, out
