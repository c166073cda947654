"""Extend attention of one request's new tokens over its cached prefix and themselves.

SGLang's CPU backend (`torch_native`) computes an extend after a prefix by padding the queries to
the whole sequence and running causal attention over all of it (prefix rows included, then
dropped): a chunk of r tokens after p cached ones costs (p + r)^2 / 2 instead of r x (p + r / 2).
A KVzip reconstruction forward reads 2K tokens after the whole prompt, where that is most of its
cost; this computes the r rows alone, with the causal mask aligned to the end of the sequence.
On a CPU it runs PyTorch's fused kernel on the prefix (no mask) and on the new tokens (causal)
apart and merges the two by their log-sum-exps (`attention_lse.fused_cpu_halves`): a boolean mask
over the whole row made it take about 1.6 times as long (2K new tokens after 4K, 2-core CPU).

KVzip's score needs, for each reconstruction query, the log-sum-exp of its logits over part of the
cache (the entries the chunk scores) and its own keys. `scored_extend_attention` splits the
prefix there, so the forward's own kernel calls return it: three calls of about the cost of two,
instead of a second attention pass over the scored entries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from sgl_kvc.kernels.attention_lse import fused_cpu_cached, fused_cpu_causal, has_fused_cpu


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


def scored_extend_attention(query: Tensor, keys: Tensor, values: Tensor, prefix: int, scale: float,
                            scored: Tensor) -> tuple[Tensor, Tensor]:
    """`prefix_extend_attention`, and each query's log-sum-exp of its logits over the cached entries
    `scored` (int64 column indices into the prefix, the same for every KV head, at least one) and
    the new tokens up to itself: float32 [H_kv, G, r] (G = H_q / H_kv). Needs `has_fused_cpu()`."""
    r, n = query.shape[0], keys.shape[0]
    if n != prefix + r or r == 0:
        raise ValueError(f"{n} keys for a prefix of {prefix} and {r} new tokens")
    q, k, v = _by_kv_head(query, keys.to(query.dtype), values.to(query.dtype))
    others = torch.ones(prefix, dtype=torch.bool, device=keys.device).index_fill_(0, scored, False)
    others = others.nonzero()[:, 0]
    parts = [fused_cpu_cached(q, k[:, scored], v[:, scored], None, scale),
             fused_cpu_causal(q, k[:, prefix:], v[:, prefix:], scale)]
    lse = torch.logaddexp(parts[0][1], parts[1][1])
    if others.numel():
        parts.append(fused_cpu_cached(q, k[:, others], v[:, others], None, scale))
    return _merged(parts, query), lse


def _by_kv_head(query: Tensor, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """query [r, H_q, d] as [H_kv, G, r, d]; keys and values [n, H_kv, d] as [H_kv, n, d]."""
    r, h_q, d = query.shape
    h_kv = keys.shape[1]
    return query.reshape(r, h_kv, h_q // h_kv, d).permute(1, 2, 0, 3), keys.movedim(0, 1), values.movedim(0, 1)


def _merged(parts: list[tuple[Tensor, Tensor]], query: Tensor) -> Tensor:
    """The attention of a softmax computed in parts, each (output [H_kv, G, r, d_v], log-sum-exp
    [H_kv, G, r]), as [r, H_q, d_v] in the queries' dtype."""
    total = parts[0][1]
    for _, lse in parts[1:]:
        total = torch.logaddexp(total, lse)
    merged = sum(out.float() * (lse - total)[..., None].exp() for out, lse in parts)
    r, h_q, _ = query.shape
    return merged.permute(2, 0, 1, 3).reshape(r, h_q, -1).to(query.dtype)


def _merged_halves(query: Tensor, keys: Tensor, values: Tensor, prefix: int, scale: float) -> Tensor:
    q, k, v = _by_kv_head(query, keys, values)
    return _merged([fused_cpu_cached(q, k[:, :prefix], v[:, :prefix], None, scale),
                    fused_cpu_causal(q, k[:, prefix:], v[:, prefix:], scale)], query)
