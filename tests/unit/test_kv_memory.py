"""sgl-kvc's buffers are charged to SGLang's KV memory (`adapter/memory/kv_memory.py`)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from sgl_kvc.adapter.memory.kv_memory import MAX_QUERY_SHARE, ROW_ENTRY_BYTES, Reservation, fit_pool, forward_room, widen_rows
from sgl_kvc.config import KvcConfig
from sgl_kvc.core.request_state import Budget, ReqKvState
from sgl_kvc.core.store import KvcStore
from sgl_kvc.policies import get_policy

SMOLLM2 = Reservation.for_model(window=8, num_layers=30, q_heads=9, kv_heads=3, head_dim=64, q_bytes=2)
SMOLLM2_CELL = 30 * 3 * 64 * 2 * 2  # K and V, bf16


def test_the_reservation_is_what_the_store_allocates() -> None:
    """What is reserved per request slot and per pool token is what the store really holds for
    a SmolLM2-shaped model: its window queries (bf16) and a statistic per layer and KV head."""
    layers, q_heads, kv_heads, d, window, n = 30, 9, 3, 64, 8, 40
    store = KvcStore(layers, window, torch.zeros(4, 64, dtype=torch.int32), kv_pool=None)
    state = ReqKvState(policy=get_policy("h2o"), budget=Budget(16))
    store.begin(3, state)  # the top row: the ring buffer holds one request
    g = torch.Generator().manual_seed(0)
    for layer in range(layers):
        q = torch.randn(n, q_heads, d, generator=g).to(torch.bfloat16)
        store.record_extend(layer, 3, q, pool_rows=4)
        probs = torch.softmax(torch.randn(q_heads, n, n, generator=g), dim=-1)
        state.stats[layer] = state.policy.accumulate(state.stats[layer], probs, kv_heads)
    assert store.query_buffer_bytes == SMOLLM2.per_request  # one request slot's queries
    # n cached tokens' statistics, twice while a decode step moves them to its own slab
    assert 2 * store.state_bytes == SMOLLM2.per_token * n


def test_a_token_cap_below_the_budget_is_kept_and_the_buffers_use_the_rest() -> None:
    budget = 8 << 30  # plenty: --max-total-tokens decides the pool
    fit = fit_pool(budget, SMOLLM2_CELL, tokens=16384, requests=2048, r=SMOLLM2)
    assert (fit.tokens, fit.requests) == (16384, 2048)
    assert fit.tokens * SMOLLM2_CELL + fit.reserved_bytes <= budget


def test_a_profiled_pool_shrinks_to_make_room() -> None:
    budget = 1 << 30
    tokens = budget // SMOLLM2_CELL  # what SGLang alone would take
    fit = fit_pool(budget, SMOLLM2_CELL, tokens=tokens, requests=64, r=SMOLLM2)
    assert fit.requests == 64
    assert fit.tokens < tokens
    assert fit.tokens * SMOLLM2_CELL + fit.reserved_bytes <= budget


def test_request_slots_are_capped_so_queries_never_eat_a_small_pool() -> None:
    budget = 400 << 20
    fit = fit_pool(budget, SMOLLM2_CELL, tokens=budget // SMOLLM2_CELL, requests=2048, r=SMOLLM2)
    assert fit.requests * SMOLLM2.per_request <= MAX_QUERY_SHARE * budget
    # what the decode call and the moments take aside, the queries' share leaves most to the pool
    held = SMOLLM2.fixed + fit.moment_slots * SMOLLM2.per_moment + MAX_QUERY_SHARE * budget
    assert fit.tokens >= (budget - held) // (SMOLLM2_CELL + SMOLLM2.per_token)


@given(
    budget=st.integers(1 << 20, 1 << 36), cell=st.integers(64, 1 << 18), requests=st.integers(1, 4096),
    frac=st.floats(0.01, 1.0), per_request=st.integers(0, 1 << 22), per_token=st.integers(0, 1 << 12),
)
def test_pool_and_buffers_always_fit(budget, cell, requests, frac, per_request, per_token) -> None:
    r = Reservation(per_request=per_request, per_token=per_token)
    tokens = max(1, int(frac * (budget // cell)))
    fit = fit_pool(budget, cell, tokens, requests, r)
    assert 1 <= fit.requests <= requests and fit.tokens <= tokens
    if fit.tokens > 1:  # (one token is the floor when nothing fits)
        assert fit.tokens * cell + fit.reserved_bytes <= budget


def test_the_moment_reservation_is_what_a_prompts_moments_hold() -> None:
    """One moment slot holds what Expected Attention's prompt moments allocate for a SmolLM2-shaped
    model (every layer's mean and scatter, and one layer's merge beside them)."""
    from sgl_kvc.core.query_moments import QueryMoments

    layers, q_heads, d = 30, 9, 64
    moments = QueryMoments(layers, 4, True, lambda q, pos: q)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):  # two chunks: the second merges into the first
        for layer in range(layers):
            moments.add(layer, torch.randn(20, q_heads, d, generator=g), torch.arange(20), 100)
    held = sum(t.numel() * t.element_size() for t in moments.tensors())
    assert held <= SMOLLM2.per_moment <= held + 2 * q_heads * d * (d + 1) * 4


def test_moment_slots_take_at_most_their_share_and_the_pool_still_fits() -> None:
    from sgl_kvc.adapter.memory.kv_memory import MAX_MOMENT_SHARE

    budget = 400 << 20
    fit = fit_pool(budget, SMOLLM2_CELL, tokens=budget // SMOLLM2_CELL, requests=2048, r=SMOLLM2)
    assert 1 <= fit.moment_slots <= fit.requests
    assert fit.moment_slots * SMOLLM2.per_moment <= MAX_MOMENT_SHARE * budget
    assert fit.tokens * SMOLLM2_CELL + fit.reserved_bytes <= budget


def test_rows_get_room_for_a_reconstruction_forward_charged_per_request_slot() -> None:
    """A compressing server widens SGLang's request rows by one KVzip forward (its chunk and its
    instruction), keeps what they hold, and charges the int32 entries to each request slot."""

    class Rows:  # what SGLang's ReqToTokenPool has that the widening touches
        req_to_token = torch.arange(12, dtype=torch.int32).reshape(3, 4)
        max_context_len = 4

    room = forward_room(KvcConfig(policy="snapkv", kvzip_chunk=100))
    assert room > 100 and forward_room(KvcConfig(policy="none")) == 0
    rows = Rows()
    widen_rows(rows, room)
    assert rows.req_to_token.shape == (3, 4 + room) and rows.req_to_token.dtype == torch.int32
    assert (rows.req_to_token[:, :4] == torch.arange(12, dtype=torch.int32).reshape(3, 4)).all()
    assert (rows.req_to_token[:, 4:] == 0).all() and rows.max_context_len == 4 + room
    wider = Reservation.for_model(window=8, num_layers=30, q_heads=9, kv_heads=3, head_dim=64, q_bytes=2,
                                  row_room=room)
    assert wider.per_request == SMOLLM2.per_request + room * ROW_ENTRY_BYTES


def test_the_graph_layout_is_reserved_as_the_store_allocates_it() -> None:
    """With decode steps from CUDA graphs on the unit pool, the packed rows' layout they read
    (`core/packed_rows.py`): an int32 arena unit per pool token, layer and KV head, and each request
    row's [L, H_kv] first entries and counts and its packed slots, int32, are what is reserved."""
    from sgl_kvc.core.packed_rows import PackedRows

    layers, kv_heads, rows, tokens = 30, 3, 8, 100
    plain = Reservation.for_model(window=8, num_layers=layers, q_heads=9, kv_heads=kv_heads, head_dim=64, q_bytes=2,
                                  unit_tables=True)
    graphs = Reservation.for_model(window=8, num_layers=layers, q_heads=9, kv_heads=kv_heads, head_dim=64, q_bytes=2,
                                   unit_tables=True, graph_layout=True)
    layout = PackedRows(rows, layers, kv_heads, tokens * layers * kv_heads, "cpu")
    extra = rows * (graphs.per_request - plain.per_request) + tokens * (graphs.per_token - plain.per_token)
    # the arena's pad entry aside, the reservation is the layout's bytes
    assert extra == layout.nbytes - 4
