"""A decode step through each plan (`core/decode.py`: fused, the CUDA one, with the torch kernel
standing in for Triton here; padded, the CPU one) over each kind of pool a server has (SGLang's
per-layer buffers, sgl-kvc's unit pool, both in FP8: `tests/fakes.py`), against a dense float64
reference of attention and of the statistics, over two steps and a layer the kernel refuses."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from fakes import LayeredKvPool
from sgl_kvc.core.request_state import Budget, ReqKvState
from sgl_kvc.core.store import KvcStore
from sgl_kvc.policies import PolicyParams, get_policy

LAYERS, H_KV, GROUP, D, SLOTS, WINDOW = 2, 2, 3, 16, 200, 4
POLICIES = ("h2o", "rkv", "kvcompress", "batchmax", "snapkv", "h2o")
KINDS = {
    "sglang": dict(units=False, fp8=None),  # MHATokenToKVPool: per-layer contiguous K and V
    "units": dict(units=True, fp8=None),  # the unit pool (variable budgets)
    "fp8": dict(units=False, fp8="fp8_e4m3"),
    "fp8-units": dict(units=True, fp8="fp8_e5m2"),
}


def _store(device: torch.device, kind: str, plan: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pool = LayeredKvPool(SLOTS, LAYERS, H_KV, D, g, device, **KINDS[kind])
    rng = random.Random(seed)
    lens = [rng.randint(3, 30) for _ in POLICIES]
    r2t = torch.zeros(len(lens), 40, dtype=torch.int32)
    perm = torch.randperm(SLOTS - 1, generator=g) + 1
    for row, n in enumerate(lens):
        r2t[row, :n] = perm[row * 30 : row * 30 + n].to(torch.int32)
    store = KvcStore(LAYERS, WINDOW, r2t.to(device), pool, plan=plan)
    assert store.fused is (plan == "fused")
    store.attends = True
    for row, name in enumerate(POLICIES):
        state = ReqKvState(policy=get_policy(name, PolicyParams(budget=8)), budget=Budget(8), device=device)
        store.begin(row, state)
        if state.policy.uses_stats:  # what earlier steps left, one column narrower
            state.stats = [torch.rand(H_KV, lens[row] - 1, generator=g).to(device) for _ in range(LAYERS)]
    return store, pool, lens, g


def _reference(pool: LayeredKvPool, r2t: torch.Tensor, q: torch.Tensor, lens: list[int], layer: int,
               scale: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """float64 attention of each request over its own slots, and its probabilities [H_q, n]."""
    out, probs = [], []
    for b, n in enumerate(lens):
        idx = r2t[b, :n].long()
        keys = pool.k[idx, layer].double().repeat_interleave(GROUP, dim=1)  # [n, H_q, d]
        vals = pool.v[idx, layer].double().repeat_interleave(GROUP, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[b].double(), keys) * scale, dim=-1)
        out.append(torch.einsum("hn,nhd->hd", w, vals))
        probs.append(w)
    return torch.stack(out), probs


def _expected_stats(name: str, old: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """old [H_kv, n - 1] + what the policy adds for one query's probabilities [H_q, n]."""
    grouped = probs.reshape(H_KV, GROUP, probs.shape[-1])
    added = (grouped.square() if name == "kvcompress" else grouped).sum(dim=1)
    return torch.nn.functional.pad(old.double(), (0, 1)) + added


@pytest.mark.parametrize("plan", ["fused", "padded"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_decode_step_attends_and_feeds_statistics_as_the_dense_reference(device, kind: str, plan: str) -> None:
    store, pool, lens, g = _store(device, kind, plan)
    rows, scale = list(range(len(lens))), 0.3
    for step in range(2):  # the second step adds to what the first wrote
        olds = {row: [t.clone() for t in store.states[row].stats] for row in rows
                if store.states[row].policy.uses_stats}
        store.begin_decode(rows, lens)
        plan_step = store.decode_step
        assert len(plan_step.blocks) == (1 if plan == "fused" else len(plan_step.blocks))
        for layer in range(LAYERS):
            q = torch.randn(len(rows), H_KV * GROUP, D, generator=g).to(device)
            out = torch.full_like(q, float("nan"))
            k, v = pool.get_kv_buffer(layer)
            store.attend_decode(layer, plan_step, q, k, v, scale, out)
            want, probs = _reference(pool, store.req_to_token, q, lens, layer, scale)
            assert torch.allclose(out.double(), want, atol=1e-5), (step, layer)
            for row, old in olds.items():
                got = store.states[row].stats[layer]
                expected = _expected_stats(store.states[row].policy.name, old[layer], probs[row])
                assert got.shape == expected.shape and torch.allclose(got.double(), expected, atol=1e-5), (step, row)
        lens = [n + 1 for n in lens]  # the step's token appended (its slot is a fresh one)
        for row, n in enumerate(lens):
            store.req_to_token[row, n - 1] = 100 + 30 * 0 + row + step * len(lens) + 60


@pytest.mark.parametrize("plan", ["fused", "padded"])
def test_a_layer_the_kernel_refuses_feeds_the_statistics_of_its_own_requests(device, plan: str) -> None:
    """A layer the batched kernel does not serve (a logit cap, a sliding window: another kernel
    attends) in a step planned for it: its statistics, computed beside, still come from each
    request's own attention, not from another member of its block."""
    store, pool, lens, g = _store(device, "sglang", plan, seed=3)
    rows, scale = list(range(len(lens))), 0.3
    olds = {row: [t.clone() for t in store.states[row].stats] for row in rows if store.states[row].policy.uses_stats}
    store.begin_decode(rows, lens)
    step = store.decode_step
    q = torch.randn(len(rows), H_KV * GROUP, D, generator=g).to(device)
    k = pool.get_key_buffer(1)
    step.accumulate(1, q, k, scale)  # layer 1: statistics only
    _, probs = _reference(pool, store.req_to_token, q, lens, 1, scale)
    for row, old in olds.items():
        expected = _expected_stats(store.states[row].policy.name, old[1], probs[row])
        assert torch.allclose(store.states[row].stats[1].double(), expected, atol=1e-5), row


def test_a_pool_it_cannot_view_as_units_falls_back_to_the_padded_plan(caplog) -> None:
    """Per-layer buffers that are strided views (a unit-pool layout without its flat form): the
    fused plan cannot read them as flat units, so the store plans padded, says why once, and
    never raises."""
    pool = LayeredKvPool(SLOTS, LAYERS, H_KV, D, torch.Generator().manual_seed(0), units=True)
    del pool.unit_buffers
    r2t = torch.zeros(2, 8, dtype=torch.int32)
    with caplog.at_level(logging.WARNING, logger="sgl_kvc.core.store"):
        store = KvcStore(LAYERS, WINDOW, r2t, pool, plan="fused")
    assert not store.fused
    assert [r.message for r in caplog.records if "padded plan" in r.message] != []
    assert len(caplog.records) == 1
    assert KvcStore(LAYERS, WINDOW, r2t, LayeredKvPool(SLOTS, LAYERS, H_KV, D, torch.Generator().manual_seed(0)),
                    plan="fused").fused
