"""Extend attention of new tokens over a cached prefix (`kernels/extend_attention.py`) against a
float64 loop: query i sees the prefix and the new tokens up to itself."""

from __future__ import annotations

import pytest
import torch

from sgl_kvc.kernels.attention_lse import has_fused_cpu
from sgl_kvc.kernels.extend_attention import prefix_extend_attention, scored_extend_attention


def _reference(q, k, v, prefix, scale, offset=0):
    r, h_q, _ = q.shape
    group = h_q // k.shape[1]
    out = torch.zeros(r, h_q, v.shape[-1], dtype=torch.float64)
    for i in range(r):
        seen = prefix + i + 1 + offset
        for h in range(h_q):
            w = (k[:seen, h // group].double() @ q[i, h].double() * scale).softmax(0)
            out[i, h] = w @ v[:seen, h // group].double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_new_tokens_see_the_prefix_and_themselves_up_to_each(device: torch.device, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    p, r, h_q, h_kv, d = 40, 9, 6, 2, 16
    q, k, v = (torch.randn(*shape, generator=gen).to(device, dtype)
               for shape in ((r, h_q, d), (p + r, h_kv, d), (p + r, h_kv, d)))
    out = prefix_extend_attention(q, k, v, p, 0.25)
    assert out.shape == (r, h_q, d) and out.dtype == dtype and out.device == device
    ref = _reference(q.cpu(), k.cpu(), v.cpu(), p, 0.25)
    # one rounding of outputs of size ~1, a few of the softmax, and, where the prefix and the new
    # tokens are attended apart (the fused CPU kernel), a few more where their halves are merged
    tol = 8 * torch.finfo(dtype).eps
    err = (out.cpu().double() - ref).abs().max().item()
    assert err < tol, err
    # the test can fail: a mask aligned to the start of the sequence (every new token seeing one
    # more token than the one before, from the first) is far off
    wrong = _reference(q.cpu(), k.cpu(), v.cpu(), 0, 0.25)
    assert (out.cpu().double() - wrong).abs().max().item() > 10 * tol
    with pytest.raises(ValueError):
        prefix_extend_attention(q, k[:-1], v[:-1], p, 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scored_columns_give_their_softmax_normalizer(device: torch.device, dtype: torch.dtype) -> None:
    """`scored_extend_attention`: the same attention, and each query's log-sum-exp over the scored
    columns of the prefix and its own keys up to itself (KVzip's score softmax), in float64."""
    if not has_fused_cpu(device):
        pytest.skip("the split attention is the fused CPU kernel's (elsewhere the score computes its own)")
    gen = torch.Generator().manual_seed(3)
    p, r, h_q, h_kv, d = 50, 11, 6, 2, 16
    q, k, v = (torch.randn(*shape, generator=gen).to(device, dtype)
               for shape in ((r, h_q, d), (p + r, h_kv, d), (p + r, h_kv, d)))
    scored = torch.tensor([0, 1, 2, 3, *range(20, 35)])
    out, lse = scored_extend_attention(q, k, v, p, 0.25, scored)
    ref = _reference(q.cpu(), k.cpu(), v.cpu(), p, 0.25)
    tol = 8 * torch.finfo(dtype).eps
    assert out.dtype == dtype and (out.double() - ref).abs().max().item() < tol
    group = h_q // h_kv
    want = torch.empty(h_kv, group, r, dtype=torch.float64)
    for i in range(r):
        cols = torch.cat([scored, torch.arange(p, p + i + 1)])
        for h in range(h_q):
            logits = k[cols, h // group].double() @ q[i, h].double() * 0.25
            want[h // group, h % group, i] = logits.logsumexp(0)
    assert lse.shape == (h_kv, group, r) and lse.dtype == torch.float32
    # float32: a few roundings of logits of size ~1. bfloat16: the kernel's exponential for
    # reduced-precision inputs is an approximation (6e-5 off in log space, this machine and AVX2),
    # kept within 1/32 of the inputs' own rounding
    tol = 32 * torch.finfo(torch.float32).eps if dtype == torch.float32 else torch.finfo(dtype).eps / 32
    err = (lse.double() - want).abs().max().item()
    assert err < tol, err
    # the test can fail: the normalizer over the whole prefix (the forward's own) is far off
    _, whole = scored_extend_attention(q, k, v, p, 0.25, torch.arange(p))
    assert (whole.double() - want).abs().max().item() > 0.1
