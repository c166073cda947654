"""How KVzip's reconstruction passes are cut into forwards, and how tensor-parallel ranks agree on
them (`sgl_kvc/adapter/kvzip/`: `reconstruction.py`, `forwards.py`), without a server: real plans over a real `KvcStore`,
SGLang's own `Req` for each forward's requests; the forwards themselves are recorded, not run.

Tensor parallelism is played by threads, one per rank, whose `RankVote` sums over a barrier with
a timeout: a rank that does not take part in a vote the others entered breaks the barrier (a
test failure in seconds), where a real TP group would wait forever in its collective.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch

from fakes import FakeAllocator, LayeredKvPool
from sgl_kvc.adapter.kvzip import forwards as forwards_module
from sgl_kvc.adapter.kvzip.limits import RESERVE_HEAD, forward_groups, forward_limit
from sgl_kvc.adapter.kvzip.reconstruction import Reconstructor
from sgl_kvc.adapter.memory.kv_memory import Reservation, forward_entries, forward_room
from sgl_kvc.adapter.safety.failures import FailedOnAnotherRank
from sgl_kvc.adapter.safety.tp import RankVote
from sgl_kvc.config import KvcConfig
from sgl_kvc.core.reconstruction import ReconstructionPrompt, instruction_tokens
from sgl_kvc.core.request_state import Budget, ReqKvState
from sgl_kvc.core.store import KvcStore
from sgl_kvc.policies import get_policy

PROMPT = ReconstructionPrompt(system=(1, 2), suffix=(8, 9), first=(50, 51, 52), later=(60, 61))
HEAD = instruction_tokens(PROMPT)  # tokens of a forward besides its context
CONFIG = KvcConfig(policy="snapkv", prompt_policy="kvzip", kvzip_chunk=2048)


def _req(i: int, tokens: int) -> SimpleNamespace:
    """One of SGLang's requests as the planner reads it: its row is i, its prompt `tokens` long."""
    ids = [1, 2, *[(7 * j + i) % 1900 + 10 for j in range(tokens - 4)], 8, 9]
    return SimpleNamespace(rid=f"r{i}", origin_input_ids=ids, kv=SimpleNamespace(req_pool_idx=i),
                           sampling_params=SimpleNamespace(max_new_tokens=8, custom_params=None), lora_id=None)


def _setup(n: int, tokens: int, width: int | None = None, config: KvcConfig = CONFIG):
    """n requests of `tokens` prompt tokens, all read, in rows 0..n-1 of a real store."""
    width = width or tokens + config.kvzip_chunk + RESERVE_HEAD
    pool = LayeredKvPool(slots=64, layers=2, heads=1, dim=4, g=torch.Generator().manual_seed(0))
    store = KvcStore(2, 4, torch.zeros(n, width, dtype=torch.int32), pool)
    reqs = [_req(i, tokens) for i in range(n)]
    batch = SimpleNamespace(reqs=reqs, seq_lens_cpu=torch.full((n,), tokens))
    states = [ReqKvState(policy=get_policy("snapkv"), budget=Budget(16), prompt_policy="kvzip") for _ in reqs]
    return store, batch, states


def _recorder(rec: Reconstructor, forwards: list) -> None:
    """Record each forward as [(batch index, tokens read, entries attended)] instead of running it."""
    def forward(scheduler: Any, items: list, k: int) -> None:
        forwards.append([(item.i, len(item.plan.chunks[k].ids), item.prefix + len(item.plan.chunks[k].ids))
                         for item in items])
    rec._forward = forward  # type: ignore[method-assign]


def _scheduler(chunk: int | None, max_prefill: int = 16384) -> SimpleNamespace:
    return SimpleNamespace(chunked_prefill_size=chunk, max_prefill_tokens=max_prefill)


# --- 1. no forward above SGLang's prefill size, none past the reserved entries ------------------


def test_forward_groups_keep_the_round_s_order_within_both_bounds() -> None:
    assert forward_groups([(10, 50), (10, 50), (10, 50)], max_tokens=25, max_entries=1000) == [[0, 1], [2]]
    assert forward_groups([(10, 50), (10, 50), (10, 50)], max_tokens=100, max_entries=120) == [[0, 1], [2]]
    assert forward_groups([(10, 50)] * 4, max_tokens=100, max_entries=1000) == [[0, 1, 2, 3]]
    # a part over a bound alone runs alone, and the next starts a forward of its own
    assert forward_groups([(5, 5), (30, 5), (5, 5)], max_tokens=20, max_entries=1000) == [[0], [1], [2]]
    assert forward_groups([], 10, 10) == []


def test_sglang_s_tokens_per_prefill_forward() -> None:
    assert forward_limit(_scheduler(8192, 16384)) == 8192
    assert forward_limit(_scheduler(None, 16384)) == 16384  # chunked prefill off: the round's cap
    assert forward_limit(_scheduler(-1, 4096)) == 4096
    assert forward_limit(SimpleNamespace()) is None


def test_requests_over_one_cached_prefix_never_share_a_forward_above_the_prefill_size() -> None:
    """The issue's case, scaled to a unit test: 32 KVzip requests over one cached 16K prefix are
    due in one moment. Before, each round was one forward of 32 x (2048 + instruction) tokens,
    8x SGLang's chunked-prefill size (an OOM on a GPU). Now every forward reads at most the prefill
    size and attends to at most the widest row's entries (the keys kv_memory reserves), every
    chunk of every request is read once, in order, and short prompts still share forwards."""
    n, tokens = 32, 16384 + 4
    store, batch, states = _setup(n, tokens)
    rec = Reconstructor(CONFIG, store, _prompt=PROMPT, _positions=1 << 20)
    forwards: list = []
    _recorder(rec, forwards)
    scheduler = _scheduler(8192)
    failed: list = []
    rec.run(scheduler, batch, [(i, states[i], "prefill") for i in range(n)], lambda r, e: failed.append(e))
    assert failed == []
    width = int(store.req_to_token.shape[1])
    assert max(sum(t for _, t, _ in f) for f in forwards) <= 8192
    assert max(sum(e for _, _, e in f) for f in forwards) <= width or all(len(f) == 1 for f in forwards)
    per_request = -(-(tokens - 4) // 2048)
    for i in range(n):  # each request's chunks, once each, in order
        assert sum(1 for f in forwards for j, _, _ in f if j == i) == per_request
    assert all(s.reconstruction is not None for s in states)

    # short prompts: the prefill size is what cuts them, and they share forwards
    store, batch, states = _setup(32, 300, width=20000)
    rec = Reconstructor(CONFIG, store, _prompt=PROMPT, _positions=1 << 20)
    forwards = []
    _recorder(rec, forwards)
    rec.run(_scheduler(2048), batch, [(i, states[i], "prefill") for i in range(32)], lambda r, e: None)
    part = 296 + len(PROMPT.first) + len(PROMPT.suffix)  # one chunk: the whole context
    assert {t for f in forwards for _, t, _ in f} == {part}
    assert max(sum(t for _, t, _ in f) for f in forwards) <= 2048
    assert len(forwards) == -(-32 // (2048 // part))  # as many as share a prefill-sized forward


def test_a_prefill_size_below_the_kvzip_chunk_shrinks_the_chunk() -> None:
    """One request alone never reads more than the prefill size in a forward: its chunks shrink
    (more forwards, the same context tokens)."""
    store, batch, states = _setup(1, 3000)
    rec = Reconstructor(CONFIG, store, _prompt=PROMPT, _positions=1 << 20)
    forwards: list = []
    _recorder(rec, forwards)
    rec.run(_scheduler(512), batch, [(0, states[0], "prefill")], lambda r, e: None)
    assert max(t for f in forwards for _, t, _ in f) <= 512
    assert len(forwards) == -(-2996 // (512 - HEAD))
    # a prefill size below one instruction and a token: the smallest forward there is
    forwards.clear()
    store, batch, states = _setup(1, 40)
    rec = Reconstructor(CONFIG, store, _prompt=PROMPT, _positions=1 << 20)
    _recorder(rec, forwards)
    rec.run(_scheduler(HEAD - 2), batch, [(0, states[0], "prefill")], lambda r, e: None)
    assert max(t for f in forwards for _, t, _ in f) == HEAD + 1 and len(forwards) == 36  # a token each


def test_the_kv_memory_reserves_one_forward_s_keys() -> None:
    """A CPU forward hands the layer's fold each row's gathered keys: one layer's keys of every
    entry the forward attends to are alive at once. They are reserved once, for the widest row."""
    config = KvcConfig(policy="snapkv", kvzip_chunk=100)
    entries = forward_entries(config, 8192)
    assert entries == 8192 + forward_room(config) and forward_entries(KvcConfig(policy="none"), 8192) == 0
    base = Reservation.for_model(window=8, num_layers=30, q_heads=9, kv_heads=3, head_dim=64, q_bytes=2)
    with_keys = Reservation.for_model(window=8, num_layers=30, q_heads=9, kv_heads=3, head_dim=64, q_bytes=2,
                                      forward_entries=entries)
    assert with_keys.fixed - base.fixed == entries * 3 * 64 * 2
    assert (with_keys.per_request, with_keys.per_token) == (base.per_request, base.per_token)


# --- 3. tensor parallelism: the ranks run the same forwards or fail together -------------------


class ThreadGroup:
    """`world` ranks as threads: each rank's `RankVote` sums its tally with the others' (a
    barrier exchange that breaks, failing the test, when a rank does not come within `timeout`)."""

    def __init__(self, world: int, timeout: float = 10.0) -> None:
        self.world, self.barrier = world, threading.Barrier(world, timeout=timeout)
        self.tallies: list[torch.Tensor | None] = [None] * world
        self.votes = [0] * world

    def vote(self, rank: int) -> RankVote:
        def all_reduce_sum(t: torch.Tensor) -> None:
            self.tallies[rank] = t.clone()
            self.barrier.wait()
            total = sum(self.tallies)  # a shape another rank does not share raises here
            self.barrier.wait()
            t.copy_(total)
            self.votes[rank] += 1
        return RankVote(self.world, all_reduce_sum)

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        out: list[Any] = [None] * self.world
        errors: list[BaseException] = []

        def one(rank: int) -> None:
            try:
                out[rank] = fn(rank)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "a rank is still waiting"
        if errors:
            raise errors[0]
        return out


def _kvzip_batch_req(i: int, tokens: int) -> SimpleNamespace:
    req = _req(i, tokens)
    req.sampling_params.custom_params = {"sgl_kvc": {"prompt_policy": "kvzip"}}
    return req


def test_a_failed_plan_or_a_skipped_state_on_one_rank_fails_that_request_on_both() -> None:
    """Three KVzip requests due in one moment. On rank 1 the plan of request 1 raises, and request
    2 has no state (it failed to start there: it is not due). The ranks vote on their plans before
    the first forward: both run the same forwards, with request 0 alone, and fail 1 and 2 (rank 0
    with `FailedOnAnotherRank`); no rank waits for another in a vote it does not join. Before,
    rank 0's forwards held all three and rank 1's one: different forwards, whose collectives hang."""
    group = ThreadGroup(2)

    def rank(r: int) -> tuple[list, list]:
        store, batch, states = _setup(3, 60, config=KvcConfig(policy="snapkv", kvzip_chunk=24))
        batch.reqs = [_kvzip_batch_req(i, 60) for i in range(3)]
        rec = Reconstructor(KvcConfig(policy="snapkv", kvzip_chunk=24), store, vote=group.vote(r),
                            _prompt=PROMPT, _positions=1 << 20)
        forwards: list = []
        _recorder(rec, forwards)
        plan = rec._plan
        if r == 1:
            def failing(scheduler, batch, i, *args):
                if i == 1:
                    raise RuntimeError("planted: planning fails on rank 1")
                return plan(scheduler, batch, i, *args)
            rec._plan = failing  # type: ignore[method-assign]
        due = [(i, states[i], "prefill") for i in ((0, 1, 2) if r == 0 else (0, 1))]
        failed: list = []
        rec.run(_scheduler(128), batch, due, lambda req, e: failed.append((req.rid, type(e))))
        return forwards, failed

    (f0, failed0), (f1, failed1) = group.run(rank)
    assert f0 == f1 and f0 and all([j for j, _, _ in f] == [0] for f in f0)
    assert sorted(failed0) == [("r1", FailedOnAnotherRank), ("r2", FailedOnAnotherRank)]
    assert failed1 == [("r1", RuntimeError)]  # r2 failed to start there, earlier


def test_a_rank_with_nothing_due_still_votes_where_a_request_asks_for_kvzip() -> None:
    """The compressor calls the reconstructor where any request of the batch asks for KVzip (its
    settings, read alike on every rank), due or not on this rank; otherwise not at all. Rank 1
    skipped the one request due on rank 0: it still votes, and neither runs a forward."""
    group = ThreadGroup(2)

    def rank(r: int) -> tuple[list, list]:
        store, batch, states = _setup(1, 60, config=KvcConfig(policy="snapkv", kvzip_chunk=24))
        batch.reqs = [_kvzip_batch_req(0, 60)]
        rec = Reconstructor(KvcConfig(policy="snapkv", kvzip_chunk=24), store, vote=group.vote(r),
                            _prompt=PROMPT, _positions=1 << 20)
        forwards: list = []
        _recorder(rec, forwards)
        failed: list = []
        rec.run(_scheduler(128), batch, [(0, states[0], "prefill")] if r == 0 else [],
                lambda req, e: failed.append((req.rid, type(e))))
        return forwards, failed

    (f0, failed0), (f1, failed1) = group.run(rank)
    assert f0 == f1 == [] and failed0 == [("r0", FailedOnAnotherRank)] and failed1 == []
    assert group.votes == [1, 1]

    group = ThreadGroup(2)
    store, batch, _ = _setup(2, 40)
    rec = Reconstructor(CONFIG, store, vote=group.vote(0), _prompt=PROMPT)
    assert rec.must_agree(batch)  # the server's prompt policy is kvzip
    plain = Reconstructor(KvcConfig(policy="snapkv"), store, vote=group.vote(0), _prompt=PROMPT)
    assert not plain.must_agree(batch)
    batch.reqs[1] = _kvzip_batch_req(1, 40)
    assert plain.must_agree(batch)
    assert not Reconstructor(CONFIG, store, _prompt=PROMPT).must_agree(batch)  # one rank: no vote


class _FakeExtend:
    """What `ScheduleBatch.init_new` gives a reconstruction forward, as far as `_forward` reads
    it: `prepare_for_extend` takes the chunk's slots from the allocator."""

    def __init__(self, reqs: list, allocator: FakeAllocator) -> None:
        self.reqs, self.allocator, self.input_ids, self.device = reqs, allocator, torch.zeros(1), "cpu"

    def prepare_for_extend(self) -> None:
        self.out_cache_loc = self.allocator.alloc(sum(r.extend_end - r.prefix_len for r in self.reqs))


def _sglang_batches(monkeypatch) -> None:
    """SGLang's batch and forward-batch constructors, as far as `_forward` reads what they give;
    preparing a request marked `fail_prepare` (on one rank's thread only) raises."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    monkeypatch.setattr(ScheduleBatch, "init_new", staticmethod(
        lambda reqs, req_pool, allocator, *a: _FakeExtend(reqs, allocator)))
    monkeypatch.setattr(ForwardBatch, "init_new", staticmethod(lambda batch, runner, **kw: batch))
    real = forwards_module.shadow_request

    def shadow(req: Any, *args: Any) -> Any:
        if getattr(req, "fail_prepare", False):
            raise RuntimeError("planted: preparing the forward fails here")
        return real(req, *args)

    monkeypatch.setattr(forwards_module, "shadow_request", shadow)


def _one_forward(vote: RankVote | None, prepare_fails: bool, forward: Callable[[Any], None]):
    """One rank's reconstruction of two requests in one forward (`forward`: its model's run;
    `prepare_fails`: preparing the second request raises on this rank):
    (allocator, items, the rows before, store)."""
    store, batch, states = _setup(2, 30, config=KvcConfig(policy="snapkv", kvzip_chunk=24))
    store.req_to_token[:, :40] = torch.arange(1, 41, dtype=torch.int32)
    before = store.req_to_token.clone()
    allocator = FakeAllocator(200)
    rec = Reconstructor(KvcConfig(policy="snapkv", prompt_policy="kvzip", kvzip_chunk=24), store, vote=vote,
                        _prompt=PROMPT, _positions=1 << 20)
    scheduler = SimpleNamespace(
        chunked_prefill_size=128, max_prefill_tokens=16384, model_config=SimpleNamespace(vocab_size=2048),
        req_to_token_pool=None, token_to_kv_pool_allocator=allocator, tree_cache=None, spec_algorithm=None,
        tp_worker=SimpleNamespace(model_runner=SimpleNamespace(forward=forward)))
    items = [rec._plan(scheduler, batch, i, states[i], "prefill") for i in range(2)]
    batch.reqs[1].fail_prepare = prepare_fails
    rec._forward(scheduler, items, 0)
    return allocator, items, before, store


def test_a_forward_prepared_on_one_rank_only_runs_on_neither(monkeypatch) -> None:
    """Preparing a forward (its requests, SGLang's batch and slots) fails on rank 1 alone. The
    ranks vote before the model runs: neither runs it, both fail its requests and read no later
    chunk of theirs, and rank 0 gives back the slots it took and restores the rows."""
    _sglang_batches(monkeypatch)
    group = ThreadGroup(2)
    ran = [0, 0]

    def rank(r: int):
        def forward(fb: Any) -> None:
            ran[r] += 1
        return _one_forward(group.vote(r), prepare_fails=r == 1, forward=forward)

    out = group.run(rank)
    assert ran == [0, 0]
    for r, (allocator, items, before, store) in enumerate(out):
        assert allocator.available_size() == 199 and (store.req_to_token == before).all()
        assert all(item.dropped and item.error is not None for item in items)
    assert all(isinstance(item.error, FailedOnAnotherRank) for item in out[0][1])


def test_an_exception_in_a_tensor_parallel_forward_is_never_swallowed(monkeypatch) -> None:
    """Inside the model's run (its collectives) an exception goes up to SGLang's scheduler, which
    stops the server: a rank that carried on would leave the others in a collective, or run
    other forwards than theirs. The slots and rows are given back first. With one rank there are
    no collectives: the forward's requests fail and every other request goes on."""
    _sglang_batches(monkeypatch)

    def boom(fb: Any) -> None:
        raise RuntimeError("planted: the model's forward fails")

    solo = ThreadGroup(1)
    with pytest.raises(RuntimeError, match="the model's forward fails"):
        _one_forward(solo.vote(0), prepare_fails=False, forward=boom)
    allocator, items, before, store = _one_forward(None, prepare_fails=False, forward=boom)
    assert allocator.available_size() == 199 and (store.req_to_token == before).all()
    assert all(item.dropped and "model's forward fails" in str(item.error) for item in items)
