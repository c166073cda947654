"""The whole-prompt query moments in the compressor: who pays for them, what they count, when
they go. A prompt read in two chunks by the attention observers (`adapter/attention.py`) on the
stand-ins of `test_compressor_moments`; the numerics against kvpress are
`tests/core/test_ea_prompt_moments.py`'s."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fakes import FakeAllocator
from sgl_kvc.adapter import attention
from sgl_kvc.adapter.moments import compressor as compressor_module
from sgl_kvc.adapter.moments.request_life import released
from sgl_kvc.config import KvcConfig
from sgl_kvc.core.query_moments import QueryMoments
from sgl_kvc.core.views import prompt_moments
from sgl_kvc.policies import ExpectedAttentionPolicy
from test_compressor_moments import D, H_Q, SLOTS, SlotPool, Tree, _layer, _req

LAYERS = 2
CHUNK = 24


def _setup(monkeypatch, policy: str, prompt_policy: str = "auto", prompts=(40, 30), moment_slots: int | None = None):
    monkeypatch.setattr(compressor_module.ScoreReducer, "for_sglang_tp_group", classmethod(lambda cls: None))
    monkeypatch.setattr(compressor_module, "tp_rank", lambda: 0)
    device = torch.device("cpu")
    pool = SlotPool(device)
    r2t = torch.zeros(8, 128, dtype=torch.int32)
    allocator = FakeAllocator(SLOTS, pool, seed=1, device=device)
    runner = SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=r2t),
                             attn_backend=SimpleNamespace(kvc_store=None, kvc_attends=True), server_args=None)
    if moment_slots is not None:  # what the KV-memory hook reserved (`adapter/memory/kv_memory.py`)
        runner.memory_pool_config = SimpleNamespace(kvc_moment_slots=moment_slots)
    config = KvcConfig(policy=policy, prompt_policy=prompt_policy, kv_budget=12, kv_buffer=4, kv_window=4,
                       compress_on=("prefill", "decode", "preempt"))
    comp = compressor_module.Compressor(config, runner)
    comp.runner, runner.allocator = runner, allocator  # what the test's batches hand the compaction
    reqs = [_req(i) for i in range(len(prompts))]
    for req, n in zip(reqs, prompts):
        r2t[req.kv.req_pool_idx, :n] = allocator.alloc(n).to(torch.int32)
    return comp, reqs, allocator, r2t


def _extend(comp, reqs, prefix: list[int], lens: list[int], chunked, q: torch.Tensor) -> SimpleNamespace:
    """One extend of `lens` tokens per request after `prefix` cached ones, observed in every layer;
    `chunked`: the request whose prompt goes on (SGLang's `batch.chunked_req`)."""
    seq = [p + e for p, e in zip(prefix, lens)]
    batch = SimpleNamespace(reqs=reqs, seq_lens_cpu=torch.tensor(seq), seq_lens=torch.tensor(seq), chunked_req=chunked,
                            tree_cache=Tree(torch.device("cpu")), check_decode_mem=lambda: True, seq_lens_sum=None,
                            req_to_token_pool=comp.runner.req_to_token_pool,
                            token_to_kv_pool_allocator=comp.runner.allocator)
    comp.begin_extend(batch)
    fb = SimpleNamespace(extend_seq_lens_cpu=list(lens), extend_prefix_lens_cpu=list(prefix),
                         req_pool_indices=torch.tensor([r.kv.req_pool_idx for r in reqs]),
                         extend_seq_lens=torch.tensor(lens),
                         positions=torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, lens)]))
    for i in range(LAYERS):
        attention._observe_extend(comp.store, q[i], _layer(i), fb)
    return batch


def _reference(qs: list[torch.Tensor], first: list[int], policy) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass over every counted pre-RoPE query of one layer (the chunks' queries, first at
    logical `first`)."""
    pre = torch.cat([policy.prerope_queries(q.view(-1, H_Q, D), torch.arange(f, f + q.shape[0]))
                     for q, f in zip(qs, first)]).double()
    pre = pre[policy.params.sink_tokens - first[0]:] if first[0] < policy.params.sink_tokens else pre
    mean = pre.mean(dim=0)
    return mean, torch.einsum("shi,shj->hij", pre - mean, pre - mean) / pre.shape[0]


def test_a_chunked_prompt_accumulates_every_query_and_releases_them(monkeypatch) -> None:
    """Expected Attention's request folds in both chunks' queries (sinks left out); the prefill
    pass scores with them; then they are dropped (the store's bytes fall back)."""
    comp, reqs, *_ = _setup(monkeypatch, "expected_attention", prompts=(40,))
    req = reqs[0]
    g = torch.Generator().manual_seed(0)
    q1 = torch.randn(LAYERS, CHUNK, H_Q * D, generator=g)
    q2 = torch.randn(LAYERS, 40 - CHUNK, H_Q * D, generator=g)
    batch = _extend(comp, reqs, [0], [CHUNK], req, q1)
    comp.after_prefill(batch)  # a middle chunk (no chunk moment on this server): moments stay
    state = comp.state(req)
    assert isinstance(state.query_moments, QueryMoments) and state.query_moments.counts == [CHUNK - 4] * LAYERS
    batch = _extend(comp, reqs, [CHUNK], [40 - CHUNK], None, q2)
    moments = state.query_moments
    policy = comp.policy("expected_attention", 12)
    for layer in range(LAYERS):
        mean, cov = moments.statistics(layer)
        ref_mean, ref_cov = _reference([q1[layer], q2[layer]], [0, CHUNK], policy)
        assert torch.allclose(mean.double(), ref_mean, atol=1e-5) and torch.allclose(cov.double(), ref_cov, atol=1e-5)
    held = comp.store.state_bytes
    calls = []
    real = ExpectedAttentionPolicy._prompt_logits
    monkeypatch.setattr(ExpectedAttentionPolicy, "_prompt_logits",
                        lambda self, *a: calls.append(1) or real(self, *a))
    comp.after_prefill(batch)
    assert calls, "the prefill pass did not score with the prompt's moments"
    assert comp.stats.passes == 1 and state.query_moments is None
    assert comp.store.state_bytes < held


def test_a_reused_prefix_counts_only_what_the_request_computed(monkeypatch) -> None:
    """A request whose first extend starts after 30 cached tokens (a radix hit) never saw their
    queries: its moments count its own 10 (no sink among them)."""
    comp, reqs, *_ = _setup(monkeypatch, "expected_attention", prompts=(40,))
    q = torch.randn(LAYERS, 10, H_Q * D)
    _extend(comp, reqs, [30], [10], reqs[0], q)
    moments = comp.state(reqs[0]).query_moments
    assert moments.counts == [10] * LAYERS
    mean, _ = moments.statistics(0)
    assert torch.allclose(mean.double(), _reference([q[0]], [30], comp.policy("expected_attention", 12))[0], atol=1e-5)


@pytest.mark.parametrize("policy, prompt_policy, pays", [
    ("expected_attention", "auto", True),
    ("rkv", "expected_attention", True),
    ("expected_attention", "snapkv", False),
    ("snapkv", "auto", False),
    ("rkv", "keydiff", False),
])
def test_only_an_expected_attention_prompt_pays(monkeypatch, policy: str, prompt_policy: str, pays: bool) -> None:
    added = []
    monkeypatch.setattr(QueryMoments, "add", lambda self, *a: added.append(a))
    comp, reqs, *_ = _setup(monkeypatch, policy, prompt_policy)
    _extend(comp, reqs, [0, 0], [CHUNK, CHUNK], reqs[0], torch.randn(LAYERS, 2 * CHUNK, H_Q * D))
    has = [comp.state(r).query_moments is not None for r in reqs]
    assert has == [pays, pays]
    assert len(added) == (2 * LAYERS if pays else 0)


def test_moments_serve_prompt_moments_only(monkeypatch) -> None:
    """A chunk or prefill pass of Expected Attention takes them; a decode pass, or another
    policy, does not (it scores as before)."""
    comp, reqs, *_ = _setup(monkeypatch, "expected_attention", prompts=(40,))
    _extend(comp, reqs, [0], [CHUNK], reqs[0], torch.randn(LAYERS, CHUNK, H_Q * D))
    state = comp.state(reqs[0])
    ea, snap = comp.policy("expected_attention", 12), comp.policy("snapkv", 12)
    for moment in ("chunk", "prefill"):
        got = prompt_moments(comp.store, state, ea, moment)
        assert len(got) == LAYERS and all(m is not None and c is not None for m, c in got)
    assert prompt_moments(comp.store, state, ea, "decode") is None
    assert prompt_moments(comp.store, state, snap, "chunk") is None


def test_release_drops_the_moments(monkeypatch) -> None:
    comp, reqs, *_ = _setup(monkeypatch, "expected_attention", prompts=(40,))
    _extend(comp, reqs, [0], [CHUNK], reqs[0], torch.randn(LAYERS, CHUNK, H_Q * D))
    assert comp.store.state_bytes > 0
    released(comp.store, reqs[0])  # finished, aborted or retracted mid-prompt
    assert comp.store.state_bytes == 0 and comp.state(reqs[0]) is None


def test_moments_beyond_the_reserved_slots_are_declined(monkeypatch) -> None:
    """With one moment slot reserved, the second Expected Attention prompt in flight scores from
    its observation window (no moments: it takes no unreserved memory); once the first prompt
    is read, its slot serves the next one."""
    comp, reqs, *_ = _setup(monkeypatch, "expected_attention", prompts=(40, 30), moment_slots=1)
    batch = _extend(comp, reqs, [0, 0], [CHUNK, CHUNK], reqs[0], torch.randn(LAYERS, 2 * CHUNK, H_Q * D))
    assert [comp.state(r).query_moments is not None for r in reqs] == [True, False]
    assert comp.stats.moments_declined == 1 and comp.store.moment_holders == 1
    comp.state(reqs[0]).query_moments = None  # its prompt read (`after_prefill`)
    late = _req(5)
    comp.begin_extend(SimpleNamespace(reqs=[late], seq_lens_cpu=torch.tensor([8])))
    assert comp.state(late).query_moments is not None and comp.stats.moments_declined == 1
    del batch
