"""A decode step shaped for a GPU, checked on a CPU.

The step runs with its device data on `meta` (the store's buffers, the KV pool, the queries,
the requests' tables and statistics) and its host-side plan on the CPU, so that:

* `LaunchCounter` counts the operations a GPU would launch (ATen operations on device tensors,
  views excepted): with the fused kernel (`DecodeStep.fused`, Triton on CUDA) their number per
  step must not depend on the batch size, only on the layers; with the padded torch kernel it
  grows with the blocks, which shows the count sees the batch;
* `SyncGuard` fails on any operation that makes the host wait for the device, in the plan or in
  any layer's forward (observation writes, attention, statistics).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

import sgl_kvc.core.decode as decode_module
from sgl_kvc.core.request_state import Budget, PackedEntries, ReqKvState
from sgl_kvc.core.store import KvcStore
from sgl_kvc.policies import PolicyParams, get_policy
from sync_guard import AllocationCounter, HostSync, KernelCounter, LaunchCounter, SyncGuard

LAYERS, H_KV, GROUP, D, WINDOW = 3, 2, 3, 16, 8
DEVICE = torch.device("meta")
MIXED = ("rkv", "h2o", "snapkv", "kvcompress", "batchmax", "streamingllm")


@dataclass
class _Pool:
    k: torch.Tensor  # [S, H_kv, d]
    v: torch.Tensor
    units: tuple[torch.Tensor, torch.Tensor] | None = None  # flat [U, d] K and V of the unit pool

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v


class _UnitPool(_Pool):
    def unit_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.units


def _store(batch: int, policies: tuple[str, ...], *, unit_pool: bool, fused: bool, attends: bool,
           seed: int = 0, device: torch.device = DEVICE) -> tuple[KvcStore, list[int], list[int]]:
    """A store with `batch` decoding requests of mixed lengths (policies in turn; on the unit
    pool every other request packed by an earlier compaction), each holding the statistic its
    previous step left. Device data on `device` (`meta`: no data, as the guard tests want)."""
    DEVICE = device  # noqa: N806 - the module's default, or the caller's
    rng = random.Random(seed)
    slots = batch * 400 + 1
    r2t = torch.zeros(batch, 512, dtype=torch.int32, device=DEVICE)
    k = torch.zeros(slots, H_KV, D, dtype=torch.bfloat16, device=DEVICE)
    if unit_pool:
        flat = torch.zeros(slots * LAYERS * H_KV, D, dtype=torch.bfloat16, device=DEVICE)
        pool = _UnitPool(k, k.clone(), (flat, flat.clone()))
    else:
        pool = _Pool(k, k.clone())
    store = KvcStore(LAYERS, WINDOW, r2t, pool)
    store.fused, store.attends = fused, attends
    rows, lens = list(range(batch)), []
    for row in rows:
        name = policies[row % len(policies)]
        state = ReqKvState(policy=get_policy(name, PolicyParams(budget=64)), budget=Budget(64), device=DEVICE)
        store.begin(row, state)
        n = rng.randint(2, 300)
        width = n
        if unit_pool and row % 2:  # packed: 40 columns over 30 slots, then its tail
            kept = 40
            entries = LAYERS * H_KV * kept  # made directly: `PackedEntries.of` reads its lengths
            state.packed_entries = PackedEntries(
                units=torch.zeros(entries, dtype=torch.int64, device=DEVICE),
                positions=torch.zeros(entries, dtype=torch.int64, device=DEVICE),
                lens=torch.full((LAYERS, H_KV), kept, dtype=torch.int64, device=DEVICE),
                widths=(kept,) * LAYERS, entries=entries)
            state.packed = 30
            n = state.packed + rng.randint(1, 100)
            width = state.table_width(n)
        if state.policy.uses_stats:  # what the previous step left: one column fewer
            state.stats = [torch.zeros(H_KV, width - 1, device=DEVICE) for _ in range(LAYERS)]
        lens.append(n)
    return store, rows, lens


def _step(store: KvcStore, rows: list[int], lens: list[int]) -> None:
    """One decode step as the server runs it: the plan, then every layer's attention (the
    kernel's, or another's with the statistics beside it) and observation."""
    store.begin_decode(rows, lens)
    step = store.decode_step
    batch = len(rows)
    row_index = torch.zeros(batch, dtype=torch.int64, device=DEVICE)  # SGLang's req_pool_indices
    for layer in range(LAYERS):
        q = torch.zeros(batch, H_KV * GROUP, D, dtype=torch.bfloat16, device=DEVICE)
        out = torch.empty_like(q)
        k, v = store.kv_pool.get_key_buffer(layer), store.kv_pool.get_value_buffer(layer)
        if step is not None and step.attends:
            store.attend_decode(layer, step, q, k, v, 0.25, out)
        store.record_decode(layer, row_index, q, store.req_to_token.shape[0])
        if step is not None and step.has_stats and not step.attends:
            step.accumulate(layer, q, k, 0.25)


def _launches(batch: int, **kwargs) -> list[str]:
    store, rows, lens = _store(batch, **kwargs)
    with LaunchCounter() as counter:
        _step(store, rows, lens)
    return counter.ops


CASES = [
    pytest.param(dict(policies=("rkv",), unit_pool=False, attends=True), id="rows-rkv"),
    pytest.param(dict(policies=("h2o",), unit_pool=False, attends=True), id="rows-h2o"),
    pytest.param(dict(policies=MIXED, unit_pool=False, attends=True), id="rows-mixed"),
    pytest.param(dict(policies=MIXED, unit_pool=False, attends=False), id="rows-mixed-stats-beside"),
    pytest.param(dict(policies=("snapkv",), unit_pool=True, attends=True), id="units-snapkv"),
    pytest.param(dict(policies=MIXED, unit_pool=True, attends=True), id="units-mixed"),
]


@pytest.mark.parametrize("case", CASES)
def test_fused_decode_launches_do_not_grow_with_the_batch(case: dict) -> None:
    small, large = _launches(8, fused=True, **case), _launches(256, fused=True, **case)
    assert small == large, f"{len(small)} operations for 8 requests, {len(large)} for 256"


@pytest.mark.parametrize("case", CASES)
def test_padded_decode_launches_grow_with_its_blocks(case: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: the padded torch kernel runs per block, and the count sees it."""
    monkeypatch.setattr(decode_module, "DECODE_BLOCK_ELEMS", 64 * H_KV * D)  # a few requests per block
    small, large = _launches(8, fused=False, **case), _launches(64, fused=False, **case)
    assert len(large) > 4 * len(small)


def test_probabilities_only_for_the_requests_that_keep_statistics() -> None:
    """A mixed batch: the kernel is asked for the probabilities of its H2O requests alone."""
    cpu = torch.device("cpu")
    store, rows, lens = _store(6, ("rkv", "h2o", "snapkv"), unit_pool=True, fused=True, attends=True, device=cpu)
    store.begin_decode(rows, lens)
    (block,) = store.decode_step.blocks
    assert block.index is None and block.probs_rows.tolist() == [1, 4]
    assert block.logit_rows.slots.tolist() == [-1, 0, -1, -1, 1, -1] and block.logit_rows.count == 2
    (group,) = block.groups
    assert group.rows.tolist() == [0, 1] and group.lse_rows.tolist() == [1, 4] and group.policy.name == "h2o"
    store, rows, lens = _store(6, ("rkv", "snapkv"), unit_pool=True, fused=True, attends=True, device=cpu)
    store.begin_decode(rows, lens)
    assert not store.decode_step.blocks[0].groups  # no statistics: no probabilities at all


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "padded"])
@pytest.mark.parametrize("case", CASES)
def test_a_decode_step_never_waits_for_the_device(case: dict, fused: bool) -> None:
    store, rows, lens = _store(16, fused=fused, **case)
    with SyncGuard():
        _step(store, rows, lens)


def test_the_sync_guard_fails_a_planted_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    store, rows, lens = _store(4, ("h2o",), unit_pool=False, fused=True, attends=True)
    record = KvcStore.record_decode

    def syncing(self, layer, rows_t, q, pool_rows):
        if int(rows_t.max()) >= 0:  # a host read of device data
            record(self, layer, rows_t, q, pool_rows)

    monkeypatch.setattr(KvcStore, "record_decode", syncing)
    with pytest.raises(HostSync, match="read to the host"), SyncGuard():
        _step(store, rows, lens)


def test_a_reserved_ring_is_never_reallocated_by_a_step() -> None:
    """What a CUDA graph needs of the observation ring (`tests/core/test_graph_capture.py`):
    reserved beforehand, a step writes into it and allocates none."""
    store, rows, lens = _store(16, ("rkv",), unit_pool=False, fused=True, attends=True)
    store.reserve_queries(H_KV * GROUP, D, torch.bfloat16)
    ring = store._queries
    assert ring.shape[0] == store.req_to_token.shape[0]
    _step(store, rows, lens)
    assert store._queries is ring


class _Launch:
    """A Triton kernel launched as on a GPU, without its data: one operation on its first device
    tensor argument (what `KernelCounter` counts as the launch)."""

    def __getitem__(self, grid: tuple) -> "_Launch":
        return self

    def __call__(self, *args, **kwargs) -> None:
        out = next(a for a in args if isinstance(a, torch.Tensor) and a.device.type != "cpu")
        out.view(-1)[:0].zero_()


@pytest.fixture
def triton_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused plan's kernels as CUDA runs them: the Triton decode and statistics kernels
    (their wrappers' own allocations and operations as they are), not the torch stand-in."""
    from sgl_kvc.core import stat_slab
    from sgl_kvc.kernels import per_head_attention, triton_per_head, triton_stats

    monkeypatch.setattr(per_head_attention, "fused_decode", lambda *args: True)
    monkeypatch.setattr(stat_slab, "_kernel_device", lambda t: True)
    for module, name in ((triton_per_head, "_per_head_decode_kernel"), (triton_per_head, "_merge_splits_kernel"),
                         (triton_stats, "_add_contribution_kernel")):
        monkeypatch.setattr(module, name, _Launch())


def _serving_kernels(batch: int, policies: tuple[str, ...]) -> int:
    from benchmarks.decode_step import StepShape, serving_step

    _, step, _ = serving_step(batch, StepShape(), policies, DEVICE, fused=True)
    step()  # the statistics' first step moves them into a step's slab
    with KernelCounter() as counter:
        step()
    return len(counter.ops)


@pytest.mark.usefixtures("triton_launches")
def test_statistics_cost_one_kernel_per_layer_whatever_the_batch() -> None:
    """A serving-shaped step (32 layers, `benchmarks/decode_step.py`): with H2O beside R-KV, at
    most 1.3x the kernels of R-KV alone, the same for 8 and 256 requests."""
    for batch in (8, 256):
        alone, mixed = _serving_kernels(batch, ("rkv",)), _serving_kernels(batch, ("rkv", "h2o"))
        assert mixed <= 1.3 * alone, (batch, alone, mixed)
        assert mixed - alone <= 32 + 8, (batch, alone, mixed)  # one per layer, a few per step
    assert _serving_kernels(8, ("rkv", "h2o")) == _serving_kernels(256, ("rkv", "h2o"))


def _transient(long_len: int, policies: tuple[str, ...]) -> int:
    """Peak bytes a fused serving-shaped step (256 requests of 256-384 entries; one of them
    `long_len` long if given) allocates above what it holds before (`AllocationCounter`)."""
    from benchmarks.decode_step import StepShape, serving_step

    shape = StepShape(layers=4)
    lens = None if not long_len else {128: long_len}
    _, step, _ = serving_step(256, shape, policies, DEVICE, fused=True, lengths=lens)
    step()
    with AllocationCounter() as counter:
        step()
    return counter.peak


@pytest.mark.usefixtures("triton_launches")
@pytest.mark.parametrize("policies", [("rkv",), ("rkv", "h2o")], ids=["rkv", "rkv+h2o"])
def test_one_long_request_does_not_inflate_a_steps_transient_memory(policies: tuple[str, ...],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """One 32768-entry request among 256 short ones (a tenant with `policy: none`, or a huge
    budget): what a step allocates follows the entries (rows of `req_to_token` read in place, a
    workspace for the splits each request has), at most twice what it does without that request.
    The negative control, a workspace for as many splits per
    request as the longest one has, takes many times more."""
    short, long = _transient(0, policies), _transient(32768, policies)
    assert long <= 2 * short, (short, long)
    plan = decode_module.split_plan
    monkeypatch.setattr(decode_module, "split_plan",
                        lambda widths, device: plan([max(widths)] * len(widths), device))  # padded to the longest
    assert _transient(32768, policies) > 8 * short
