"""The packed rows' layout a graph step reads (`core/packed_rows.py`): its arena's extents stay
disjoint and add up, whatever rows are installed and cleared in whatever order, and an installed
row's buffers list each head's own entries of its table."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_kvc.core.packed_rows import PackedRows, graph_width
from sgl_kvc.core.request_state import PackedEntries

LAYERS, HEADS, ROWS, CAPACITY = 2, 3, 6, 64


def _state(lens: list[int], width: int, packed: int = 2):
    """A packed request's state: head (l, h) keeps `lens` entries (row-major), units numbered."""
    unit_lens = torch.tensor(lens, dtype=torch.int64).view(LAYERS, HEADS)
    units = torch.arange(LAYERS * HEADS * width, dtype=torch.int64).view(LAYERS, HEADS, width) + 1000
    units = units * (torch.arange(width) < unit_lens[..., None])
    return SimpleNamespace(units=units, unit_lens=unit_lens, packed=packed,
                           packed_entries=PackedEntries.of(units, unit_lens, torch.zeros_like(units)))


def test_an_installed_row_lists_each_heads_own_entries() -> None:
    rows = PackedRows(ROWS, LAYERS, HEADS, CAPACITY, "cpu")
    state = _state([3, 0, 5, 1, 2, 4], width=5, packed=4)
    assert rows.install(2, state)
    for layer in range(LAYERS):
        for head in range(HEADS):
            n = int(rows.lens[2, layer, head])
            at = int(rows.start[2, layer, head])
            assert n == int(state.unit_lens[layer, head])
            assert torch.equal(rows.table[at : at + n].long(), state.units[layer, head, :n])
    assert int(rows.packed[2]) == 4 and rows.width(2) == 5
    rows.clear(2)
    assert int(rows.lens[2].sum()) == 0 and int(rows.packed[2]) == 0 and rows.free_units == CAPACITY


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, ROWS - 1), st.integers(0, 4), st.booleans()), min_size=1, max_size=30))
def test_the_arenas_extents_stay_disjoint_and_add_up(ops: list[tuple[int, int, bool]]) -> None:
    rows = PackedRows(ROWS, LAYERS, HEADS, CAPACITY, "cpu")
    for row, n, clear in ops:
        if clear:
            rows.clear(row)
        else:
            ok = rows.install(row, _state([n] * (LAYERS * HEADS), width=max(n, 1)))
            assert ok == rows.installed(row)
        held, free = rows.extents()
        spans = sorted(held + free)
        assert sum(size for _, size in spans) == CAPACITY  # free + held = the arena
        for (a, n_a), (b, _) in zip(spans, spans[1:]):
            assert a + n_a <= b  # disjoint
        for (a, n_a), (b, _) in zip(free, free[1:]):
            assert a + n_a < b  # coalesced: no two free extents touch


def test_a_step_width_is_a_power_of_two_bucket() -> None:
    assert graph_width([]) == 64 and graph_width([5, 64]) == 64
    assert graph_width([65]) == 128 and graph_width([1000, 3]) == 1024
