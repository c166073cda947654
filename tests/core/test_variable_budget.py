"""Variable per-head budgets on the unit pool (KV-Compress §4.2), without SGLang: unit indices,
per-head tables of packed requests, compaction that packs kept entries of any layer and head
into the request's first slots and frees the rest, and decode attention through the tables."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakes import FakeAllocator

from sgl_kvc.adapter.moments.compaction import compact_requests_units
from sgl_kvc.core.decode import DecodeStep
from sgl_kvc.core.request_state import Budget, PackedEntries, ReqKvState, unit_index
from sgl_kvc.core.store import KvcStore
from sgl_kvc.kernels.per_head_attention import per_head_extend
from sgl_kvc.kernels.per_head_tables import HeadTables
from sgl_kvc.policies import get_policy, select_from_scores

pytestmark = pytest.mark.usefixtures("single_thread")

D = 4


class UnitPool:
    """The unit pool's surface: per-layer strided views of one [S, L, H, d] allocation."""

    def __init__(self, slots: int, layers: int, heads: int, seed: int, device: torch.device) -> None:
        g = torch.Generator().manual_seed(seed)
        self.k_all = torch.randn(slots, layers, heads, D, generator=g).to(device)
        self.v_all = torch.randn(slots, layers, heads, D, generator=g).to(device)
        self.start_layer, self.layer_num = 0, layers

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k_all[:, layer]

    def get_kv_buffer(self, layer: int):
        return self.k_all[:, layer], self.v_all[:, layer]

    def unit_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_all.view(-1, D), self.v_all.view(-1, D)


def _batch(allocator: FakeAllocator, n: int, state: ReqKvState):
    """A batch of one request of n entries, on the allocator's device (`seq_lens_cpu` is
    SGLang's host-side copy)."""
    device = allocator.device
    r2t = torch.zeros(3, 256, dtype=torch.int32, device=device)
    r2t[0, :n] = allocator.alloc(n).to(torch.int32)
    kv = SimpleNamespace(req_pool_idx=0, cache_protected_len=0)
    req = SimpleNamespace(kv=kv, state=state)
    return SimpleNamespace(
        reqs=[req], seq_lens_cpu=torch.tensor([n]), seq_lens=torch.tensor([n], device=device), tree_cache=None,
        req_to_token_pool=SimpleNamespace(req_to_token=r2t), token_to_kv_pool_allocator=allocator,
    )


def _compact(batch, pool: UnitPool, state: ReqKvState, budget: int, seed: int):
    """One variable compaction of request 0 from random scores; returns the kept (layer, head)
    keys and values as they were before, for the check."""
    layers, heads = pool.layer_num, pool.k_all.shape[2]
    n = int(batch.seq_lens_cpu[0])
    tables = state.tables(batch.req_to_token_pool.req_to_token[0, :n], layers, heads)
    device = tables.units.device
    scores = torch.rand(layers, heads, tables.width, generator=torch.Generator().manual_seed(seed)).to(device)
    protected = torch.zeros(scores.shape, dtype=torch.bool, device=device)
    selection = select_from_scores(scores, protected, budget, lengths=tables.lens, mode="variable")
    k_units, v_units = pool.unit_buffers()
    want = [[(k_units[tables.units[l, h, selection.kept(l, h)]].clone(),
              v_units[tables.units[l, h, selection.kept(l, h)]].clone(),
              tables.positions[l, h, selection.kept(l, h)]) for h in range(heads)] for l in range(layers)]
    free_before = batch.token_to_kv_pool_allocator.available_size()
    [outcome] = compact_requests_units(batch, [(0, selection, tables.units)], pool.unit_buffers())
    g = math.ceil(selection.total / (layers * heads))
    assert outcome.kept == g and batch.seq_lens_cpu.tolist() == [g] and outcome.units.device == device
    assert batch.token_to_kv_pool_allocator.available_size() == free_before + n - g  # really freed
    logical = n + state.offset
    valid = selection.valid()
    state.pack(outcome.units, selection.lengths, g,
               tables.positions.gather(-1, torch.where(valid, selection.indices, 0)) * valid)
    state.offset = logical - g
    return selection, want


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(4, 30), budget=st.integers(1, 6), layers=st.integers(1, 3), heads=st.integers(1, 3),
    tail=st.integers(0, 5), seed=st.integers(0, 10_000),
)
def test_variable_compactions_pack_every_heads_kept_entries(device, n, budget, layers, heads, tail, seed) -> None:
    """Two variable compactions (the second over packed entries plus new tokens): after each,
    head (l, h) reads through its table exactly the keys, values and positions it kept, the
    request holds ceil(total / (L x H)) slots and gives every other slot back."""
    pool, allocator = UnitPool(128, layers, heads, seed, device), FakeAllocator(128, seed=seed, device=device)
    state = ReqKvState(policy=get_policy("snapkv"), budget=Budget(budget), device=device)
    batch = _batch(allocator, n, state)
    for round_ in range(2):
        selection, want = _compact(batch, pool, state, budget, seed + round_)
        g = state.packed
        k_units, v_units = pool.unit_buffers()
        now = state.tables(batch.req_to_token_pool.req_to_token[0, :g], layers, heads)
        assert torch.equal(now.lens, selection.lengths)
        assert now.lens.sum() <= budget * layers * heads
        for l in range(layers):
            for h in range(heads):
                units = now.units[l, h, : int(now.lens[l, h])]
                k, v, pos = want[l][h]
                assert torch.equal(k_units[units], k) and torch.equal(v_units[units], v)
                assert torch.equal(now.positions[l, h, : units.numel()], pos)
        # decode appends `tail` tokens in fresh slots: every head reads them after its own
        new = allocator.alloc(tail)
        r2t = batch.req_to_token_pool.req_to_token
        r2t[0, g : g + tail] = new.to(torch.int32)
        batch.seq_lens_cpu = torch.tensor([g + tail])
        grown = state.tables(r2t[0, : g + tail], layers, heads)
        cols = now.lens[..., None] + torch.arange(tail, device=device)
        assert grown.units.device == device
        assert torch.equal(grown.units.gather(-1, cols), unit_index(new, layers, heads))
        logical = torch.arange(g, g + tail, device=device) + state.offset
        assert torch.equal(grown.positions.gather(-1, cols), logical.expand(layers, heads, tail))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 12), st.integers(0, 6)), min_size=1, max_size=6),
    layers=st.integers(1, 3), heads=st.integers(1, 3), token_elems=st.sampled_from([1, 1 << 20]),
    seed=st.integers(0, 10_000),
)
def test_decode_step_tables_are_each_requests_own(device, rows, layers, heads, token_elems, seed) -> None:
    """The decode plan builds a block's per-head tables at once (`block_tables`); for every
    packed request they equal what `ReqKvState.tables` gives it alone, in every block size
    (`token_elems` of 2^20 puts each request in its own block). Requests whose heads all hold
    their row (intact, with no state, or compressed to the same number in every head, as under
    `--kv-head-budget policy`) are read through their rows as on SGLang's pool: no tables."""
    g = torch.Generator().manual_seed(seed)
    r2t = torch.randint(1, 500, (len(rows), 64), generator=g, dtype=torch.int32).to(device)
    states: dict[int, ReqKvState] = {}
    lens = []
    for row, (kind, k, tail) in enumerate(rows):
        if kind == 0:  # no sgl-kvc state: every head reads the whole row
            lens.append(k + tail)
            continue
        state = ReqKvState(policy=get_policy("snapkv"), budget=Budget(k), device=device)
        if kind == 2:  # packed into its first `packed` slots
            unit_lens = torch.randint(0, k + 1, (layers, heads), generator=g)
            unit_lens.view(-1)[0] = k  # the widest head fills the packed table
            units = torch.randint(0, 9999, (layers, heads, k), generator=g)
            units *= torch.arange(k) < unit_lens[..., None]
            state.pack(units.to(device), unit_lens.to(device), math.ceil(int(unit_lens.sum()) / (layers * heads)),
                       torch.zeros(layers, heads, k, dtype=torch.int64, device=device))
            lens.append(state.packed + tail)
        elif kind == 3:  # compressed into its row, every head keeping k (a uniform pass)
            state.kept_positions = torch.arange(k, device=device).expand(layers, heads, k) * 2
            lens.append(k + tail)
        else:
            lens.append(k + tail)
        states[row] = state
    step = DecodeStep.build(list(range(len(rows))), lens, states, r2t, token_elems, True, units=(layers, heads))
    seen = []
    for block in step.blocks:
        members = range(len(rows)) if block.index is None else block.index.tolist()
        if block.plain_lens is not None:  # intact requests: their rows, read as plain SGLang reads them
            assert block.units is None and all(i not in states or states[i].intact for i in members)
            assert [block.slots[j, : lens[i]].tolist() for j, i in enumerate(members)] == \
                [r2t[i, : lens[i]].long().tolist() for i in members]
            assert list(block.plain_lens) == [lens[i] for i in members]
            seen += list(members)
            continue
        if block.slots is not None:  # compressed into rows: read as on SGLang's pool
            assert block.units is None and all(rows[i][0] == 3 for i in members)
            assert [block.slots[j, : lens[i]].tolist() for j, i in enumerate(members)] == \
                [r2t[i, : lens[i]].long().tolist() for i in members]
            seen += list(members)
            continue
        assert block.pad is None and all(rows[i][0] == 2 for i in members)
        for j, i in enumerate(members):
            seen.append(i)
            slots = r2t[i, : lens[i]]
            alone = states[i] if i in states else ReqKvState(policy=get_policy("snapkv"), budget=Budget(1), device=device)
            want = alone.tables(slots, layers, heads)
            got_lens = block.lens[:, j]
            assert torch.equal(got_lens, want.lens)
            for layer, table in enumerate(block.units):  # each layer as wide as its widest head in the block
                assert table.device == device and table.shape[-1] == max(1, int(block.lens[layer].max()))
                w = min(want.width, table.shape[-1])
                cols = torch.arange(w, device=device) < got_lens[layer, :, None]
                assert torch.equal(table[j, :, :w] * cols, want.units[layer, :, :w] * cols)
                assert int(got_lens[layer].max()) <= w
    assert sorted(seen) == list(range(len(rows)))


def test_unit_index_is_the_flat_view_of_the_per_layer_buffers(device: torch.device) -> None:
    pool = UnitPool(10, 3, 2, 0, device)
    slots = torch.tensor([7, 2, 5], device=device)
    k_units, _ = pool.unit_buffers()
    units = unit_index(slots, 3, 2)
    assert units.device == device
    for l in range(3):
        assert torch.equal(k_units[units[l]], pool.get_key_buffer(l)[slots].transpose(0, 1))


def test_a_packed_requests_metadata_follows_its_entries_not_its_widest_head(device: torch.device) -> None:
    """One sort over every head (KVzip's) can leave one head holding every token and the others
    one each. What the request holds is then its entries (an int32 unit and position each), not
    [L, H_kv, K] tables as wide as that head; a decode step's tables are each layer only as wide as
    its own widest head. With tables as wide as the widest head this request held 16 x 3 x 2 x 40
    bytes for 45 entries."""
    layers, heads, wide = 3, 2, 40
    pool = UnitPool(64, layers, heads, 0, device)
    r2t = torch.zeros(2, 128, dtype=torch.int32, device=device)
    r2t[0, :wide + 2] = torch.arange(wide + 2, dtype=torch.int32, device=device)
    lens = torch.ones(layers, heads, dtype=torch.int64)
    lens[0, 0] = wide
    state = ReqKvState(policy=get_policy("snapkv"), budget=Budget(4), device=device)
    units = torch.arange(layers * heads * wide, dtype=torch.int64).view(layers, heads, wide)
    state.pack(units.to(device), lens.to(device), 8, torch.zeros(layers, heads, wide, dtype=torch.int64, device=device))
    store = KvcStore(layers, 4, r2t, pool)
    store.begin(0, state)
    entries = int(lens.sum())
    assert state.packed_entries.entries == entries
    assert store.state_bytes == 8 * entries + 8 * layers * heads  # int32 units, positions; each head's length
    assert torch.equal(state.units, units.to(device) * (torch.arange(wide, device=device) < lens.to(device)[..., None]))
    store.attends = True
    store.begin_decode([0], [8 + 2])  # its 8 packed slots and two tokens decoded since
    [block] = store.decode_step.blocks
    assert [table.shape[-1] for table in block.units] == [wide + 2, 3, 3]
    # an extend (here of one token) reads each layer only as wide as it holds, and attends as
    # through the tables' full width; a statistic still indexes the full width
    store.begin_extend([0], [8 + 2])
    tables = store.extend_tables[0]
    assert [tables.layer(l)[0].shape[-1] for l in range(layers)] == [wide + 2, 3, 3]
    assert [tables.layer(l, own_width=False)[0].shape[-1] for l in range(layers)] == [wide + 2] * layers
    k_units, v_units = store.unit_pools
    q = torch.randn(1, 2 * heads, k_units.shape[-1], device=device)
    at = (q, torch.tensor([0, 1], device=device), torch.tensor([9], device=device), k_units, v_units)
    for layer in range(layers):
        full, own = (HeadTables(*(t[None] for t in tables.layer(layer, own_width=w))) for w in (False, True))
        torch.testing.assert_close(per_head_extend(*at, own), per_head_extend(*at, full))


def test_decode_reads_packed_requests_through_their_tables(device: torch.device) -> None:
    """A decode step over a packed request and an unpacked one, on the unit pool: the output is
    each query head's attention over exactly its KV head's entries, and the attention it
    computed becomes the packed request's statistic, column by column of its tables."""
    layers, heads, group = 2, 2, 2
    pool, allocator = UnitPool(128, layers, heads, 3, device), FakeAllocator(128, seed=3, device=device)
    packed = ReqKvState(policy=get_policy("h2o"), budget=Budget(4), device=device)
    batch = _batch(allocator, 20, packed)
    _compact(batch, pool, packed, 4, 5)
    g = packed.packed
    r2t = batch.req_to_token_pool.req_to_token
    r2t[0, g : g + 3] = allocator.alloc(3).to(torch.int32)  # three tokens decoded since
    r2t[1, :3] = allocator.alloc(3).to(torch.int32)  # an unpacked request of 3 entries
    r2t[2, :5] = allocator.alloc(5).to(torch.int32)  # one compressed into its row (a uniform pass)
    lens = [g + 3, 3, 5]
    store = KvcStore(layers, 4, r2t, pool)
    assert store.unit_layout == (layers, heads)
    store.attends = True
    store.begin(0, packed)
    store.begin(1, ReqKvState(policy=get_policy("snapkv"), budget=Budget(4), device=device))
    rows_kept = ReqKvState(policy=get_policy("h2o"), budget=Budget(4), device=device)
    store.begin(2, rows_kept)
    rows_kept.kept_positions = torch.tensor([0, 3, 4, 8, 9], device=device).expand(layers, heads, 5)
    packed.stats = [None] * layers
    rows_kept.stats = [torch.zeros(heads, 4, device=device) for _ in range(layers)]
    store.begin_decode([0, 1, 2], lens)
    # The unpacked requests are read through their rows on a CPU, the intact one as plain SGLang
    # reads it, each in a block of its own; a fused plan reads all three through tables.
    block = next(b for b in store.decode_step.blocks if b.units is not None)
    assert len(store.decode_step.blocks) == (3 if device.type == "cpu" else 1)
    # Layers differ in width: each layer's tables are only as wide as its widest head in the block.
    assert [table.shape[-1] for table in block.units] == [8, 7]
    q = torch.randn(3, heads * group, D, generator=torch.Generator().manual_seed(9)).to(device)
    k_units, v_units = pool.unit_buffers()
    for layer in range(layers):
        out = torch.full_like(q, float("nan"))
        store.attend_decode(layer, store.decode_step, q, *pool.get_kv_buffer(layer), 0.5, out)
        for b, row in enumerate([0, 1, 2]):
            tables = store.states[row].tables(r2t[row, : lens[b]], layers, heads)
            for h in range(heads):
                units = tables.units[layer, h, : int(tables.lens[layer, h])]
                keys, values = k_units[units], v_units[units]
                probs = torch.softmax(q[b, h * group : (h + 1) * group] @ keys.T * 0.5, dim=-1)
                assert torch.allclose(out[b, h * group : (h + 1) * group], probs @ values, atol=1e-5)
                if row in (0, 2):  # H2O: attention summed over the query group (eq. 2)
                    state = store.states[row]
                    assert state.stats[layer].shape == (heads, tables.width)
                    stat = state.stats[layer][h, : units.numel()]
                    assert torch.allclose(stat, probs.sum(0), atol=1e-5)


class _RaisingPool(torch.Tensor):
    """A unit buffer whose writes fail (a planted failure inside the batched move)."""

    def __setitem__(self, key, value) -> None:
        raise RuntimeError("planted failure inside the batched move")


@pytest.mark.parametrize("where", ["move", "tables"])
def test_a_failed_variable_compaction_gives_back_the_slots_it_allocated(
    device: torch.device, monkeypatch, where
) -> None:
    """A long prefix hit owns fewer slots than its packed entries need, so the compaction
    allocates new ones first; a failure after that (in the batched move, or while its tables are
    built) gives them back and leaves the request's row as it was."""
    from sgl_kvc.adapter.moments import compaction

    layers, heads, n = 2, 2, 12
    pool, allocator = UnitPool(64, layers, heads, 1, device), FakeAllocator(64, seed=1, device=device)
    state = ReqKvState(policy=get_policy("snapkv"), budget=Budget(4), device=device)
    batch = _batch(allocator, n, state)
    batch.reqs[0].kv.cache_protected_len = n - 1  # owns one slot; 4 x L x H kept need 4
    monkeypatch.setattr(compaction, "make_room_in_tree", lambda tree, need: None)  # a fake tree: nothing to evict
    row = batch.req_to_token_pool.req_to_token[0, :n].clone()
    tables = state.tables(row, layers, heads)
    scores = torch.rand(layers, heads, n, generator=torch.Generator().manual_seed(2)).to(device)
    selection = select_from_scores(scores, torch.zeros(scores.shape, dtype=torch.bool, device=device), 4,
                                   lengths=tables.lens, mode="variable")
    k_units, v_units = pool.unit_buffers()
    buffers = (k_units, v_units)
    if where == "move":
        buffers = (k_units.as_subclass(_RaisingPool), v_units)
    else:
        real = compaction.unit_moves

        # The unit arithmetic fails after the slots were allocated. Planted as an exception, not
        # as a destination list one short: an index out of range is an exception on the CPU
        # but a device-side assert on CUDA, which no caller can recover from.
        def failing(*args):
            real(*args)
            raise RuntimeError("planted failure while the tables are built")

        monkeypatch.setattr(compaction, "unit_moves", failing)
    free_before = allocator.available_size()
    [outcome] = compaction.compact_requests_units(batch, [(0, selection, tables.units)], buffers)
    assert isinstance(outcome, RuntimeError) and "planted" in str(outcome)  # the request fails, alone
    assert allocator.available_size() == free_before  # the new slots came back
    assert torch.equal(batch.req_to_token_pool.req_to_token[0, :n], row) and batch.seq_lens_cpu.tolist() == [n]


def _reference_tables(states, slots, row_lens, layers, heads, width):
    """`block_tables` one (request, layer, head) at a time: a packed request's own entries, then
    its tail's units (`unit_index`), then zeros."""
    b = len(states)
    units = torch.zeros(layers, b, heads, width, dtype=torch.int64)
    lens = torch.zeros(layers, b, heads, dtype=torch.int64)
    for j, (state, n) in enumerate(zip(states, row_lens)):
        packed = state is not None and state.units is not None
        first = state.packed if packed else 0
        tail = unit_index(slots[j, first:n].cpu(), layers, heads)
        for layer in range(layers):
            for head in range(heads):
                own = state.units[layer, head, : int(state.unit_lens[layer, head])].cpu().long() if packed else \
                    torch.zeros(0, dtype=torch.int64)
                row = torch.cat([own, tail[layer, head]])
                units[layer, j, head, : row.numel()] = row
                lens[layer, j, head] = row.numel()
    return units, lens


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 12), st.integers(0, 6)), min_size=1, max_size=6),
    layers=st.integers(1, 3), heads=st.integers(1, 3), spare=st.integers(0, 3), seed=st.integers(0, 10_000),
)
def test_block_tables_against_one_head_at_a_time(device, rows, layers, heads, spare, seed) -> None:
    """The batched tables (`block_tables`) equal a reference built one (request, layer, head) at a
    time, for requests with no state, unpacked, packed (int64 tables, or int32 as a shared
    document's) and tails of any length, in a table `spare` columns wider than it needs."""
    from sgl_kvc.core.request_state import block_tables

    g = torch.Generator().manual_seed(seed)
    states, lens = [], []
    for kind, k, tail in rows:
        if kind == 0:
            states.append(None)
            lens.append(k + tail)
            continue
        state = SimpleNamespace(units=None, unit_lens=None, packed=0, packed_entries=None)
        if kind >= 2:
            unit_lens = torch.randint(0, k + 1, (layers, heads), generator=g)
            units = torch.randint(0, 9999, (layers, heads, k), generator=g) * (torch.arange(k) < unit_lens[..., None])
            state.units = (units.int() if kind == 3 else units).to(device)
            state.unit_lens = unit_lens.to(device)
            state.packed = math.ceil(int(unit_lens.sum()) / (layers * heads))
            state.packed_entries = PackedEntries.of(state.units, state.unit_lens, torch.zeros_like(state.units))
        states.append(state)
        lens.append(state.packed + tail if kind >= 2 else k + tail)
    slots = torch.randint(0, 500, (len(rows), max(lens) + 1), generator=g)
    width = spare + max((int(s.units.shape[-1]) + n - s.packed) if s is not None and s.units is not None else n
                        for s, n in zip(states, lens))
    layer_tables, head_lens = block_tables(states, slots.to(device), lens, layers, heads, (width,) * layers)
    units = torch.stack(layer_tables)
    want_units, want_lens = _reference_tables(states, slots, lens, layers, heads, width)
    assert units.device.type == torch.device(device).type
    assert torch.equal(units.cpu(), want_units) and torch.equal(head_lens.cpu(), want_lens)
