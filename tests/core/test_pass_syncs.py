"""Host waits inside one compression pass: a fixed few, whatever the layers and KV heads.

A pass reads a handful of sizes back to the host (the window's query count, a selection's
lengths, the protected tokens of a shared selection); on CUDA each is a wait for the GPU. One
per layer or per (layer, head) would multiply them by up to L x H_kv = 256 on an 8B model. The
pass runs on real data on the CPU and `SyncCounter` counts every such operation; the count must
be the same for 2 x 2 and 4 x 4 (layers x KV heads). A packed request's extend attention (every
layer of a prefill chunk) may not wait at all.
"""

from __future__ import annotations

import collections

import pytest
import torch

from fakes import LayeredKvPool
from sgl_kvc.core.passes import StepWork, advance_uniform, advance_variable, start_pass
from sgl_kvc.core.request_state import Budget, ReqKvState
from sgl_kvc.core.store import KvcStore
from sgl_kvc.core.query_moments import QueryMoments
from sgl_kvc.core.views import layer_views, prompt_moments
from sgl_kvc.policies import Policy, PolicyParams, get_policy
from sync_guard import SyncCounter

pytestmark = pytest.mark.usefixtures("single_thread")

D, SLOTS, WINDOW, GROUP, N, BUDGET = 8, 200, 4, 3, 120, 30
POLICIES = ["rkv", "snapkv", "h2o", "kvcompress", "streamingllm", "batchmax", "keydiff", "expected_attention",
            "expected_attention+moments"]
MODES = ["shared", "uniform", "variable", "layer"]
BOUND = 8  # what the engines read today is 1 to 7; the bound only has to be independent of L x H


def _request(policy: str, layers: int, heads: int, units: bool) -> tuple[KvcStore, ReqKvState]:
    """Row 0 holds N entries, its window queries and (for the statistics policies) statistics.
    R-KV estimates its redundancy from 16 reference keys (a long prompt's path).
    "expected_attention+moments": with the moments of its prompt's queries, read in 2 chunks."""
    policy, _, moments = policy.partition("+")
    g = torch.Generator().manual_seed(0)
    pool = LayeredKvPool(SLOTS, layers, heads, D, g, units=units)
    r2t = torch.zeros(2, 256, dtype=torch.int32)
    slots = torch.randperm(SLOTS - 1, generator=g)[:N] + 1
    r2t[0, :N] = slots.to(torch.int32)
    store = KvcStore(layers, WINDOW, r2t, pool)
    params = PolicyParams(budget=BUDGET, rkv_reference_keys=16)
    state = ReqKvState(policy=get_policy(policy, params), budget=Budget(BUDGET), device="cpu")
    store.begin(0, state)
    if moments:
        state.query_moments = QueryMoments(layers, params.sink_tokens, True, state.policy.prerope_queries)
    for layer in range(layers):
        q = torch.randn(N, heads * GROUP, D, generator=g)
        store.record_extend(layer, 0, q, pool_rows=2)
        for a, b in ((0, N // 2), (N // 2, N)):
            store.add_query_moments(0, layer, q[a:b], torch.arange(a, b), a)
        if state.policy.uses_stats:
            idx = torch.arange(N)
            store.accumulate(0, layer, q, pool.get_key_buffer(layer)[slots], idx, idx, 0.3)
    return store, state


def _pass_syncs(policy: str, mode: str, layers: int, heads: int) -> collections.Counter:
    store, state = _request(policy, layers, heads, units=mode in ("variable", "layer"))
    with SyncCounter() as counter:
        if mode == "shared":
            views = layer_views(store, 0, state, N, state.positions(N), range(layers), values=state.policy.uses_values,
                                moments=prompt_moments(store, state, state.policy, "prefill"))
            state.policy.select(views, BUDGET)
        else:
            tables = state.tables(store.req_to_token[0, :N], layers, heads) if mode != "uniform" else None
            state.pending = start_pass(store, 0, state, state.policy, N, BUDGET, "prefill", tables)
            due = None
            while due is None:
                work = StepWork.unlimited()
                due = (advance_uniform(store, 0, state, N, work) if mode == "uniform"
                       else advance_variable(store, 0, state, N, work, mode))
    return collections.Counter(counter.reasons)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", POLICIES)
def test_a_pass_waits_for_the_device_a_fixed_few_times(policy: str, mode: str) -> None:
    small, large = _pass_syncs(policy, mode, 2, 2), _pass_syncs(policy, mode, 4, 4)
    assert small == large, f"2 x 2: {dict(small)}; 4 x 4: {dict(large)}"
    assert sum(large.values()) <= BOUND, dict(large)


def test_a_sync_per_layer_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted failure: a score that reads one value to the host per layer and head."""
    score = Policy.score

    def syncing(self, view):
        out = score(self, view)
        bool(out.isnan().any())  # a host read of device data
        return out

    monkeypatch.setattr(Policy, "score", syncing)
    small, large = _pass_syncs("snapkv", "uniform", 2, 2), _pass_syncs("snapkv", "uniform", 4, 4)
    assert sum(large.values()) > sum(small.values())


def test_a_packed_extend_never_waits_for_the_device() -> None:
    """A prefill chunk of a request packed by an earlier pass attends through its per-head
    tables in every layer (`KvcStore.attend_extend`), with no read to the host."""
    layers, heads = 3, 2
    store, state = _request("h2o", layers, heads, units=True)
    due = None
    tables = state.tables(store.req_to_token[0, :N], layers, heads)
    state.pending = start_pass(store, 0, state, state.policy, N, BUDGET, "chunk", tables)
    while due is None:
        due = advance_variable(store, 0, state, N, StepWork.unlimited(), "variable")
    # Pack it as a compaction would (kept entries, then 5 new slots; the chosen columns stand in
    # for its units: only where they lead matters here), then extend by 5 tokens.
    state.pack(due.selection.indices.clamp(min=0), due.selection.lengths, BUDGET, due.kept_positions)
    state.stats = list(due.stats)
    new = torch.arange(150, 155, dtype=torch.int32)
    store.req_to_token[0, BUDGET : BUDGET + 5] = new
    store.begin_extend([0], [BUDGET + 5])
    q = torch.randn(5, heads * GROUP, D)
    positions = torch.arange(N, N + 5)
    with SyncCounter() as counter:
        for layer in range(layers):
            store.attend_extend(layer, 0, q, positions, 0.3)
    assert counter.reasons == []


def test_folding_a_chunks_queries_into_the_moments_never_waits_for_the_device() -> None:
    """Every layer of a prefill chunk adds its queries to the prompt's moments (Expected
    Attention) with no read to the host: the sizes it needs (chunk length, first position,
    count so far) are host integers."""
    layers, heads = 3, 2
    store, state = _request("expected_attention+moments", layers, heads, units=False)
    q = torch.randn(7, heads * GROUP, D)
    with SyncCounter() as counter:
        for layer in range(layers):
            store.add_query_moments(0, layer, q, torch.arange(N, N + 7), N)
    assert counter.reasons == []
    assert state.query_moments.counts == [N - 4 + 7] * layers
