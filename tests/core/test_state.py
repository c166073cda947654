"""Per-request compression state and the observation-query store (no SGLang needed)."""

from __future__ import annotations

import pytest
import torch

from sgl_kvc.core import decode as decode_module
from sgl_kvc.core import store as store_module
from sgl_kvc.core.request_state import Budget, ReqKvState
from sgl_kvc.core.store import KvcStore
from sgl_kvc.policies import get_policy


def _state(device: torch.device, budget: int = 8, ratio: float | None = None) -> ReqKvState:
    return ReqKvState(policy=get_policy("rkv"), budget=Budget(budget, ratio), device=device)


def test_positions_follow_compactions(device: torch.device) -> None:
    s = _state(device)
    first = s.positions(5)
    assert first.device == device and first.tolist() == [0, 1, 2, 3, 4]
    # compact 10 tokens to those at logical 0, 3, 7, 9; the next token is logical 10
    s.kept_positions = torch.tensor([0, 3, 7, 9], device=device)
    s.offset = 10 - 4
    assert s.positions(7).tolist() == [0, 3, 7, 9, 10, 11, 12]
    # a second compaction keeps physical 1, 4, 6 -> logical 3, 10, 12
    s.kept_positions = s.positions(7)[torch.tensor([1, 4, 6], device=device)]
    s.offset = 13 - 3
    assert s.positions(5).tolist() == [3, 10, 12, 13, 14]


def test_effective_budget_ratio_uses_logical_length(device: torch.device) -> None:
    s = _state(device, budget=8, ratio=0.5)
    s.offset = 100
    assert s.effective_budget(100) == 100  # half of 200 logical tokens
    assert _state(device, budget=8).effective_budget(10_000) == 8


def test_a_budget_ratio_rounds_up_and_never_cuts_into_the_window() -> None:
    assert Budget(8, 0.25, floor=9).at(100) == 25
    assert Budget(8, 0.25, floor=9).at(101) == 26  # ceil
    assert Budget(8, 0.25, floor=9).at(12) == 9  # the window + 1
    assert Budget(8, floor=9).at(12) == 8  # a fixed budget is what was asked


def test_query_window_keeps_the_last_queries_in_order(device: torch.device) -> None:
    r2t = torch.zeros(4, 16, dtype=torch.int32, device=device)
    store = KvcStore(num_layers=2, window=3, req_to_token=r2t, kv_pool=None)
    store.begin(1, _state(device))
    q = lambda v: torch.full((1, 2, 4), float(v), device=device)  # noqa: E731  [1 token, 2 heads, d=4]
    store.record_extend(0, 1, torch.cat([q(1), q(2)]), pool_rows=4)
    first = store.window_queries(1, n=10)[0]
    assert first.device == device and first[:, 0, 0].tolist() == [1.0, 2.0]
    for v in (3, 4):
        store.record_decode(0, torch.tensor([1], device=device), q(v), pool_rows=4)
    assert store.window_queries(1, n=10)[0][:, 0, 0].tolist() == [2.0, 3.0, 4.0]
    assert store.window_queries(1, n=2)[0][:, 0, 0].tolist() == [3.0, 4.0]  # never more than n tokens
    store.begin(1, _state(device))  # the row is reused by a new request: no stale queries
    assert store.window_queries(1, n=10)[0] is None


def test_query_ring_survives_many_wraps_and_trims(device: torch.device) -> None:
    r2t = torch.zeros(3, 8, dtype=torch.int32, device=device)
    store = KvcStore(num_layers=1, window=4, req_to_token=r2t, kv_pool=None)
    store.begin(0, _state(device))
    store.begin(2, _state(device))
    q = lambda *vs: torch.tensor(vs, dtype=torch.float32, device=device)[:, None, None].expand(-1, 1, 2)  # noqa: E731
    store.record_extend(0, 0, q(1, 2, 3, 4, 5, 6), pool_rows=3)
    rows = torch.tensor([0, 2], device=device)
    for v in range(7, 20):
        store.record_decode(0, rows, q(v, 100 + v), pool_rows=3)
    assert store.window_queries(0, n=99)[0][:, 0, 0].tolist() == [16, 17, 18, 19]
    assert store.window_queries(2, n=99)[0][:, 0, 0].tolist() == [116, 117, 118, 119]
    store.trim_queries(0, 2)
    assert store.window_queries(0, n=99)[0][:, 0, 0].tolist() == [18, 19]


@pytest.mark.parametrize("first_layer", [0, 2])
def test_window_queries_give_every_layer_of_the_rank(device: torch.device, first_layer: int) -> None:
    """One tensor per layer of the rank (local index), each the row's last min(count, window, n)
    queries of that layer, oldest first."""
    r2t = torch.zeros(3, 8, dtype=torch.int32, device=device)
    store = KvcStore(num_layers=4, window=4, req_to_token=r2t, kv_pool=None, first_layer=first_layer)
    store.begin(0, _state(device))
    store.begin(1, _state(device))
    assert store.window_queries(1, n=9) == [None] * (4 - first_layer)  # nothing recorded yet
    rows = torch.tensor([0, 1], device=device)
    for v in range(6):  # every layer of the rank, the first layer advancing the ring
        for layer in range(first_layer, 4):
            q = torch.full((2, 2, 3), 0.0, device=device)
            q[:, 0, 0] = torch.tensor([v, 100 + v], dtype=torch.float32, device=device) + 10 * layer
            store.record_decode(layer, rows, q, pool_rows=3)
    for row in (0, 1):
        for n in (1, 3, 9):
            got = store.window_queries(row, n)
            assert len(got) == 4 - first_layer
            m = min(4, n)  # 6 recorded, a window of 4
            for local, q in enumerate(got):
                want = [100 * row + 10 * (first_layer + local) + v for v in range(6 - m, 6)]
                assert q.device == device and q.shape == (m, 2, 3) and q[:, 0, 0].tolist() == want
    store.trim_queries(0, 0)
    assert store.window_queries(0, n=9) == [None] * (4 - first_layer)


def test_a_lost_observation_empties_the_ring_and_a_failed_write_changes_nothing(device: torch.device) -> None:
    """A write that raises in the first layer leaves the row's ring as it was; a row whose
    observation failed in another layer is emptied (its other layers' slots hold an earlier
    step's queries) and afterwards holds only what is recorded since, in every layer."""
    r2t = torch.zeros(2, 8, dtype=torch.int32, device=device)
    store = KvcStore(num_layers=2, window=4, req_to_token=r2t, kv_pool=None)
    store.begin(0, _state(device))
    rows = torch.tensor([0], device=device)

    def step(v: float, layers: range = range(2)) -> None:
        for layer in layers:
            store.record_decode(layer, rows, torch.full((1, 2, 3), v + 10 * layer, device=device), pool_rows=2)

    step(1.0)
    step(2.0)
    with pytest.raises(RuntimeError):  # a query of the wrong shape: the write raises
        store.record_decode(0, rows, torch.zeros(1, 2, 5, device=device), pool_rows=2)
    assert [q[:, 0, 0].tolist() for q in store.window_queries(0, n=8)] == [[1.0, 2.0], [11.0, 12.0]]
    step(3.0, range(1))  # layer 0 recorded step 3, layer 1 failed: it still holds step 2 there
    store.lose_observations([0])
    assert store.window_queries(0, n=8) == [None, None] and store.lost_observations == 1
    step(4.0)
    assert [q[:, 0, 0].tolist() for q in store.window_queries(0, n=8)] == [[4.0], [14.0]]


class _Pool:
    def __init__(self, keys: torch.Tensor) -> None:
        self.keys = keys

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.keys


@pytest.mark.parametrize("elems", [decode_module.DECODE_BLOCK_ELEMS, 1])  # one block; one per request
def test_batched_decode_statistics_equal_the_per_request_ones(device: torch.device, monkeypatch, elems: int) -> None:
    """`DecodeStep.accumulate` (one padded computation) == `accumulate` request by request; the
    step's statistics requests are picked from host-side rows (`begin_decode`)."""
    monkeypatch.setattr(decode_module, "DECODE_BLOCK_ELEMS", elems)
    g = torch.Generator().manual_seed(0)
    h_kv, group, d, rows = 2, 3, 8, 4
    keys = torch.randn(64, h_kv, d, generator=g).to(device)
    r2t = torch.randperm(64, generator=g)[: rows * 16].reshape(rows, 16).to(device, torch.int32)
    batch_rows, batch_lens = [3, 1, 0, 2], [5, 7, 16, 9]  # row 1's policy keeps no statistics
    q = torch.randn(4, h_kv * group, d, generator=g).to(device)
    for name in ("h2o", "batchmax", "kvcompress"):
        batched = KvcStore(1, 4, r2t, _Pool(keys))
        looped = KvcStore(1, 4, r2t, _Pool(keys))
        for store in (batched, looped):
            for row in range(rows):
                policy = get_policy("rkv" if row == 1 else name)
                store.begin(row, ReqKvState(policy=policy, budget=Budget(8), device=device))
        batched.begin_decode(batch_rows, batch_lens)
        planned = sorted(i for block in batched.decode_step.blocks for i in block.index.tolist())
        assert planned == [0, 2, 3]  # the statistics requests only: SGLang attends
        batched.decode_step.accumulate(0, q, keys, 0.3)
        for i, (row, n) in enumerate(zip(batch_rows, batch_lens)):
            if row == 1:
                continue
            k = keys[r2t[row, :n].long()]
            looped.accumulate(row, 0, q[i : i + 1], k, torch.tensor([n - 1], device=device),
                              torch.arange(n, device=device), 0.3)
            got = batched.states[row].stats[0]
            assert got.device == device
            assert torch.allclose(got, looped.states[row].stats[0], atol=1e-6), name
        assert batched.states[1].stats[0] is None


def test_batched_decode_statistics_with_a_policy_per_request(device: torch.device) -> None:
    """Requests of one step may each have chosen their own statistics policy."""
    g = torch.Generator().manual_seed(2)
    h_kv, group, d = 2, 2, 8
    keys = torch.randn(64, h_kv, d, generator=g).to(device)
    r2t = torch.randperm(64, generator=g)[:48].reshape(4, 12).to(device, torch.int32)
    names = {0: "h2o", 1: "kvcompress", 2: "batchmax", 3: "kvcompress"}
    rows, lens = [2, 0, 3, 1], [7, 12, 5, 9]
    batched = KvcStore(1, 4, r2t, _Pool(keys))
    looped = KvcStore(1, 4, r2t, _Pool(keys))
    for store in (batched, looped):
        for row, name in names.items():
            store.begin(row, ReqKvState(policy=get_policy(name), budget=Budget(8), device=device))
    for step in range(3):  # statistics grow by one token per step, old ones carried
        q = torch.randn(4, h_kv * group, d, generator=g).to(device)
        step_lens = [n - 2 + step for n in lens]
        batched.begin_decode(rows, step_lens)
        batched.decode_step.accumulate(0, q, keys, 0.3)
        for i, (row, n) in enumerate(zip(rows, step_lens)):
            k = keys[r2t[row, :n].long()]
            looped.accumulate(row, 0, q[i : i + 1], k, torch.tensor([n - 1], device=device),
                              torch.arange(n, device=device), 0.3)
    for row in names:
        got = batched.states[row].stats[0]
        assert got.device == device
        assert torch.allclose(got, looped.states[row].stats[0], atol=1e-5), names[row]


def test_no_decode_step_without_statistics_requests(device: torch.device) -> None:
    store = KvcStore(1, 4, torch.zeros(2, 8, dtype=torch.int32, device=device), kv_pool=None)
    store.begin(0, _state(device))
    store.begin_decode([0], [3])
    assert store.decode_step is None


def test_query_buffer_grows_with_the_rows_in_use_not_the_row_count(device: torch.device) -> None:
    r2t = torch.zeros(1000, 4, dtype=torch.int32, device=device)
    store = KvcStore(num_layers=2, window=2, req_to_token=r2t, kv_pool=None)
    q = lambda v: torch.full((1, 3, 4), float(v), device=device)  # noqa: E731
    for k, row in enumerate((999, 998, 997)):  # SGLang hands out rows from the top
        store.begin(row, _state(device))
        store.record_extend(0, row, q(k), pool_rows=1000)
    assert store.query_buffer_bytes == 4 * 2 * 2 * 3 * 4 * 4  # capacity 4 of 1000 rows
    store.begin(5, _state(device))  # a low row (rare) grows the buffer, keeping earlier queries
    store.record_extend(0, 5, q(9), pool_rows=1000)
    assert [store.window_queries(r, 9)[0][0, 0, 0].item() for r in (999, 998, 997, 5)] == [0, 1, 2, 9]


def test_prefill_statistics_equal_dense_causal_attention(device: torch.device, monkeypatch) -> None:
    """`accumulate` over an extend (several blocks of queries, causal by physical index) adds to
    H2O's statistic exactly the attention each key received, summed over the query group."""
    monkeypatch.setattr(store_module, "STATS_BLOCK", 3)  # several blocks
    g = torch.Generator().manual_seed(5)
    h_kv, group, d, n = 2, 3, 8, 10
    keys = torch.randn(n, h_kv, d, generator=g)
    q = torch.randn(7, h_kv * group, d, generator=g)  # queries of entries 3..9
    store = KvcStore(1, 4, torch.zeros(1, 16, dtype=torch.int32, device=device), kv_pool=None)
    store.begin(0, ReqKvState(policy=get_policy("h2o"), budget=Budget(8), device=device))
    store.accumulate(0, 0, q.to(device), keys.to(device), torch.arange(3, 10, device=device),
                     torch.arange(n, device=device), 0.3)
    k = keys.double().repeat_interleave(group, dim=1)  # query head h reads KV head h // G
    logits = torch.einsum("qhd,nhd->hqn", q.double(), k) * 0.3
    logits.masked_fill_(torch.arange(n)[None, None, :] > torch.arange(3, 10)[None, :, None], float("-inf"))
    expected = torch.softmax(logits, -1).sum(1).reshape(h_kv, group, n).sum(1)
    got = store.states[0].stats[0]
    assert got.device == device and torch.allclose(got.cpu().double(), expected, atol=1e-5)
