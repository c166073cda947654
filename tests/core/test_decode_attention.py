"""The batched decode attention kernel (`sgl_kvc.kernels.decode_attention`) and how the store
runs it: it must give SGLang's answer (its torch_native loop over requests is the reference) and
hand the attention it computed to the statistics policies (the comparison with SGLang's own
loop: tests/unit/test_attention_wrapper.py)."""

from __future__ import annotations

import pytest
import torch

import sgl_kvc.core.decode as decode_module
from sgl_kvc.core.request_state import Budget, ReqKvState
from sgl_kvc.core.store import KvcStore
from sgl_kvc.kernels.decode_attention import decode_attention, decode_probs
from sgl_kvc.kernels.fp8 import Fp8Rows
from decode_cases import D, GROUP, H_KV, case as _case
from sgl_kvc.policies import get_policy


def _reference(q, k, v, r2t, lens, scale):
    """Dense float64 attention, request by request (query head h reads KV head h // G), on the
    inputs' device."""
    out = []
    for b, n in enumerate(lens):
        idx = r2t[b, :n].long()
        keys = k[idx].double().repeat_interleave(GROUP, dim=1)  # [n, H_q, d]
        vals = v[idx].double().repeat_interleave(GROUP, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[b].double(), keys) * scale, dim=-1)
        out.append(torch.einsum("hn,nhd->hd", w, vals))
    return torch.stack(out)


@pytest.mark.parametrize("lens", [[5], [7, 1, 12, 3], [16, 16]])
def test_kernel_matches_dense_attention_per_request(device: torch.device, lens: list[int]) -> None:
    q, k, v, r2t, slots, pad = _case(0, lens, device=device)
    out, probs = decode_attention(q, k, v, slots, pad, 0.3)
    assert out.dtype == q.dtype and out.shape == q.shape and out.device == device
    assert torch.allclose(out.double(), _reference(q, k, v, r2t, lens, 0.3), atol=1e-5)
    assert probs.shape == (len(lens), H_KV, GROUP, max(lens)) and probs.device == device
    assert torch.allclose(probs.sum(-1), torch.ones(len(lens), H_KV, GROUP, device=device))
    assert (probs.masked_select(pad[:, None, None, :].expand_as(probs)) == 0).all()
    assert torch.equal(decode_probs(q, k, slots, pad, 0.3), probs)


def test_padding_never_reaches_the_output(device: torch.device) -> None:
    """A step's plan pads a request with its own first slot, never SGLang's dummy slot 0:
    whatever slot 0 holds must not leak (the kernel masks the softmax, not the values)."""
    lens = [3, 8]
    q, k, v, r2t, _, pad = _case(2, lens, device=device)
    k[0], v[0] = float("nan"), float("inf")
    step = decode_module.DecodeStep.build([0, 1], lens, {}, r2t, H_KV * D, attends=True)
    (block,) = step.blocks
    assert not (block.slots == 0).any()
    out = torch.full_like(q, float("nan"))
    step.attend(0, q, k, v, 0.3, out)
    assert torch.isfinite(out).all()
    assert torch.allclose(out.double(), _reference(q, k, v, r2t, lens, 0.3), atol=1e-5)


def test_stale_slots_past_a_requests_length_are_never_read(device: torch.device) -> None:
    """A `req_to_token` row holds stale slots past the request's length (a compacted row):
    the plan reads none of them."""
    lens = [3, 8]
    q, k, v, r2t, _, _ = _case(5, lens, device=device)
    stale = int(r2t[1, 7])  # another request's slot, written past request 0's length
    r2t[0, 3:8] = stale
    k[stale], v[stale] = float("nan"), float("inf")
    r2t[1, 7] = int(r2t[1, 6])  # request 1 keeps its own finite entries
    step = decode_module.DecodeStep.build([0, 1], lens, {}, r2t, H_KV * D, attends=True)
    out = torch.empty_like(q)
    step.attend(0, q, k, v, 0.3, out)
    assert torch.allclose(out.double(), _reference(q, k, v, r2t, lens, 0.3), atol=1e-5)


def test_a_non_contiguous_cache_reads_the_same(device: torch.device) -> None:
    """A cache that is a view (not one contiguous [S, H, d] block) takes the indexing path."""
    lens = [7, 1, 12]
    q, k, v, r2t, slots, pad = _case(6, lens, device=device)
    wide_k = torch.cat([k, torch.zeros_like(k)], dim=-1)[..., :D]  # same values, strided rows
    wide_v = torch.cat([v, torch.zeros_like(v)], dim=-1)[..., :D]
    assert not wide_k.is_contiguous()
    out, probs = decode_attention(q, wide_k, wide_v, slots, pad, 0.3)
    ref_out, ref_probs = decode_attention(q, k, v, slots, pad, 0.3)
    assert torch.allclose(out, ref_out, atol=1e-6) and torch.allclose(probs, ref_probs, atol=1e-6)


def test_kernel_reads_fp8_rows_dequantized(device: torch.device) -> None:
    lens = [6, 11]
    q, k, v, r2t, slots, pad = _case(3, lens, device=device)
    k8 = Fp8Rows.empty(k.shape[0], H_KV, D, dtype=torch.float32, device=device)
    v8 = Fp8Rows.empty(v.shape[0], H_KV, D, dtype=torch.float32, device=device)
    everything = torch.arange(k.shape[0], device=device)
    k8[everything] = k
    v8[everything] = v
    out, _ = decode_attention(q, k8, v8, slots, pad, 0.3)
    assert out.device == device
    expected = _reference(q, k8[everything], v8[everything], r2t, lens, 0.3)
    assert torch.allclose(out.double(), expected, atol=1e-5)


def _members(block: decode_module.DecodeBlock, size: int) -> list[int]:
    return list(range(size)) if block.index is None else block.index.tolist()


class _Pool:
    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k


@pytest.mark.parametrize("elems, fused", [
    (decode_module.DECODE_BLOCK_ELEMS, False), (1, False),  # one block; one per request
    (1, True),  # the fused plan: one block in batch order through per-head tables, whatever the bound
])
def test_store_attends_the_whole_batch_and_feeds_the_statistics(device: torch.device, monkeypatch, elems: int,
                                                                fused: bool) -> None:
    """With `attends`, the step's plan holds every request (longest first, in blocks); the
    output lands at each request's batch index, and statistics equal those computed beside
    another kernel (`DecodeStep.accumulate`), over two steps (the second adds to the first)."""
    monkeypatch.setattr(decode_module, "DECODE_BLOCK_ELEMS", elems)
    lens = [7, 1, 12, 3]
    q, k, v, r2t, _, _ = _case(4, lens, device=device)
    rows = list(range(len(lens)))
    policies = {0: "h2o", 1: "rkv", 2: "kvcompress", 3: "h2o"}  # request 1 keeps no statistic
    attending = KvcStore(1, 4, r2t, _Pool(k, v))
    beside = KvcStore(1, 4, r2t, _Pool(k, v))
    attending.attends = True
    attending.fused = beside.fused = fused
    for store in (attending, beside):
        for row, name in policies.items():
            store.begin(row, ReqKvState(policy=get_policy(name), budget=Budget(8), device=device))
        store.begin_decode(rows, lens)
    assert attending.decode_step.attends and attending.decode_step.size == 4
    assert sorted(i for b in attending.decode_step.blocks for i in _members(b, len(rows))) == rows
    assert not beside.decode_step.attends
    assert sorted(i for b in beside.decode_step.blocks for i in _members(b, len(rows))) == [0, 2, 3]

    if fused:
        (block,) = attending.decode_step.blocks
        assert block.index is None and block.row_tables is not None
    out = torch.full_like(q, float("nan"))
    attending.attend_decode(0, attending.decode_step, q, k, v, 0.3, out)
    beside.decode_step.accumulate(0, q, k, 0.3)
    assert torch.allclose(out.double(), _reference(q, k, v, r2t, lens, 0.3), atol=1e-5)
    assert attending.attended_layers == 1
    first = {row: attending.states[row].stats[0] for row in policies}
    first = {row: None if t is None else t.clone() for row, t in first.items()}
    for row, name in policies.items():
        a, b = attending.states[row].stats[0], beside.states[row].stats[0]
        if name == "rkv":
            assert a is None and b is None
        else:
            assert a.shape == (H_KV, lens[row]) and a.device == device, name
            assert torch.allclose(a, b, atol=1e-6), name
    # a second step, one entry longer: each statistic is its first step's plus this one's
    grown = [n + 1 for n in lens]
    for store in (attending, beside):
        store.begin_decode(rows, grown)
    q2 = q.flip(0)
    attending.attend_decode(0, attending.decode_step, q2, k, v, 0.3, out)
    beside.decode_step.accumulate(0, q2, k, 0.3)
    assert torch.allclose(out.double(), _reference(q2, k, v, r2t, grown, 0.3), atol=1e-5)
    alone = KvcStore(1, 4, r2t, _Pool(k, v))
    for row, name in policies.items():
        alone.begin(row, ReqKvState(policy=get_policy(name), budget=Budget(8), device=device))
    alone.begin_decode(rows, grown)
    alone.decode_step.accumulate(0, q2, k, 0.3)
    for row, name in policies.items():
        if name == "rkv":
            continue
        a, b = attending.states[row].stats[0], beside.states[row].stats[0]
        want = alone.states[row].stats[0].clone()
        want[:, : lens[row]] += first[row]
        assert a.shape == (H_KV, grown[row]) and torch.allclose(a, want, atol=1e-6), name
        assert torch.allclose(b, want, atol=1e-6), name
