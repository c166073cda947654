"""One decode step of a compressing server held by a CUDA graph (`.ci/gpu`; skipped without a GPU).

What a decode forward writes for a policy without statistics (R-KV, SnapKV, StreamingLLM) is
graph-capturable: each layer's attention through the step's fused plan (the Triton kernel over
per-head tables) and the observation write of its query into the ring (`KvcStore.record_decode`,
into a ring reserved for every row beforehand). The test captures the layers of one step,
replays the graph on new queries and compares the outputs and the ring with an eager run on the
same queries. Statistics (H2O, Batch-Max, KV-Compress) are not graph-capturable: a step gives
each request a new statistic tensor on the host side, which a replay would not do.

A capture also fails on any host wait, so this is the sync guard's check on the real device.
"""

from __future__ import annotations

import pytest
import torch

from cuda_graphs import capture
from sgl_kvc.core.request_state import Budget, ReqKvState
from sgl_kvc.core.store import KvcStore
from sgl_kvc.policies import PolicyParams, get_policy

pytestmark = pytest.mark.gpu

LAYERS, H_KV, GROUP, D, WINDOW, SLOTS = 3, 2, 4, 64, 8, 4096


class _Pool:
    def __init__(self, g: torch.Generator) -> None:
        self.k = [torch.randn(SLOTS, H_KV, D, generator=g).to("cuda", torch.bfloat16) for _ in range(LAYERS)]
        self.v = [torch.randn(SLOTS, H_KV, D, generator=g).to("cuda", torch.bfloat16) for _ in range(LAYERS)]

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v[layer]


def _ring(store: KvcStore) -> tuple[torch.Tensor, ...]:
    return store._queries.clone(), store._head.clone(), store._count.clone()


def _restore(store: KvcStore, saved: tuple[torch.Tensor, ...]) -> None:
    for live, old in zip((store._queries, store._head, store._count), saved):
        live.copy_(old)


def test_a_decode_step_replays_from_a_cuda_graph() -> None:
    g = torch.Generator().manual_seed(0)
    lens = [700, 3, 129, 1, 512, 64, 33, 1000]
    batch = len(lens)
    r2t = torch.zeros(batch + 2, 1024, dtype=torch.int32)
    perm = torch.randperm(SLOTS - 1, generator=g) + 1
    used = 0
    for row, n in enumerate(lens):
        r2t[row, :n] = perm[used : used + n].to(torch.int32)
        used += n
    store = KvcStore(LAYERS, WINDOW, r2t.cuda(), _Pool(g))
    store.attends = True
    assert store.fused, "on CUDA with Triton a decode step is fused"
    for row in range(batch):
        name = ("rkv", "snapkv", "streamingllm")[row % 3]
        store.begin(row, ReqKvState(policy=get_policy(name, PolicyParams(budget=64)), budget=Budget(64), device="cuda"))
    store.reserve_queries(H_KV * GROUP, D, torch.bfloat16)
    store.begin_decode(list(range(batch)), lens)
    step = store.decode_step
    rows = torch.arange(batch, device="cuda")
    q = [torch.zeros(batch, H_KV * GROUP, D, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    out = [torch.zeros_like(x) for x in q]
    pool_rows = store.req_to_token.shape[0]

    def forward() -> None:
        for layer in range(LAYERS):
            k, v = store.kv_pool.get_key_buffer(layer), store.kv_pool.get_value_buffer(layer)
            store.attend_decode(layer, step, q[layer], k, v, 0.125, out[layer])
            store.record_decode(layer, rows, q[layer], pool_rows)

    graph = capture(forward)  # warmed up off the capturing stream, then captured

    for trial in range(2):  # two replays on new queries: the graph reads its inputs afresh
        for x in q:
            x.copy_(torch.randn(x.shape, generator=g).to(x.device, x.dtype))
        before = _ring(store)
        graph.replay()
        torch.cuda.synchronize()
        replayed, ring = [x.clone() for x in out], _ring(store)
        _restore(store, before)
        for x in out:
            x.zero_()
        forward()
        torch.cuda.synchronize()
        for layer in range(LAYERS):
            assert torch.equal(replayed[layer], out[layer]), (trial, layer)
        for got, want in zip(ring, _ring(store)):
            assert torch.equal(got, want), trial
        assert out[0].abs().sum() > 0
