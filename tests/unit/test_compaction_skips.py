"""A compaction that finds no free slots, at each moment, and Batch-Max with another prompt policy,
in process on the stand-ins of `test_compressor_moments.py` (SGLang's batch, pools and tree).

`SGLKVC_FAILPOINTS=skip_compaction` makes the compaction of a request whose id starts with
`failpoint-skip-<moment>` find no free slots (`adapter/safety/failpoints.py`): between two chunks the
request fails alone (its next chunk would not fit uncompressed); at the other moments its pass is
put off, with a back-off, and it is compressed once slots are there."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fakes import FakeAllocator
from sgl_kvc.adapter import attention
from sgl_kvc.adapter.moments import compressor as compressor_module
from sgl_kvc.adapter.moments.commit import CHUNK_SKIPPED
from sgl_kvc.adapter.safety import failures as failures_module
from sgl_kvc.adapter.safety.failures import failure
from sgl_kvc.config import KvcConfig
from test_compressor_moments import D, H_Q, LAYERS, SLOTS, SlotPool, Tree, _layer, _req

BUDGET, BUFFER = 12, 4


class Run:
    """A compressor over three requests of `prompts` tokens, driven moment by moment."""

    def __init__(self, monkeypatch, config: KvcConfig, prompts: list[int], rids: list[str]) -> None:
        monkeypatch.setenv("SGLKVC_CHECK", "1")
        monkeypatch.setattr(compressor_module.ScoreReducer, "for_sglang_tp_group", classmethod(lambda cls: None))
        monkeypatch.setattr(compressor_module, "tp_rank", lambda: 0)
        self.aborted: list[str] = []
        monkeypatch.setattr(failures_module, "abort", lambda req, message, scheduler: self.aborted.append(message))
        device = torch.device("cpu")
        self.pool = SlotPool(device)
        self.r2t = torch.zeros(8, 256, dtype=torch.int32)
        self.allocator = FakeAllocator(SLOTS, self.pool, seed=1)
        runner = SimpleNamespace(token_to_kv_pool=self.pool, req_to_token_pool=SimpleNamespace(req_to_token=self.r2t),
                                 attn_backend=SimpleNamespace(kvc_store=None, kvc_attends=True), server_args=None)
        self.comp = compressor_module.Compressor(config, runner)
        self.comp.scheduler = SimpleNamespace(chunked_req=None)
        self.reqs = [_req(i) for i in range(len(prompts))]
        for req, rid, n in zip(self.reqs, rids, prompts):
            req.rid = rid
            req.origin_input_ids = [1] * n
            req.skip_radix_cache_insert = True  # nothing published: the stand-in tree holds nothing
            self.r2t[req.kv.req_pool_idx, :n] = self.allocator.alloc(n).to(torch.int32)
        self.fits = True
        self.batch = SimpleNamespace(
            reqs=self.reqs, seq_lens_cpu=torch.tensor(prompts), seq_lens=torch.tensor(prompts), chunked_req=None,
            req_to_token_pool=runner.req_to_token_pool, token_to_kv_pool_allocator=self.allocator,
            tree_cache=Tree(device), seq_lens_sum=None, check_decode_mem=lambda: self.fits,
        )
        self.rows = torch.arange(len(prompts))

    def prefill(self) -> None:
        lens = [int(n) for n in self.batch.seq_lens_cpu]
        self.comp.begin_extend(self.batch)
        fb = SimpleNamespace(extend_seq_lens_cpu=lens, extend_prefix_lens_cpu=[0] * len(lens),
                             req_pool_indices=self.rows, extend_seq_lens=torch.tensor(lens),
                             positions=torch.cat([torch.arange(n) for n in lens]))
        q = torch.randn(sum(lens), H_Q * D)
        for i in range(LAYERS):
            attention._observe_extend(self.comp.store, q, _layer(i), fb)
        self.comp.after_prefill(self.batch)

    def decode_step(self, preempt: bool = False) -> None:
        """A new token per request, its attention observed, then the moment(s) before decode."""
        lens = [int(n) for n in self.batch.seq_lens_cpu]
        for req, n in zip(self.reqs, lens):
            self.r2t[req.kv.req_pool_idx, n] = int(self.allocator.alloc(1)[0])
        lens = [n + 1 for n in lens]
        self.batch.seq_lens_cpu, self.batch.seq_lens = torch.tensor(lens), torch.tensor(lens)
        fb = SimpleNamespace(seq_lens_cpu=torch.tensor(lens), req_pool_indices=self.rows,
                             positions=torch.tensor(lens) - 1, encoder_lens=None)
        self.comp.begin_decode(self.batch, fb)
        q = torch.randn(len(self.reqs), H_Q * D)
        for i in range(LAYERS):
            layer = _layer(i)
            attends = attention._kernel_attends(self.comp.store, q, layer, fb)
            if attends:
                out = torch.empty(len(self.reqs), H_Q, D)
                self.comp.store.attend_decode(i, self.comp.store.decode_step, q.view(-1, H_Q, D), self.pool.k[i],
                                              self.pool.v[i], layer.scaling, out)
            attention._observe_decode(self.comp.store, q, layer, fb, attends)
        if preempt:
            self.comp.before_preempt(self.batch)
        else:
            self.comp.before_decode(self.batch)

    def state(self, i: int):
        return self.comp.state(self.reqs[i])

    def lens(self) -> list[int]:
        return [int(n) for n in self.batch.seq_lens_cpu]


def _config(**kw) -> KvcConfig:
    # The stand-ins run no model: a cut between chunks scores by the chunk's window, not by a
    # forward of the question (tests/e2e/test_kvzip_serving.py checks that one on a real server).
    return KvcConfig(**{"policy": "snapkv", "kv_budget": BUDGET, "kv_buffer": BUFFER, "kv_window": 4,
                        "kv_chunk_window": "chunk", **kw})


@pytest.fixture
def planted(monkeypatch):
    monkeypatch.setenv("SGLKVC_FAILPOINTS", "skip_compaction")


def test_a_skip_after_prefill_is_put_off_then_compressed_during_decode(monkeypatch, planted) -> None:
    run = Run(monkeypatch, _config(), [30, 22, 17], ["failpoint-skip-prefill-0", "ok-1", "ok-2"])
    run.prefill()
    assert run.lens() == [30, BUDGET, BUDGET]
    assert run.comp.stats.skipped == 1 and run.comp.stats.prefill_passes == 2
    assert run.state(0).retry_at > 30 and failure(run.reqs[0]) is None
    for _ in range(3):
        run.decode_step()
    assert run.lens()[0] <= BUDGET + 1 and run.comp.stats.decode_passes >= 1, run.lens()
    assert run.state(0).skips == 0 and not run.aborted


def test_decode_skips_back_off_instead_of_rescoring_every_step(monkeypatch, planted) -> None:
    """Every decode compaction of the planted request finds no slots: its pass is put off by 2,
    4, 8, ... tokens (at most the buffer), not scored and thrown away at every step."""
    run = Run(monkeypatch, _config(kv_buffer=16), [30, 22, 17], ["failpoint-skip-decode-0", "ok-1", "ok-2"])
    run.prefill()
    steps = 40
    for _ in range(steps):
        run.decode_step()
    # over its trigger (budget + buffer = 28) from step 16 on: 24 steps, put off 4 times
    assert 1 <= run.comp.stats.skipped <= 5, run.comp.stats
    assert run.lens()[0] == BUDGET + steps and failure(run.reqs[0]) is None and not run.aborted


def test_a_skip_before_a_preemption_leaves_the_request_to_sglang(monkeypatch, planted) -> None:
    run = Run(monkeypatch, _config(compress_on=("preempt",)), [30, 22, 17],
              ["failpoint-skip-preempt-0", "ok-1", "ok-2"])
    run.prefill()
    run.fits = False  # the decode memory check fails: over-budget requests are compressed
    run.decode_step(preempt=True)
    assert run.lens() == [31, BUDGET, BUDGET]  # the others were; it is left as it was
    assert run.comp.stats.skipped == 1 and run.comp.stats.preempt_passes == 2
    assert failure(run.reqs[0]) is None and not run.aborted


def test_a_skip_between_two_chunks_fails_that_request_alone(monkeypatch, planted) -> None:
    run = Run(monkeypatch, _config(compress_on=("prefill", "chunk-always", "decode", "preempt")), [30, 22, 17],
              ["failpoint-skip-chunk-0", "ok-1", "ok-2"])
    run.batch.chunked_req = run.reqs[0]  # its prompt goes on in another chunk
    run.comp.scheduler.chunked_req = run.reqs[0]
    run.prefill()
    assert failure(run.reqs[0]) == CHUNK_SKIPPED
    assert run.aborted == [CHUNK_SKIPPED]
    assert run.lens() == [30, BUDGET, BUDGET] and run.comp.stats.failed_requests == 1


def test_no_pass_is_scored_when_its_copies_cannot_be_had(monkeypatch) -> None:
    """A request still holding the tree's entries needs fresh slots to compact: with none free,
    its pass is not even started (the pool's own slots are too few)."""
    run = Run(monkeypatch, _config(), [30, 22, 17], ["a", "b", "c"])
    monkeypatch.setenv("SGLKVC_CHECK", "0")  # the stand-in tree holds no slots to account for
    run.reqs[0].kv.cache_protected_len = 30  # its prompt is the tree's
    run.allocator.free_slots = []
    run.prefill()
    assert run.lens() == [30, BUDGET, BUDGET] and run.comp.stats.skipped == 1
    assert run.state(0).pending is None and run.comp.stats.prefill_passes == 2


@pytest.mark.parametrize("prompt_policy", ["snapkv", "keydiff", "batchmax"])
def test_batchmax_runs_once_per_trigger_whichever_prompt_policy(monkeypatch, prompt_policy: str) -> None:
    """After prefill the prompt is cut to where Batch-Max's decode trigger would cut it
    (budget - p), not to the budget, which its first decode step would cut again."""
    config = _config(policy="batchmax", prompt_policy=prompt_policy)
    run = Run(monkeypatch, config, [30, 22, 17], ["a", "b", "c"])
    run.prefill()
    chunk = min(config.policy_params().evict_chunk, BUDGET // 2)
    assert run.lens() == [BUDGET - chunk] * 3 and run.comp.stats.prefill_passes == 3
    run.decode_step()
    assert run.comp.stats.decode_passes == 0, run.comp.stats
