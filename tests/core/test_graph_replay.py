"""sgl-kvc's part of a decode step, run the way a CUDA graph replays it (`tests/replay_discipline.py`).

A decode step of a compressing server with graphs on (`KvcStore.enable_graphs`) is, per layer,
SGLang's write of the new token's KV, sgl-kvc's attention over the batch's rows and the
observation ring's write, every input in a buffer: SGLang's static batch (rows, lengths, the new
tokens' slots, the queries) and what sgl-kvc writes between steps (`req_to_token` after a
compaction, the packed rows' layout). The steps below differ in every way a server's do at one
batch size: lengths, requests joining and leaving (padded rows, as SGLang pads a batch to its
graph's size), a compaction between two steps, packed and intact rows, rows started from a shared
document (a packed table of units anywhere in the pool), every policy without statistics, the
slot pool, the unit pool and both in FP8. The first step is recorded; every later one must run
the same operations on the same buffers, read nothing back to the host, and equal, byte for byte,
the replay of the first step's operations. The graph step's attention also equals a dense
reference of what each head holds.

The same check fails the eager plan (`DecodeStep`, what a step ran before): its blocks, widths and
gathers follow the batch, and it reads a layer's widths back to the host.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest
import torch

from cuda_graphs import capture
from fakes import LayeredKvPool
from replay_discipline import ReplayCheck, Violation
from sgl_kvc.core.graph_step import GraphStep
from sgl_kvc.core.request_state import Budget, ReqKvState
from sgl_kvc.core.store import KvcStore
from sgl_kvc.policies import PolicyParams, get_policy

LAYERS, H_KV, GROUP, D, WINDOW = 2, 2, 2, 16, 4
ROWS, WIDTH, SLOTS, BATCH = 10, 96, 800, 4  # rows of req_to_token (row 0: SGLang's padding row)
POLICIES = ("rkv", "snapkv", "streamingllm", "keydiff", "expected_attention")
POOLS = ("slots", "units", "fp8-slots", "fp8-units")
SCALE = 1 / math.sqrt(D)


@dataclass
class _Server:
    """A store over a stand-in pool, its graph buffers, and SGLang's static decode inputs."""

    store: KvcStore
    pool: LayeredKvPool
    free: list[int]
    rng: random.Random
    g: torch.Generator
    device: torch.device
    rows: torch.Tensor = None
    lens: torch.Tensor = None
    out_loc: torch.Tensor = None
    q: list[torch.Tensor] = field(default_factory=list)
    out: list[torch.Tensor] = field(default_factory=list)
    new_kv: list[torch.Tensor] = field(default_factory=list)
    live: dict[int, int] = field(default_factory=dict)  # row -> slots its row holds

    def take(self, n: int) -> list[int]:
        out, self.free[:] = self.free[:n], self.free[n:]
        return out


def _server(pool_kind: str, seed: int = 0, device: torch.device | str = "cpu") -> _Server:
    """A store over a stand-in pool of `pool_kind` on `device` (float32, or FP8 codes), graph
    steps on, and SGLang's static decode inputs."""
    g = torch.Generator().manual_seed(seed)
    device = torch.device(device)
    dtype = torch.float32
    fp8 = "fp8_e4m3" if pool_kind.startswith("fp8") else None
    pool = LayeredKvPool(SLOTS, LAYERS, H_KV, D, g, device=device, units=pool_kind.endswith("units"), fp8=fp8)
    r2t = torch.zeros(ROWS, WIDTH, dtype=torch.int32, device=device)
    store = KvcStore(LAYERS, WINDOW, r2t, pool)
    store.attends = True
    store.enable_graphs(H_KV * GROUP, D, dtype, arena_units=4096)
    free = list(range(1, SLOTS))
    random.Random(seed).shuffle(free)
    s = _Server(store, pool, free, random.Random(seed), g, device)
    s.rows = torch.zeros(BATCH, dtype=torch.int64, device=device)
    s.lens = torch.ones(BATCH, dtype=torch.int64, device=device)
    s.out_loc = torch.zeros(BATCH, dtype=torch.int64, device=device)
    s.q = [torch.zeros(BATCH, H_KV * GROUP, D, dtype=dtype, device=device) for _ in range(LAYERS)]
    s.out = [torch.zeros(BATCH, H_KV * GROUP, D, dtype=dtype, device=device) for _ in range(LAYERS)]
    s.new_kv = [torch.zeros(BATCH, H_KV, D, dtype=dtype, device=device) for _ in range(LAYERS)]
    return s


def _start(s: _Server, row: int, n: int, policy: str) -> None:
    """A request in `row` holding its n tokens whole (intact)."""
    state = ReqKvState(policy=get_policy(policy, PolicyParams(budget=32)), budget=Budget(32))
    s.store.begin(row, state)
    s.store.req_to_token[row] = 0
    s.store.req_to_token[row, :n] = torch.tensor(s.take(n), dtype=torch.int32, device=s.device)
    s.live[row] = n


def _compact(s: _Server, row: int, keep: int) -> None:
    """A compaction of `row` between two steps: on the unit pool its heads pack different numbers
    of entries into its first slots; on a slot pool every head keeps `keep` (a shorter row)."""
    state, n = s.store.states[row], s.live[row]
    slots = s.store.req_to_token[row, :n].long()
    if s.store.unit_layout is None:
        s.store.req_to_token[row, keep:] = 0
        state.kept_positions = torch.arange(keep, device=s.device).expand(LAYERS, H_KV, keep).clone()
        s.store.set_offset(row, n - keep)
        s.live[row] = keep
        return
    per_slot = LAYERS * H_KV
    lens = torch.tensor([[s.rng.randint(1, keep) for _ in range(H_KV)] for _ in range(LAYERS)], device=s.device)
    total = int(lens.sum())
    g = -(-total // per_slot)
    width = int(lens.max())
    starts = (torch.cumsum(lens.flatten(), 0) - lens.flatten()).view(LAYERS, H_KV)
    cols = torch.arange(width, device=s.device)
    e = starts[..., None] + cols
    units = (slots[(e // per_slot).clamp(max=g - 1)] * per_slot + e % per_slot) * (cols < lens[..., None])
    state.pack(units, lens, g, torch.zeros(LAYERS, H_KV, width, dtype=torch.int64, device=s.device))
    s.store.req_to_token[row, g:] = 0
    s.live[row] = g


def _from_document(s: _Server, row: int, tail: int, policy: str) -> None:
    """A request that started from a shared document: packed entries anywhere in the pool (the
    document's own slots, held by the tree), then its own tokens."""
    _start(s, row, 0, policy)
    doc = s.take(10)
    s.store.req_to_token[row, :10] = torch.tensor(doc, dtype=torch.int32, device=s.device)
    s.store.req_to_token[row, 10 : 10 + tail] = torch.tensor(s.take(tail), dtype=torch.int32, device=s.device)
    s.live[row] = 10 + tail
    state = s.store.states[row]
    if s.store.unit_layout is None:
        state.kept_positions = torch.arange(10, device=s.device).expand(LAYERS, H_KV, 10).clone()
        s.store.set_offset(row, 100)
        return
    per_slot = LAYERS * H_KV
    units = torch.randperm(10 * per_slot, generator=s.g)[: LAYERS * H_KV * 9].view(LAYERS, H_KV, 9)
    table = torch.tensor(doc)[units // per_slot] * per_slot + units % per_slot
    lens = torch.randint(3, 10, (LAYERS, H_KV), generator=s.g)
    state.pack((table * (torch.arange(9) < lens[..., None])).to(s.device), lens.to(s.device), 10,
               torch.zeros(LAYERS, H_KV, 9, dtype=torch.int64, device=s.device))
    s.store.set_offset(row, 100)


def _finish(s: _Server, row: int) -> None:
    s.store.release(row)
    s.store.req_to_token[row] = 0
    s.live.pop(row)


def _scenario(s: _Server, step: int) -> list[int]:
    """What changes before `step`: the batch's rows in order."""
    p = POLICIES
    if step == 0:
        for row, n in ((1, 40), (2, 7), (3, 61)):
            _start(s, row, n, p[row % len(p)])
        return [1, 2, 3]
    if step == 1:
        _start(s, 4, 20, p[4 % len(p)])  # one joins
        return [1, 2, 3, 4]
    if step == 2:
        _compact(s, 3, 12)  # a compaction between two steps
        return [3, 1, 4, 2]  # another order
    if step == 3:
        _finish(s, 2)  # one leaves: the batch is padded to its size
        return [1, 3, 4]
    if step == 4:
        _from_document(s, 5, 9, p[0])  # one starts from a shared document
        _compact(s, 1, 20)
        return [5, 1, 3, 4]
    if step == 5:
        _finish(s, 4)
        _finish(s, 5)
        return [3, 1]
    return sorted(s.live)


def _prepare(s: _Server):
    def prepare(step: int) -> None:
        batch = _scenario(s, step)
        # each row decodes one token: its new slot, written by SGLang's forward (`out_loc`)
        for row in batch:
            n = s.live[row]
            s.store.req_to_token[row, n] = s.take(1)[0]
            s.live[row] = n + 1
        lens = [s.live[row] for row in batch]
        s.store.begin_decode(batch, lens)
        assert isinstance(s.store.decode_step, GraphStep), s.store.graphs and s.store.graphs.eager
        pad = BATCH - len(batch)  # SGLang's padding: row 0, length 1, slot 0
        s.rows.copy_(torch.tensor(batch + [0] * pad))
        s.lens.copy_(torch.tensor(lens + [1] * pad))
        s.out_loc.copy_(torch.tensor([int(s.store.req_to_token[row, s.live[row] - 1]) for row in batch] + [0] * pad))
        for layer in range(LAYERS):
            s.q[layer].copy_(torch.randn(s.q[layer].shape, generator=s.g).to(s.device))
            s.new_kv[layer].copy_(torch.randn(s.new_kv[layer].shape, generator=s.g).to(s.device))

    return prepare


def _forward(s: _Server):
    def forward() -> None:
        store, step = s.store, s.store.decode_step
        for layer in range(LAYERS):
            k, v = store.kv_pool.get_key_buffer(layer), store.kv_pool.get_value_buffer(layer)
            k[s.out_loc] = s.new_kv[layer]  # SGLang writes the new token's KV first
            v[s.out_loc] = s.new_kv[layer]
            store.attend_decode(layer, step, s.q[layer], k, v, SCALE, s.out[layer], rows=s.rows, seq_lens=s.lens)
            store.record_decode(layer, s.rows, s.q[layer], store.req_to_token.shape[0])

    return forward


@pytest.mark.parametrize("pool_kind", POOLS)
def test_a_decode_step_replays_every_later_step_of_its_batch_size(pool_kind: str) -> None:
    s = _server(pool_kind)
    violations = ReplayCheck(_prepare(s), _forward(s)).run(steps=8)
    assert violations == [], "\n".join(map(str, violations))


def _dense(s: _Server, row: int, layer: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each head's keys and values as a dense reference reads them, from the pool's own buffers
    (an FP8 pool dequantizes on read): its packed table's units, then its row's tail."""
    state = s.store.states[row]
    slots = s.store.req_to_token[row, :n].long()
    keys, values = [], []
    for h in range(H_KV):
        if state.units is not None:
            k_units, v_units = s.pool.unit_buffers()
            c = int(state.unit_lens[layer, h])
            table = state.units[layer, h, :c].long()
            tail = slots[state.packed :]
            units = torch.cat([table, (tail * LAYERS + layer) * H_KV + h])
            keys.append(k_units[units].float().reshape(len(units), D))
            values.append(v_units[units].float().reshape(len(units), D))
        else:
            k, v = s.pool.get_key_buffer(layer), s.pool.get_value_buffer(layer)
            keys.append(k[slots][:, h].float())
            values.append(v[slots][:, h].float())
    return keys, values


@pytest.mark.parametrize("pool_kind", POOLS)
def test_the_graph_steps_attention_is_the_dense_attention_of_what_each_head_holds(pool_kind: str) -> None:
    s = _server(pool_kind, seed=3)
    prepare, forward = _prepare(s), _forward(s)
    for step in range(6):
        prepare(step)
        forward()
        for b, row in enumerate(s.rows.tolist()):
            if row == 0:
                continue
            for layer in range(LAYERS):
                keys, values = _dense(s, row, layer, int(s.lens[b]))
                for h in range(H_KV):
                    q = s.q[layer][b, h * GROUP : (h + 1) * GROUP]
                    w = torch.softmax(q @ keys[h].float().T * SCALE, dim=-1)
                    want = w @ values[h].float()
                    got = s.out[layer][b, h * GROUP : (h + 1) * GROUP]
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_step_holding_a_request_with_statistics_decodes_eagerly() -> None:
    s = _server("units")
    _start(s, 1, 10, "rkv")
    _start(s, 2, 10, "h2o")
    s.store.begin_decode([1, 2], [10, 10])
    assert not isinstance(s.store.decode_step, GraphStep)
    assert s.store.graphs.eager == {"statistics": 1}
    s.store.begin_decode([1], [10])
    assert isinstance(s.store.decode_step, GraphStep)


def test_a_packed_table_the_arena_cannot_hold_decodes_eagerly_and_gives_its_extent_back() -> None:
    s = _server("units")
    s.store.graphs.packed = type(s.store.graphs.packed)(ROWS, LAYERS, H_KV, 8, "cpu")  # an arena of 8 units
    _start(s, 1, 40, "rkv")
    _compact(s, 1, 12)
    s.store.begin_decode([1], [s.live[1]])
    assert not isinstance(s.store.decode_step, GraphStep) and s.store.graphs.eager == {"arena": 1}
    _finish(s, 1)
    assert s.store.graphs.packed.free_units == 8 and s.store.graphs.packed.installed(1)


def test_the_check_fails_the_eager_plan() -> None:
    """What a decode step ran before graphs: the eager plan (`DecodeStep`), under the same check."""
    s = _server("units")
    s.store.graphs = None
    prepare = _prepare(s)

    def eager_prepare(step: int) -> None:
        try:
            prepare(step)
        except AssertionError:  # it plans a `DecodeStep`, not a `GraphStep`
            pass

    violations = ReplayCheck(eager_prepare, _forward(s)).run(steps=6)
    kinds = {v.kind for v in violations}
    assert {"operations", "replay"} <= kinds, violations
    assert any(isinstance(v, Violation) and "aten.index" in v.detail for v in violations)


def _state(s: _Server) -> list[torch.Tensor]:
    """Every tensor a step writes: the observation ring, the outputs, the KV pool's buffers."""
    pool = s.pool
    bufs = [*s.out, s.store._queries, s.store._head, s.store._count]
    for buf in (pool._k, pool._v, *pool._layers_k, *pool._layers_v):
        bufs += [buf.codes, buf.scales] if getattr(buf, "codes", None) is not None else [buf]
    return bufs


@pytest.mark.gpu
@pytest.mark.parametrize("pool_kind", POOLS)
def test_a_cuda_graph_of_a_decode_step_replays_every_later_step(pool_kind: str) -> None:
    """On a GPU: the step captured in a CUDA graph at the first step (the Triton row decode, the
    observation write) and replayed at each later one equals the eager step from the same state."""
    s = _server(pool_kind, device="cuda")
    prepare, forward = _prepare(s), _forward(s)
    prepare(0)
    graph = capture(forward)  # warmed up off the capturing stream, then captured
    for step in range(1, 8):
        prepare(step)
        saved = [t.clone() for t in _state(s)]
        graph.replay()
        torch.cuda.synchronize()
        replayed = [t.clone() for t in _state(s)]
        for live, old in zip(_state(s), saved):
            live.copy_(old)
        forward()
        torch.cuda.synchronize()
        for got, want in zip(replayed, _state(s)):
            assert torch.equal(got, want), step
        assert s.out[0].abs().sum() > 0


def test_a_row_whose_layout_fails_to_install_decodes_eagerly_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    s = _server("units")
    _start(s, 1, 30, "rkv")
    _start(s, 2, 30, "rkv")
    _compact(s, 1, 12)
    _compact(s, 2, 12)
    real = type(s.store.graphs.packed).install

    def install(self, row, state):
        if row == 2:
            raise RuntimeError("planted")
        return real(self, row, state)

    monkeypatch.setattr(type(s.store.graphs.packed), "install", install)
    s.store.begin_decode([1, 2], [s.live[1], s.live[2]])
    assert not isinstance(s.store.decode_step, GraphStep) and s.store.graphs.eager == {"arena": 1}
    s.store.begin_decode([1], [s.live[1]])  # the other row still decodes from the buffers
    assert isinstance(s.store.decode_step, GraphStep)
