"""The log-sum-exp of attention rows: each query's softmax normalizer, without its probabilities.

KVzip's score (`sgl_kvc/core/reconstruction.py`) needs, for every reconstruction query, the
log-sum-exp of its logits over the keys of its softmax; the probabilities themselves then come
from one matrix product of the queries, widened by that normalizer, with the keys (eq. 2 of KVzip:
p = exp(q.k - lse)). Computed from a materialized logits tensor, the normalizer costs several
passes over it (a max, a subtraction, an exponential, a sum), which compete for memory bandwidth
with whatever else the CPU runs. PyTorch's fused CPU attention kernel returns it from tiles that
stay in the cache; elsewhere, a blocked torch version with the same result.

Both halves of a reconstruction query's softmax are computed apart and added in log space: the
cached keys, which every query sees (some columns masked per KV head), and the reconstruction's
own keys, which query i sees up to i (causal, square).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def attention_lse(queries: Tensor, keys: Tensor, valid: Tensor, own_keys: Tensor, scale: float,
                  block_elements: int) -> Tensor:
    """queries [H_kv, G, r, d] (each KV head's group of query heads), keys [H_kv, M, d] with `valid`
    [H_kv, M], own_keys [H_kv, r, d]: float32 [H_kv, G, r], each query's log-sum-exp of
    `scale * q.k` over its head's valid keys and its own keys up to itself. Transient memory
    within about `block_elements` float32 values beyond the inputs (fused: the kernel's tiles)."""
    if has_fused_cpu(queries.device):
        return _fused_cpu(queries, keys, valid, own_keys, scale)
    return blocked_lse(queries, keys, valid, own_keys, scale, block_elements)


def blocked_lse(queries: Tensor, keys: Tensor, valid: Tensor, own_keys: Tensor, scale: float,
                block_elements: int) -> Tensor:
    """`attention_lse` in plain torch, queries taken in blocks of at most `block_elements` logits."""
    h_kv, group, r, d = queries.shape
    m = keys.shape[1]
    q = (queries.float() * scale).reshape(h_kv, group * r, d)
    kt, okt = keys.float().transpose(1, 2), own_keys.float().transpose(1, 2)
    invalid = None if bool(valid.all()) else ~valid[:, None, :]
    cols = torch.arange(r, device=queries.device)
    rows = torch.arange(group * r, device=queries.device) % r  # each row's query index
    out = torch.empty(h_kv, group * r, dtype=torch.float32, device=queries.device)
    block = max(1, block_elements // max(1, h_kv * (m + r)))
    for b0 in range(0, group * r, block):
        qb = q[:, b0 : b0 + block]
        cached = torch.bmm(qb, kt)
        if invalid is not None:
            cached.masked_fill_(invalid, -math.inf)
        own = torch.bmm(qb, okt)
        own.masked_fill_(cols[None, :] > rows[b0 : b0 + block, None], -math.inf)
        out[:, b0 : b0 + block] = torch.logaddexp(torch.logsumexp(cached, -1), torch.logsumexp(own, -1))
    return out.reshape(h_kv, group, r)


def _fused_cpu(queries: Tensor, keys: Tensor, valid: Tensor, own_keys: Tensor, scale: float) -> Tensor:
    mask = None if bool(valid.all()) else valid
    # the outputs are not needed: the values are the keys (no copy)
    k, own_k = keys.float(), own_keys.float()
    _, cached, _, own = fused_cpu_halves(queries.float(), k, k, mask, own_k, own_k, scale)
    return torch.logaddexp(cached, own)


def fused_cpu_halves(queries: Tensor, keys: Tensor, values: Tensor, valid: Tensor | None, own_keys: Tensor,
                     own_values: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """PyTorch's fused CPU attention over the two halves of a softmax, apart: queries [H_kv, G, r, d]
    over keys/values [H_kv, M, d] (`fused_cpu_cached`), and over own_keys/own_values [H_kv, r, d]
    (`fused_cpu_causal`). Returns (output [H_kv, G, r, d_v], log-sum-exp [H_kv, G, r] in float32)
    of each half. Needs `has_fused_cpu()`."""
    out, lse = fused_cpu_cached(queries, keys, values, valid, scale)
    own_out, own_lse = fused_cpu_causal(queries, own_keys, own_values, scale)
    return out, lse, own_out, own_lse


def fused_cpu_cached(queries: Tensor, keys: Tensor, values: Tensor, valid: Tensor | None,
                     scale: float) -> tuple[Tensor, Tensor]:
    """Queries [H_kv, G, r, d] over cached keys/values [H_kv, M, d], every column visible but where
    `valid` [H_kv, M] is False: (output [H_kv, G, r, d_v], log-sum-exp [H_kv, G, r] in float32); a
    head with no valid key has an output of 0 and a log-sum-exp of -inf."""
    h_kv, group, r, d = queries.shape
    q = queries.contiguous()
    # A KV head's query group read as one sequence of G x r queries (no mask is per query, so the
    # keys need no copy per query head).
    mask = None
    if valid is not None:
        mask = torch.zeros(valid.shape, dtype=q.dtype, device=q.device).masked_fill_(~valid, -math.inf)
        mask = mask[None, :, None, :]
    out, lse = _FUSED_CPU(q.reshape(1, h_kv, group * r, d), keys[None].contiguous(), values[None].contiguous(),
                          0.0, False, attn_mask=mask, scale=scale)[:2]
    out, lse = out.reshape(h_kv, group, r, -1), lse.reshape(h_kv, group, r)
    if valid is not None:  # a masked-out row's NaN is nothing
        empty = ~valid.any(-1)[:, None, None]
        out, lse = out.masked_fill(empty[..., None], 0.0), lse.masked_fill(empty, -math.inf)
    return out, lse


def fused_cpu_causal(queries: Tensor, own_keys: Tensor, own_values: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Queries [H_kv, G, r, d] over their own keys/values [H_kv, r, d], query i seeing its first
    i + 1: (output [H_kv, G, r, d_v], log-sum-exp [H_kv, G, r] in float32)."""
    group = queries.shape[1]
    # Causal and square: one batch entry per query head of the group.
    own_k = own_keys[None].expand(group, *own_keys.shape).contiguous()
    own_v = own_values[None].expand(group, *own_values.shape).contiguous()
    out, lse = _FUSED_CPU(queries.transpose(0, 1).contiguous(), own_k, own_v, 0.0, True, scale=scale)[:2]
    return out.transpose(0, 1), lse.transpose(0, 1)


def has_fused_cpu(device: torch.device) -> bool:
    """Whether `fused_cpu_halves` runs for tensors on `device`."""
    return device.type == "cpu" and _FUSED_CPU is not None


# PyTorch's flash attention for CPU, which returns the log-sum-exp beside the output (a private
# operator: where a build lacks it, the blocked version runs).
_FUSED_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
