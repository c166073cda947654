"""Per-head passes (sgl_kvc.core.passes) on a store over a small pool, without SGLang: a pass
staged over many small steps chooses exactly what one whole pass chooses, keeps the entries
appended meanwhile in every head, and carries the statistics over; likewise for variable
budgets on the unit pool."""

from __future__ import annotations

import pytest
import torch

from fakes import LayeredKvPool
from sgl_kvc.core import passes
from sgl_kvc.core.passes import StepWork, advance_uniform, advance_variable, start_pass
from sgl_kvc.core.request_state import Budget, ReqKvState
from sgl_kvc.core.store import KvcStore
from sgl_kvc.policies import LayerView, get_policy, select_from_scores, select_per_head

pytestmark = pytest.mark.usefixtures("single_thread")

LAYERS, H_KV, GROUP, D, SLOTS, WINDOW = 2, 2, 3, 8, 96, 4
POLICIES = ["rkv", "snapkv", "h2o", "kvcompress", "streamingllm", "batchmax", "expected_attention", "keydiff"]


def _request(device: torch.device, policy: str, n: int, seed: int, units: bool = False):
    """A store holding one request of n entries (row 0) with its window queries recorded and,
    for the statistics policies, its prefill statistics."""
    pool = LayeredKvPool(SLOTS, LAYERS, H_KV, D, torch.Generator(device="cpu").manual_seed(seed), device, units)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    r2t = torch.zeros(2, 64, dtype=torch.int32, device=device)
    slots = (torch.randperm(SLOTS - 1, generator=g)[:n] + 1).to(device)
    r2t[0, :n] = slots.to(torch.int32)
    store = KvcStore(LAYERS, WINDOW, r2t, pool)
    state = ReqKvState(policy=get_policy(policy), budget=Budget(6), device=device)
    store.begin(0, state)
    for layer in range(LAYERS):
        q = torch.randn(n, H_KV * GROUP, D, generator=g).to(device)
        store.record_extend(layer, 0, q, pool_rows=2)
        if state.policy.uses_stats:
            keys = pool.get_key_buffer(layer)[slots]
            idx = torch.arange(n, device=device)
            store.accumulate(0, layer, q, keys, idx, idx, 0.3)
    return store, state, pool, slots


def _run(store: KvcStore, state: ReqKvState, n: int, target: int, allowance: int, mode: str | None = None):
    """Start a pass to `target` and advance it with `allowance` work per step until it is due."""
    tables = state.tables(store.req_to_token[0, :n], LAYERS, H_KV) if mode else None
    state.pending = start_pass(store, 0, state, state.policy, n, target, "prefill", tables)
    for _ in range(100):
        work = StepWork(allowance=allowance)
        due = advance_variable(store, 0, state, n, work, mode) if mode else advance_uniform(store, 0, state, n, work)
        if due is not None:
            return due
    raise AssertionError("the pass never finished")


@pytest.mark.parametrize("policy", POLICIES)
def test_a_staged_pass_chooses_what_a_whole_pass_chooses(device: torch.device, policy: str) -> None:
    n, target = 30, 6
    store, state, pool, slots = _request(device, policy, n, seed=3)
    whole = _run(store, state, n, target, allowance=1 << 40)
    assert not whole.staged and state.pending is None
    views = [
        LayerView(keys=pool.get_key_buffer(layer)[slots], queries=store.window_queries(0, n)[layer], stats=state.stats[layer],
                  values=pool.get_value_buffer(layer)[slots])
        for layer in range(LAYERS)
    ]
    want = torch.stack([select_per_head(state.policy, [v], target).indices[0] for v in views])
    assert torch.equal(whole.selection.indices, want)
    assert whole.selection.indices.device == device and whole.kept_positions.device == device
    assert torch.equal(whole.kept_positions, want)  # no compaction yet: logical = physical
    staged = _run(store, state, n, target, allowance=1)  # one KV head per step
    assert staged.staged and torch.equal(staged.selection.indices, whole.selection.indices)
    if state.policy.uses_stats:
        for layer in range(LAYERS):
            carried = whole.stats[layer]
            assert carried.shape == (H_KV, target) and carried.device == device
            full = state.policy.carry_stats(views[layer], torch.arange(n, device=device))
            assert torch.equal(carried, full.gather(1, want[layer]))


def test_entries_appended_during_a_staged_pass_are_kept_by_every_head(device: torch.device) -> None:
    n0, n, target = 24, 27, 5
    store, state, pool, _ = _request(device, "snapkv", n, seed=7)
    state.pending = start_pass(store, 0, state, state.policy, n0, target, "decode", None)
    assert advance_uniform(store, 0, state, n0, StepWork(allowance=1)) is None  # one head, not done
    due = None
    while due is None:
        due = advance_uniform(store, 0, state, n, StepWork(allowance=1))
    assert due.selection.n == n and due.began_at == n0
    tail = torch.arange(n0, n, device=device)
    assert torch.equal(due.selection.indices[..., target:], tail.expand(LAYERS, H_KV, n - n0))
    assert bool((due.selection.indices[..., :target] < n0).all())


@pytest.mark.parametrize("mode", ["variable", "layer"])
@pytest.mark.parametrize("policy", ["snapkv", "kvcompress", "expected_attention", "keydiff"])
def test_variable_pass_sorts_every_heads_scores_once(device: torch.device, mode: str, policy: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    n, target = 26, 5
    store, state, pool, slots = _request(device, policy, n, seed=11, units=True)
    sorts = []

    def recording(*args, **kwargs):
        sorts.append(kwargs["mode"])
        return select_from_scores(*args, **kwargs)

    monkeypatch.setattr(passes, "select_from_scores", recording)
    whole = _run(store, state, n, target, allowance=1 << 40, mode=mode)
    scores = torch.empty(LAYERS, H_KV, n, device=device)
    protected = torch.zeros(LAYERS, H_KV, n, dtype=torch.bool, device=device)
    for layer in range(LAYERS):
        q = store.window_queries(0, n)[layer]
        for h in range(H_KV):
            stats = state.stats[layer]
            view = LayerView(
                keys=pool.k[slots, layer, h : h + 1], queries=q[:, h * GROUP : (h + 1) * GROUP],
                stats=None if stats is None else stats[h : h + 1], values=pool.v[slots, layer, h : h + 1],
            )
            scores[layer, h] = state.policy.score(view)[0]
            protected[layer, h] = state.policy.protected(view)
    # KV-Compress sorts every layer and head at once under variable (its §4.2); the attention sums
    # of the others are sorted per layer on either server (`passes.allocation`).
    sort = "variable" if mode == "variable" and policy == "kvcompress" else "layer"
    assert sorts == [sort]
    want = select_from_scores(scores, protected, target, mode=sort)
    if sort == "layer":
        assert whole.selection.lengths.sum(dim=1).tolist() == [target * H_KV] * LAYERS
    assert torch.equal(whole.selection.lengths, want.lengths)
    assert torch.equal(whole.selection.indices, want.indices)
    assert whole.units.device == device and whole.selection.total <= target * LAYERS * H_KV
    staged = _run(store, state, n, target, allowance=1, mode=mode)
    assert staged.staged and torch.equal(staged.selection.indices, whole.selection.indices)
    if state.policy.uses_stats:
        assert all(s.shape == (H_KV, whole.selection.max_keep) for s in whole.stats)


def test_step_work_lets_the_first_head_run_whatever_it_costs() -> None:
    work = StepWork(allowance=10)
    assert work.allows(50) and not work.fits(50)
    work.spend(50)
    assert not work.allows(1)
    assert StepWork.unlimited().fits(1 << 40)


@pytest.mark.parametrize("mode", ["variable", "layer"])
def test_kvzip_sorts_every_head_at_once_wherever_heads_may_differ(device: torch.device, mode: str) -> None:
    """KVzip's scores are comparable across layers and heads (`Policy.global_sort`): on the unit
    pool one sort over layer x head x entry chooses, under `layer` head budgets too. Here layer 0
    scores everything higher (a copy head's flat scores): one sort gives it more than its layer's
    share, as KVzip's paper and kvpress keep it; per layer, each would keep the same."""
    from sgl_kvc.core.reconstruction import PassScores

    n, target = 60, 14  # beyond each head's protected sinks and window
    store, state, pool, slots = _request(device, "kvzip", n, seed=5, units=True)
    g = torch.Generator(device="cpu").manual_seed(6)
    layers = [torch.rand(H_KV, n, generator=g).to(device) + (1.0 if layer == 0 else 0.0) for layer in range(LAYERS)]
    state.reconstruction = PassScores(layers, n)
    due = _run(store, state, n, target, allowance=1 << 40, mode=mode)
    scores = torch.stack(layers)
    protected = torch.zeros(LAYERS, H_KV, n, dtype=torch.bool, device=device)
    for layer in range(LAYERS):
        view = LayerView(keys=pool.k[slots, layer, :], queries=store.window_queries(0, n)[layer],
                         reconstruction=layers[layer])
        protected[layer] = state.policy.protected(view)
    want = select_from_scores(scores, protected, target, mode="variable")
    assert torch.equal(due.selection.lengths, want.lengths) and torch.equal(due.selection.indices, want.indices)
    per_layer = due.selection.lengths.sum(dim=1).tolist()
    assert per_layer[0] > per_layer[1], per_layer  # not each layer's equal share


def test_kvzip_keeps_the_same_tokens_in_every_head_where_every_head_keeps_as_many(device: torch.device) -> None:
    """With uniform head budgets KVzip cannot give a flat-scoring copy head more entries, and a
    per-head top-k there drops the facts (docs/quality.md, "KVzip on the default server"): it sorts
    the tokens once by their mean score over every layer and head and every head keeps those,
    staged or whole. Here one head's scores are flat-high and the others favour tokens 20-29: a
    per-head top-k would keep other tokens in the flat head, the token sort keeps 20-29 everywhere."""
    from sgl_kvc.core.reconstruction import PassScores

    n, target = 60, 18  # 4 sinks + 4 window + 10 candidates
    store, state, _, _ = _request(device, "kvzip", n, seed=5)
    g = torch.Generator(device="cpu").manual_seed(8)
    layers = [torch.rand(H_KV, n, generator=g) * 0.1 for _ in range(LAYERS)]
    for layer in layers:
        layer[:, 20:30] += 0.5
    layers[1][0] = 0.9 + torch.rand(n, generator=g) * 0.1  # the copy head: everything near 1
    state.reconstruction = PassScores([t.to(device) for t in layers], n)
    whole = _run(store, state, n, target, allowance=1 << 40)
    kept = whole.selection.indices
    assert kept.shape == (LAYERS, H_KV, target)
    assert all(torch.equal(kept[l, h], kept[0, 0]) for l in range(LAYERS) for h in range(H_KV))
    assert set(range(20, 30)) <= set(kept[0, 0].tolist())
    state.reconstruction = PassScores([t.to(device) for t in layers], n)  # a pass takes its scores
    staged = _run(store, state, n, target, allowance=1)
    assert staged.staged and torch.equal(staged.selection.indices, kept)


def test_token_scores_average_each_token_over_the_heads_holding_it() -> None:
    from sgl_kvc.policies import token_scores

    scores = torch.tensor([[[1.0, 2.0, 3.0], [3.0, 4.0, 5.0]]])  # [1 layer, 2 heads, 3 entries]
    positions = torch.tensor([[[0, 1, 2], [2, 1, 7]]])  # head 1 holds other tokens
    out = token_scores(scores, positions)
    assert out.tolist() == [[[1.0, 3.0, 3.0], [3.0, 3.0, 5.0]]]
    scores[0, 0, 0] = float("inf")  # protected in one head: the token is +inf wherever it is held
    assert token_scores(scores, torch.arange(3))[0, :, 0].tolist() == [float("inf")] * 2


def test_only_scores_made_for_one_sort_are_sorted_across_layers() -> None:
    """On the unit pool (`passes.allocation`): KVzip's scores (comparable across layers) are sorted
    once on either server, KV-Compress's under variable (its §4.2); every other policy's scores,
    attention sums that do not compare across layers, are sorted per layer on either server. One
    sort of SnapKV's kept 1 of 7 answers on SmolLM2, per layer 5 (docs/quality.md)."""
    from sgl_kvc.policies.registry import available_policies

    once = {"variable": {"kvzip", "kvcompress"}, "layer": {"kvzip"}}
    for mode, names in once.items():
        sorted_once = {name for name in available_policies() if passes.allocation(get_policy(name), mode) == "variable"}
        assert sorted_once == names, (mode, sorted_once)


@pytest.mark.parametrize("policy", ["snapkv", "keydiff", "streamingllm"])
def test_a_pass_that_holds_the_first_entries_chooses_among_the_rest(device: torch.device, policy: str) -> None:
    """A shared document's extension (`adapter/documents/extensions.py`): every head keeps the
    row's first `held` entries (the document it extends) and chooses the rest among the others
    alone, as the policy chooses among them with its window protected; without them held, it
    would have dropped some (so the test can fail)."""
    n, held, own = 30, 12, 9  # own > the window the policy protects (`ExtensionRule`: at least the floor)
    store, state, pool, slots = _request(device, policy, n, seed=21)
    state.pending = start_pass(store, 0, state, state.policy, n, held + own, "prefill", None, held=held)
    due = advance_uniform(store, 0, state, n, StepWork.unlimited())
    first = torch.arange(held, device=device)
    assert bool((due.selection.indices[..., :held] == first).all())
    views = [LayerView(keys=pool.get_key_buffer(layer)[slots], queries=store.window_queries(0, n)[layer],
                       values=pool.get_value_buffer(layer)[slots]) for layer in range(LAYERS)]
    scores = torch.stack([state.policy.score(v) for v in views])
    protected = torch.stack([state.policy.protected(v).expand(H_KV, n) for v in views])
    rest = select_from_scores(scores[..., held:], protected[..., held:], own)
    assert torch.equal(due.selection.indices[..., held:], rest.indices + held)
    unheld = _run(store, state, n, held + own, allowance=1 << 40)
    assert not bool((unheld.selection.indices[..., :held] == first).all())


@pytest.mark.parametrize("mode", ["variable", "layer"])
def test_a_packed_pass_holds_each_heads_packed_entries(device: torch.device, mode: str) -> None:
    """On the unit pool: a request whose first slots are packed (each head its own number of
    entries) holds every head's packed entries, in order, and keeps `own` x heads of the entries
    after them (per layer under `layer`), each head at least its window, none of the held again."""
    n, packed, own = 28, 4, 9  # own at least the window (`ExtensionRule`: at least the floor)
    store, state, pool, slots = _request(device, "snapkv", n, seed=23, units=True)
    per_slot = LAYERS * H_KV
    lens = torch.tensor([[5, 3], [1, 7]], device=device)
    units = torch.zeros(LAYERS, H_KV, int(lens.max()), dtype=torch.int64, device=device)
    starts = (torch.cumsum(lens.reshape(-1), 0) - lens.reshape(-1)).reshape(LAYERS, H_KV)
    for layer in range(LAYERS):
        for h in range(H_KV):
            rel = starts[layer, h] + torch.arange(int(lens[layer, h]), device=device)
            units[layer, h, : int(lens[layer, h])] = slots[rel // per_slot].long() * per_slot + rel % per_slot
    state.pack(units, lens, packed, torch.arange(int(lens.max()), device=device).expand(LAYERS, H_KV, -1) * 2)
    state.offset = 40
    tables = state.tables(store.req_to_token[0, :n], LAYERS, H_KV)
    state.pending = start_pass(store, 0, state, state.policy, n, own, "prefill", tables, held=packed)
    due = advance_variable(store, 0, state, n, StepWork.unlimited(), mode)
    sel = due.selection
    for layer in range(LAYERS):
        for h in range(H_KV):
            kept = sel.indices[layer, h, : int(sel.lengths[layer, h])].tolist()
            held = int(lens[layer, h])
            assert kept[:held] == list(range(held))
            window = state.policy.params.recent_kept
            assert len(kept) - held >= window and kept[-window:] == list(range(held + n - packed - window, held + n - packed))
    assert int((sel.lengths - lens).sum()) == own * LAYERS * H_KV
    if mode == "layer":
        assert (sel.lengths - lens).sum(dim=1).tolist() == [own * H_KV] * LAYERS


def test_a_pass_on_a_row_packed_by_one_sort_keeps_the_requests_budget(device: torch.device) -> None:
    """A row KVzip packed (`Policy.global_sort`) holds unequal layers; a later pass of a policy
    sorted per layer (R-KV's decode passes: `passes.allocation` "layer", on the default server)
    keeps the request's budget x L x H_kv: what the narrow layer cannot use of its equal share goes
    to the wide one (`per_head.layer_shares`). With equal shares this row kept 6 + 10 of 20."""
    n, packed, target = 6, 4, 5
    store, state, pool, slots = _request(device, "rkv", n, seed=29, units=True)
    per_slot = LAYERS * H_KV
    lens = torch.tensor([[1, 1], [7, 7]], device=device)  # 16 units: the 4 packed slots
    units = torch.zeros(LAYERS, H_KV, int(lens.max()), dtype=torch.int64, device=device)
    starts = (torch.cumsum(lens.reshape(-1), 0) - lens.reshape(-1)).reshape(LAYERS, H_KV)
    for layer in range(LAYERS):
        for h in range(H_KV):
            rel = starts[layer, h] + torch.arange(int(lens[layer, h]), device=device)
            units[layer, h, : int(lens[layer, h])] = slots[rel // per_slot].long() * per_slot + rel % per_slot
    state.pack(units, lens, packed, torch.arange(int(lens.max()), device=device).expand(LAYERS, H_KV, -1) * 2)
    state.offset = 40
    assert passes.allocation(state.policy, "policy") == "layer"
    due = _run(store, state, n, target, allowance=1 << 40, mode="policy")
    # each head holds its packed entries and the 2 read since: layers of 6 and 18
    assert due.selection.lengths.sum(dim=1).tolist() == [6, 14]
    assert due.selection.total == target * LAYERS * H_KV
