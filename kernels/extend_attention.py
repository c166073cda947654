"""Extend attention of one request's new tokens over its cached prefix and themselves.

SGLang's CPU backend (`torch_native`) computes an extend after a prefix by padding the queries to
the whole sequence and running causal attention over all of it (prefix rows included, then
dropped): a chunk of r tokens after p cached ones costs (p + r)^2 / 2 instead of r x (p + r / 2).
A KVzip reconstruction forward reads 2K tokens after the whole prompt, where that is most of its
cost; this computes the r rows alone, with the causal mask aligned to the end of the sequence.
On a CPU it runs PyTorch's fused kernel on the prefix (no mask) and on the new tokens (causal)
apart and merges the two by their log-sum-exps (`attention_lse.fused_cpu_halves`): a boolean mask
over the whole row made it take about 1.6 times as long (2K new tokens after 4K, 2-core CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from sgl_kvc.kernels.attention_lse import fused_cpu_halves, has_fused_cpu


def prefix_extend_attention(query: Tensor, keys: Tensor, values: Tensor, prefix: int, scale: float) -> Tensor:
    """query [r, H_q, d]: the new tokens' queries; keys [p + r, H_kv, d], values [p + r, H_kv, d_v]:
    the request's cached entries (`prefix` = p of them), then the new tokens'. Query i sees every
    cached entry and the new tokens up to itself; query head h reads KV head h // (H_q / H_kv).
    Returns [r, H_q, d_v] in the queries' dtype."""
    r, n = query.shape[0], keys.shape[0]
    if n != prefix + r:
        raise ValueError(f"{n} keys for a prefix of {prefix} and {r} new tokens")
    if has_fused_cpu(query.device) and prefix > 0 and r > 0:
        return _merged_halves(query, keys.to(query.dtype), values.to(query.dtype), prefix, scale)
    q = query.movedim(0, 1).unsqueeze(0)  # [1, H_q, r, d]
    k = keys.movedim(0, 1).unsqueeze(0).to(q.dtype)  # [1, H_kv, p + r, d]
    v = values.movedim(0, 1).unsqueeze(0).to(q.dtype)
    visible = torch.ones(r, n, dtype=torch.bool, device=query.device).tril(diagonal=prefix)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].movedim(0, 1)


def _merged_halves(query: Tensor, keys: Tensor, values: Tensor, prefix: int, scale: float) -> Tensor:
    r, h_q, d = query.shape
    h_kv = keys.shape[1]
    group = h_q // h_kv
    q = query.reshape(r, h_kv, group, d).permute(1, 2, 0, 3)  # [H_kv, G, r, d]
    k, v = keys.movedim(0, 1), values.movedim(0, 1)  # [H_kv, p + r, d]
    out, lse, own, own_lse = fused_cpu_halves(q, k[:, :prefix], v[:, :prefix], None, k[:, prefix:], v[:, prefix:],
                                              scale)
    total = torch.logaddexp(lse, own_lse)[..., None]
    merged = out.float() * (lse[..., None] - total).exp() + own.float() * (own_lse[..., None] - total).exp()
    return merged.permute(2, 0, 1, 3).reshape(r, h_q, -1).to(query.dtype)
