"""Batched decode attention over SGLang's slot layout (installed as `sgl_kvc.kernels.decode_attention`).

Layout: one slot list per request (a `req_to_token` row, page size 1); slot s holds the entries
(key and value) of every KV head of one token, K [S, H_kv, d] and V [S, H_kv, d_v]. After a
uniform per-head compaction, entry j of each head may be a different token, but all heads keep
the same count, so one slot list still describes every head (the variable-length per-head form is
`per_head_attention.per_head_decode`).

Why a kernel of our own: SGLang's CPU backend (`torch_native`) runs decode attention with a Python
loop over the batch's requests, about ten small operations each per layer. Here the batch is padded
to its longest request and masked, one computation per block of requests (blocks bound the
padded float32 keys and values), and the softmax attention it computes is returned too, so the
policies that accumulate attention (H2O, Batch-Max, KV-Compress) read it instead of computing it
a second time. Softmax and the weighted sum run in float32; the output has the queries' dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


def decode_probs(q: Tensor, k_cache: Any, slots: Tensor, pad: Tensor, scale: float) -> Tensor:
    """Softmax attention [b, H_kv, G, n] (float32, 0 at padding) of one query per request.

    q: [b, H_q, d]; k_cache: [S, H_kv, d], or anything whose `k_cache[slots]` returns
    [b, n, H_kv, d] (the FP8 pool's rows dequantize on read); slots: int64 [b, n], slot of each
    request's entry j; pad: bool [b, n], True past a request's length (its slot is not read
    for attention, only gathered). Query head h reads KV head h // G (G = H_q / H_kv).
    """
    b, h_q, d = q.shape
    keys = k_cache[slots].float()  # [b, n, H_kv, d]
    h_kv = keys.shape[2]
    qg = q.float().reshape(b, h_kv, h_q // h_kv, d)
    logits = torch.matmul(qg, keys.permute(0, 2, 3, 1))  # [b, H_kv, G, n]
    logits.mul_(scale).masked_fill_(pad[:, None, None, :], -math.inf)
    return torch.softmax(logits, dim=-1)


def decode_attention(
    q: Tensor, k_cache: Any, v_cache: Any, slots: Tensor, pad: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """Decode attention of one query per request over its own entries: output [b, H_q, d_v] in
    q's dtype, and the float32 attention [b, H_kv, G, n] it used (see `decode_probs`)."""
    b, h_q, _ = q.shape
    probs = decode_probs(q, k_cache, slots, pad, scale)
    values = v_cache[slots].float()  # [b, n, H_kv, d_v]
    values.masked_fill_(pad[:, :, None, None], 0.0)  # weight 0 must not meet a stale inf/NaN
    values = values.transpose(1, 2)  # [b, H_kv, n, d_v]
    out = torch.matmul(probs, values)  # [b, H_kv, G, d_v]
    return out.reshape(b, h_q, -1).to(q.dtype), probs
