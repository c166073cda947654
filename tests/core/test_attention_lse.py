"""Each reconstruction query's softmax normalizer (`kernels/attention_lse.py`): the fused CPU kernel
and the blocked torch version against a float64 log-sum-exp, with masked keys, a KV head with no
valid key, and blocks of any size."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_kvc.kernels import attention_lse as lse_mod

# A log-sum-exp of float32 logits of size ~10: a few roundings of relative size eps32 on values of
# that size (the float64 reference is exact to that scale).
TOL = 64 * torch.finfo(torch.float32).eps * 10


def _case(device: torch.device, h_kv: int = 2, group: int = 3, r: int = 13, m: int = 29, d: int = 16):
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(h_kv, group, r, d, generator=gen).to(device)
    keys = (torch.randn(h_kv, m, d, generator=gen) * 1.5).to(device)
    own = torch.randn(h_kv, r, d, generator=gen).to(device)
    valid = torch.ones(h_kv, m, dtype=torch.bool, device=device)
    valid[0, 3:9] = False
    return q, keys, valid, own


def _reference(q, keys, valid, own, scale):
    h_kv, group, r, _ = q.shape
    cached = torch.einsum("hgrd,hmd->hgrm", q.double(), keys.double()) * scale
    cached = cached.masked_fill(~valid[:, None, None, :].cpu(), -math.inf)
    mine = torch.einsum("hgrd,hjd->hgrj", q.double(), own.double()) * scale
    mine = mine.masked_fill(torch.ones(r, r, dtype=torch.bool).triu(1), -math.inf)
    return torch.logsumexp(torch.cat([cached, mine], dim=-1), dim=-1)


@pytest.mark.parametrize("empty_head", [False, True])
def test_both_versions_match_the_float64_log_sum_exp(device: torch.device, empty_head: bool) -> None:
    q, keys, valid, own = _case(device)
    if empty_head:
        valid[1] = False  # its queries' softmax holds their own keys alone
    scale = 0.3
    ref = _reference(q.cpu(), keys.cpu(), valid.cpu(), own.cpu(), scale)
    for name, got in (("dispatched", lse_mod.attention_lse(q, keys, valid, own, scale, 1 << 20)),
                      ("blocked", lse_mod.blocked_lse(q, keys, valid, own, scale, 1 << 20)),
                      ("blocked, one row a block", lse_mod.blocked_lse(q, keys, valid, own, scale, 1))):
        assert got.device == device and got.dtype == torch.float32
        err = (got.cpu().double() - ref).abs().max().item()
        assert err <= TOL, (name, err)
    # a wrong mask (the masked keys counted) is far off: the test can fail
    wrong = lse_mod.blocked_lse(q, keys, torch.ones_like(valid), own, scale, 1 << 20)
    assert (wrong.cpu().double() - ref).abs().max().item() > 1000 * TOL


def test_the_fused_kernel_runs_on_this_cpu() -> None:
    """The CPU build of PyTorch has the fused kernel the dispatch takes (else the blocked version
    runs, and a reconstruction forward attends with a mask over whole rows)."""
    assert lse_mod._FUSED_CPU is not None
