"""Small vectorised tensor helpers shared by the policies (float32 throughout)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def gqa_logits(queries: Tensor, keys: Tensor, scale: float) -> Tensor:
    """Scaled logits [H_kv, G, q, m] of queries [q, H_q, d] against keys [m, H_kv, d].

    Query head h belongs to KV head h // G (G = H_q / H_kv), as in KV-Compress eq. (11); no KV
    repetition is materialised.
    """
    q, h_q, d = queries.shape
    h_kv = keys.shape[1]
    qg = queries.float().reshape(q, h_kv, h_q // h_kv, d)
    return torch.einsum("qkgd,mkd->kgqm", qg, keys.float()) * scale


def causal_window_probs(queries: Tensor, keys: Tensor, scale: float) -> Tensor:
    """Softmax attention [H_kv, G, q, n] of the last q cached tokens' queries over all n keys.

    Query j sits at cache index n - q + j and sees keys 0..n - q + j (causal mask).
    """
    n = keys.shape[0]
    q = queries.shape[0]
    logits = gqa_logits(queries, keys, scale)
    key_idx = torch.arange(n, device=keys.device)
    query_idx = torch.arange(n - q, n, device=keys.device)
    future = key_idx[None, :] > query_idx[:, None]  # [q, n]
    logits = logits.masked_fill(future, -math.inf)
    return torch.softmax(logits, dim=-1)


def maxpool_tokens(x: Tensor, kernel: int) -> Tensor:
    """Centred 1-D max pooling along the last (token) axis of [H, m]; edges use what exists."""
    if kernel <= 1 or x.shape[-1] == 0:
        return x
    pooled = F.max_pool1d(x.unsqueeze(0), kernel_size=kernel, stride=1, padding=kernel // 2)
    return pooled.squeeze(0)


def group_probs(stats: Tensor | None, probs: Tensor, n_kv_heads: int) -> tuple[Tensor, Tensor]:
    """Reshape ``probs`` [H_q, q_len, n] to float32 [H_kv, G, q_len, n]; widen ``stats`` to n.

    Returns (probs_grouped, stats_float32 [H_kv, n] or zeros).
    """
    if probs.dim() != 3:
        raise ValueError(f"probs must be [H_q, q_len, n], got shape {tuple(probs.shape)}")
    h_q, q_len, n = probs.shape
    if h_q % n_kv_heads != 0:
        raise ValueError(f"H_q={h_q} is not a multiple of n_kv_heads={n_kv_heads}")
    grouped = probs.float().reshape(n_kv_heads, h_q // n_kv_heads, q_len, n)
    if stats is None:
        base = torch.zeros(n_kv_heads, n, dtype=torch.float32, device=probs.device)
    else:
        if stats.dim() != 2 or stats.shape[0] != n_kv_heads or stats.shape[1] > n:
            raise ValueError(
                f"stats must be [{n_kv_heads}, m<={n}], got shape {tuple(stats.shape)}"
            )
        base = F.pad(stats.float(), (0, n - stats.shape[1]))
    return grouped, base
