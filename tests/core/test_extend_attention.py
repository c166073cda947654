"""Extend attention of new tokens over a cached prefix (`kernels/extend_attention.py`) against a
float64 loop: query i sees the prefix and the new tokens up to itself."""

from __future__ import annotations

import pytest
import torch

from sgl_kvc.kernels.extend_attention import prefix_extend_attention


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
