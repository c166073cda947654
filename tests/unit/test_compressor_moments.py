"""The compressor's moments in process, on stand-ins for SGLang's batch, pools and tree: a prompt
read, then decode steps that compress, for each policy, selection, decode attention, head budget
and pass size. It runs the per-step code the live-server tests run (the attention observers,
the decode kernel, passes, compaction) under `DeviceGuard` (tests/unit/conftest.py) and with
the invariants checked after every compaction (`SGLKVC_CHECK`).

It needs no SGLang (the adapter imports it only where it calls it), so it runs with the core's
tests under `--without-sglang`, and on CUDA where there is a GPU (`.ci/gpu`): every stand-in
keeps its tensors where SGLang keeps them (pools, rows and slots on the device, `*_cpu` on the
host)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from fakes import FakeAllocator
from sgl_kvc.adapter import attention
from sgl_kvc.adapter.moments import compressor as compressor_module
from sgl_kvc.config import KvcConfig

LAYERS, H_KV, H_Q, D, SLOTS = 2, 2, 4, 16, 256  # head dim 16: the Triton kernel serves it on CUDA
BUDGET, BUFFER = 12, 4
PROMPTS = [30, 22, 17]  # tokens per request, all longer than the budget
STEPS = 12


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class SlotPool:
    """A KV pool of [slots, H_kv, d] per layer (SGLang's `MHATokenToKVPool` surface)."""

    start_layer, layer_num = 0, LAYERS

    def __init__(self, device: torch.device) -> None:
        self.k = [torch.randn(SLOTS, H_KV, D, device=device) for _ in range(LAYERS)]
        self.v = [torch.randn(SLOTS, H_KV, D, device=device) for _ in range(LAYERS)]

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v[layer]

    def get_kv_buffer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]


class UnitPool(SlotPool):
    """The unit pool variable budgets need: one [slots, L, H_kv, d] buffer, viewed per layer."""

    def __init__(self, device: torch.device) -> None:
        self.k_units = torch.randn(SLOTS, LAYERS, H_KV, D, device=device)
        self.v_units = torch.randn(SLOTS, LAYERS, H_KV, D, device=device)
        self.k, self.v = list(self.k_units.unbind(1)), list(self.v_units.unbind(1))

    def unit_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_units.view(-1, D), self.v_units.view(-1, D)


class Tree:
    """A radix cache holding nothing."""

    disable = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def unlock(self, lock: object) -> None:
        pass

    def total_size(self) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def all_values_flatten(self) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.int64, device=self.device)


def _req(i: int) -> SimpleNamespace:
    return SimpleNamespace(
        rid=f"r{i}", lock=None, skip_radix_cache_insert=False, to_finish=None, origin_input_ids=[], output_ids=[],
        kv=SimpleNamespace(req_pool_idx=i, cache_protected_len=0, kv_committed_len=0, kv_allocated_len=0),
        sampling_params=SimpleNamespace(custom_params=None, max_new_tokens=100), finished=lambda: False,
    )


def _layer(i: int) -> SimpleNamespace:
    return SimpleNamespace(layer_id=i, tp_q_head_num=H_Q, qk_head_dim=D, scaling=D**-0.5, logit_cap=0)


# (policy, selection, decode attention, head budget); variable budgets need per-head selection
# and the batched kernel (the launcher refuses the rest)
CASES = [
    (policy, selection, attend, "uniform")
    for policy, selection in [("h2o", "shared"), ("h2o", "per-head"), ("snapkv", "shared"), ("snapkv", "per-head"),
                              ("rkv", "shared"), ("kvcompress", "per-head"), ("expected_attention", "shared"),
                              ("expected_attention", "per-head"), ("keydiff", "per-head")]
    for attend in ["batched", "sglang"]
] + [(policy, "per-head", "batched", "variable") for policy in ["h2o", "snapkv", "kvcompress", "expected_attention", "keydiff"]]


@pytest.mark.parametrize("work", [3 << 16, 40], ids=["whole-pass", "staged-pass"])
@pytest.mark.parametrize("policy, selection, attend, budget", CASES)
@pytest.mark.parametrize("device_name", DEVICES)
def test_prompt_and_decode_steps_compress(
    monkeypatch, caplog, device_name, policy, selection, attend, budget, work
) -> None:
    device = torch.device(device_name, torch.cuda.current_device()) if device_name == "cuda" else torch.device("cpu")
    monkeypatch.setenv("SGLKVC_CHECK", "1")
    monkeypatch.setattr(compressor_module.ScoreReducer, "for_sglang_tp_group", classmethod(lambda cls: None))
    monkeypatch.setattr(compressor_module, "tp_rank", lambda: 0)
    caplog.set_level(logging.WARNING)
    pool = UnitPool(device) if budget == "variable" else SlotPool(device)
    r2t = torch.zeros(8, 128, dtype=torch.int32, device=device)
    allocator = FakeAllocator(SLOTS, pool, seed=1, device=device)
    runner = SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=r2t),
                             attn_backend=SimpleNamespace(kvc_store=None, kvc_attends=True), server_args=None)
    config = KvcConfig(policy=policy, kv_budget=BUDGET, kv_buffer=BUFFER, kv_window=4, kv_selection=selection,
                       kv_decode_attention=attend, kv_head_budget=budget, kv_pass_work=work)
    comp = compressor_module.Compressor(config, runner)
    store = comp.store
    reqs = [_req(i) for i in range(len(PROMPTS))]
    for req, n in zip(reqs, PROMPTS):
        r2t[req.kv.req_pool_idx, :n] = allocator.alloc(n).to(torch.int32)
    batch = SimpleNamespace(
        reqs=reqs, seq_lens_cpu=torch.tensor(PROMPTS), seq_lens=torch.tensor(PROMPTS, device=device),
        chunked_req=None, req_to_token_pool=runner.req_to_token_pool, token_to_kv_pool_allocator=allocator,
        tree_cache=Tree(device), seq_lens_sum=None, check_decode_mem=lambda: True,
    )
    rows = torch.arange(len(reqs), device=device)

    # the prompt: its queries observed layer by layer, then the moment after prefill
    comp.begin_extend(batch)
    fb = SimpleNamespace(extend_seq_lens_cpu=list(PROMPTS), extend_prefix_lens_cpu=[0] * len(PROMPTS),
                         req_pool_indices=rows, extend_seq_lens=torch.tensor(PROMPTS, device=device),
                         positions=torch.cat([torch.arange(n, device=device) for n in PROMPTS]))
    assert comp.extend_position_offsets(batch, fb) is None
    q = torch.randn(sum(PROMPTS), H_Q * D, device=device)
    for i in range(LAYERS):
        attention._observe_extend(store, q, _layer(i), fb)
    comp.after_prefill(batch)

    for _ in range(STEPS):  # each step: a new token per request, attention, then the moment before decode
        lens = [int(n) for n in batch.seq_lens_cpu]
        for req, n in zip(reqs, lens):
            r2t[req.kv.req_pool_idx, n] = int(allocator.alloc(1)[0])
        lens = [n + 1 for n in lens]
        batch.seq_lens_cpu, batch.seq_lens = torch.tensor(lens), torch.tensor(lens, device=device)
        fb = SimpleNamespace(seq_lens_cpu=torch.tensor(lens), req_pool_indices=rows,
                             positions=torch.tensor(lens, device=device) - 1, encoder_lens=None)
        comp.begin_decode(batch, fb)
        offsets = comp.decode_position_offsets(fb.req_pool_indices)
        if offsets is not None:
            fb.positions = fb.positions + offsets
        q = torch.randn(len(reqs), H_Q * D, device=device)
        for i in range(LAYERS):
            layer = _layer(i)
            attends = attention._kernel_attends(store, q, layer, fb)
            if attends:
                out = torch.empty(len(reqs), H_Q, D, device=device)
                store.attend_decode(i, store.decode_step, q.view(-1, H_Q, D), pool.k[i], pool.v[i], layer.scaling, out)
                assert torch.isfinite(out).all()
            attention._observe_decode(store, q, layer, fb, attends)
        comp.before_decode(batch)

    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert comp.stats.failed_requests == 0 and comp.stats.passes > 0, comp.stats
    if selection == "per-head":  # per-head passes are staged when a step's work runs out
        assert (comp.stats.staged_passes > 0) == (work == 40), comp.stats
    # every request was compressed: its row is back under budget + buffer after 12 new tokens
    assert max(int(n) for n in batch.seq_lens_cpu) <= BUDGET + BUFFER, batch.seq_lens_cpu
