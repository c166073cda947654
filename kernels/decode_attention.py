"""Batched decode attention over SGLang's slot layout.

Layout: one slot list per request (a `req_to_token` row, page size 1); slot s holds the entries
(key and value) of every KV head of one token, K [S, H_kv, d] and V [S, H_kv, d_v]. After a
uniform per-head compaction, entry j of each head may be a different token, but all heads keep
the same count, so one slot list still describes every head (the variable-length per-head form is
`per_head_attention.per_head_decode`).

Why a kernel of our own: SGLang's CPU backend (`torch_native`) runs decode attention with a Python
loop over the batch's requests, about ten small operations each per layer. Here the batch is padded
to its longest request and masked, one computation per block of requests (blocks bound the
padded float32 keys and values). Softmax and the weighted sum run in float32; the output has the
queries' dtype.

What it costs on a CPU is memory traffic, not arithmetic (one query per request and head group):
the keys and values are gathered once, straight into the [b, H_kv, n, d] layout the products
read (no transposed copy), and read once more by the two products (faster than indexing
[b, n, H, d] and transposing, or a fused `scaled_dot_product_attention`: docs/benchmarks.md,
"CPU decode"). The softmax attention is returned too: H2O,
Batch-Max and KV-Compress add it to their statistics and pay no second q.K.

Requests that hold nothing compressed are what plain SGLang would serve, and are read as it
reads them (`plain_decode`): one `scaled_dot_product_attention` call per request in the model's
dtype, over keys and values gathered once for the block. In bfloat16 PyTorch's CPU flash kernel
rounds the softmax weights to bfloat16 before their product with the values, and sums in an
order of oneDNN's; the float32 kernel below is more exact but a different rounding, one bfloat16
step in a few outputs of every layer, which through 30 layers of SmolLM2 moved decode
log-probabilities up to 0.25 nats from plain SGLang's with nothing evicted. In float32 the two
agree to float32 rounding (4e-6 over 48 SmolLM2 tokens), so the batched kernel serves there.

Padding: entry j >= a request's length is masked out of the softmax, and its slot must hold
finite values (`DecodeStep.build` points it at the request's own first entry): a weight of 0
times a stale inf or NaN would still be NaN, and masking the values instead costs a pass over
them in every layer.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.nn.functional import scaled_dot_product_attention


def row_view(cache: Any) -> tuple[Tensor, int, int] | None:
    """A cache [S, H, d] whose (slot, head) rows are each d contiguous elements, read as one
    [rows, d] tensor over its storage: (that tensor, the row of (slot 0, head 0), rows per slot).
    Contiguous (SGLang's own pool): rows s x H + h. A layer of the unit pool (a strided view of its
    [S, L, H, d] allocation, `adapter/memory/unit_pool.py`): rows (s x L + l) x H + h. None for
    anything else (the FP8 pool's rows dequantize on read)."""
    if not isinstance(cache, Tensor) or cache.dim() != 3:
        return None
    _, h, d = cache.shape
    if cache.stride(2) != 1 or cache.stride(1) != d or cache.stride(0) % d or cache.storage_offset() % d:
        return None
    rows = cache.untyped_storage().nbytes() // cache.element_size() // d
    flat = torch.as_strided(cache, (rows, d), (d, 1), 0)
    return flat, cache.storage_offset() // d, cache.stride(0) // d


def gather_heads(cache: Any, slots: Tensor) -> Tensor:
    """Rows of `slots` [b, n] as float32 [b, H, n, d], read from a cache [S, H, d].

    A cache whose (slot, head) rows are contiguous (`row_view`: SGLang's pool, a layer of the unit
    pool) is read with one `index_select` over those rows, which lands in [b, H, n, d] directly
    (indexing a strided layer view and transposing costs about 12x as much); anything else (the FP8
    pool's rows, which dequantize on read) through `cache[slots]` and a transpose."""
    b, n = slots.shape
    view = row_view(cache)
    if view is not None:
        flat, first, per_slot = view
        h, d = cache.shape[1], cache.shape[2]
        heads = torch.arange(h, device=cache.device)
        rows = (first + slots.to(cache.device)[:, None, :] * per_slot + heads[None, :, None]).reshape(-1)  # [b * H * n]
        return flat.index_select(0, rows).view(b, h, n, d).float()
    return cache[slots].float().transpose(1, 2).contiguous()


def gather_slots(cache: Any, slots: Tensor) -> Tensor:
    """`cache[slots]`: [b, n, H, d] in the cache's dtype (a `row_view` read by one `index_select`)."""
    view = row_view(cache)
    if view is None:
        return cache[slots]
    flat, first, per_slot = view
    b, n = slots.shape
    h, d = cache.shape[1], cache.shape[2]
    heads = torch.arange(h, device=cache.device)
    rows = (first + slots.to(cache.device)[:, :, None] * per_slot + heads[None, None, :]).reshape(-1)
    return flat.index_select(0, rows).view(b, n, h, d)


def _logits(q: Tensor, keys: Tensor, pad: Tensor, scale: float) -> Tensor:
    """Masked float32 logits [b, H_kv, G, n] of q [b, H_q, d] against keys [b, H_kv, n, d]."""
    b, h_q, d = q.shape
    h_kv = keys.shape[1]
    qg = q.float().reshape(b, h_kv, h_q // h_kv, d)
    logits = torch.matmul(qg, keys.transpose(-1, -2))  # [b, H_kv, G, n]
    return logits.mul_(scale).masked_fill_(pad[:, None, None, :], -math.inf)


def decode_probs(q: Tensor, k_cache: Any, slots: Tensor, pad: Tensor, scale: float) -> Tensor:
    """Softmax attention [b, H_kv, G, n] (float32, 0 at padding) of one query per request.

    q: [b, H_q, d]; k_cache: [S, H_kv, d], or anything whose `k_cache[slots]` returns
    [b, n, H_kv, d] (the FP8 pool's rows dequantize on read); slots: int64 [b, n], slot of each
    request's entry j; pad: bool [b, n], True past a request's length (its slot must hold finite
    values; see the module's note). Query head h reads KV head h // G (G = H_q / H_kv).
    """
    return torch.softmax(_logits(q, gather_heads(k_cache, slots), pad, scale), dim=-1)


def decode_attention(
    q: Tensor, k_cache: Any, v_cache: Any, slots: Tensor, pad: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """Decode attention of one query per request over its own entries: output [b, H_q, d_v] in
    q's dtype, and the float32 attention [b, H_kv, G, n] it used (see `decode_probs`)."""
    b, h_q, _ = q.shape
    keys = gather_heads(k_cache, slots)  # [b, H_kv, n, d]
    values = gather_heads(v_cache, slots)  # [b, H_kv, n, d_v]
    probs = torch.softmax(_logits(q, keys, pad, scale), dim=-1)
    out = torch.matmul(probs, values)  # [b, H_kv, G, d_v]
    return out.reshape(b, h_q, -1).to(q.dtype), probs


def rounds_like_sdpa(dtype: torch.dtype) -> bool:
    """Whether a model of `dtype` needs `plain_decode` to answer as plain SGLang does: PyTorch's
    CPU SDPA rounds the softmax weights of reduced floating types, not of float32."""
    return dtype in (torch.bfloat16, torch.float16)


def plain_decode(
    q: Tensor, k_cache: Any, v_cache: Any, slots: Tensor, lens: list[int] | tuple[int, ...], scale: float,
    pad: Tensor | None = None, probs_rows: Tensor | None = None, want_probs: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Decode attention as plain SGLang's CPU backend computes it (`torch_native`,
    `_run_sdpa_forward_decode`): for each request, one `scaled_dot_product_attention` of its
    query [1, H_q, 1, d] over its first `lens[i]` entries [1, H_kv, n, d], in the query's dtype,
    the same call on the same values, so bit for bit the same output. The keys and values of the
    block are gathered once (`gather_slots`: [b, n, H_kv, d]; an FP8 pool dequantizes there).

    Returns the output [b, H_q, d_v] in q's dtype and, with `want_probs`, the float32 attention
    [k, H_kv, G, n] of the statistics rows (`probs_rows`, else every row; `pad` masks them),
    computed from the same keys, for the policies that keep statistics."""
    b, h_q, _ = q.shape
    keys, values = gather_slots(k_cache, slots), gather_slots(v_cache, slots)
    if keys.dtype != q.dtype:  # as SGLang: SDPA takes one dtype
        keys, values = keys.to(q.dtype), values.to(q.dtype)
    gqa = h_q != keys.shape[2]
    out = q.new_empty((b, h_q, values.shape[-1]))
    for i, n in enumerate(lens):
        out[i] = scaled_dot_product_attention(
            q[i, :, None, :].unsqueeze(0), keys[i, :n].movedim(0, 1).unsqueeze(0),
            values[i, :n].movedim(0, 1).unsqueeze(0), scale=scale, enable_gqa=gqa,
        )[0, :, 0]
    if not want_probs:
        return out, None
    rows = slice(None) if probs_rows is None else probs_rows
    stat_keys = keys[rows].float().transpose(1, 2)  # [k, H_kv, n, d]
    return out, torch.softmax(_logits(q[rows], stat_keys, pad[rows], scale), dim=-1)
