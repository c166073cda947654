"""Attention over head-flattened KV tables.

Layout (KV-Compress §4.2.1, eq. 12, with page size 1): ONE flat pool of units, each unit holding
the key (and, in a second pool, the value) of one token for one layer and ONE KV head: K [U, d],
V [U, d_v] (the unit pool, `adapter/memory/unit_pool.py`). A request is B x H_kv independent sequences,
one per (request, KV head), each with its own table of units and length (:class:`HeadTables`).
After a variable compaction each head keeps its own tokens, so lengths differ between heads.

Attention then treats every (request, KV head) as a sequence with ONE KV head and G = H_q / H_kv
query heads (its GQA group: query head h reads KV head h // G, KV-Compress eq. 11). RoPE is applied
before keys are written, so a kept key carries its logical position; the causal mask of an extend
compares LOGICAL positions (:attr:`HeadTables.positions`), never slot or table indices.

This module is the batched torch implementation (CPU, and a CUDA fallback): requests and heads are
padded to the longest table and masked, with no Python loop over requests (only over blocks of
query rows of a long extend, to bound memory). Softmax runs in float32; outputs have the queries'
dtype; a sequence with no visible key yields zeros. An extend whose probabilities nothing reads
runs PyTorch's fused attention (`scaled_dot_product_attention`, with the same mask) instead of
this module's softmax.

On CUDA, decode runs the Triton kernel of `triton_per_head.py` (`fast_per_head_decode` picks it;
same results, one program per (request, KV head, split), FP8 dequantized as it loads). FlashInfer
is the other way a CUDA path could plug in (not implemented here): its paged kernels already take
ragged sequences, so the flattened tables drive them directly. Decode:
``BatchDecodeWithPagedKVCacheWrapper.plan(indptr, indices, last_page_len=ones, num_qo_heads=G,
num_kv_heads=1, head_dim=d, page_size=1)`` with ``indptr`` the cumulated lengths of the
B x H_kv sequences and ``indices`` their units, queries viewed as [B x H_kv, G, d] (a free
reshape of [B, H_q, d]), and the pool viewed as pages of one token and one head ([S, 1, 1, d],
NHD). Extend: ``BatchPrefillWithPagedKVCacheWrapper`` with the same KV tables, ``qo_indptr``
repeating each request's query block once per KV head, and ``causal=True``: FlashInfer aligns the
last query with the last key, which equals causality by logical position as long as every head's
table ends with the extend's new tokens (they are appended to every head, and evicted tokens are
always older), which the integration guarantees. FP8 pools need a dequantizing kernel (scales
per (token, head) are per unit here) or the torch path.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from sgl_kvc.kernels.per_head_tables import SPLIT_COLUMNS, DecodeLogits, HeadTables, LogitRows, SplitPlan

Q_BLOCK = 256  # query rows per block in `per_head_extend` (bounds the [.., q, N] logits)


def _gather(pool: Any, units: Tensor, valid: Tensor) -> Tensor:
    """pool rows at units [B, H, N] -> float32 [B, H, N, dim] (padding reads unit 0).

    ``pool`` is a [S, dim] tensor, or anything whose ``pool[idx]`` returns [len(idx), dim] or
    [len(idx), 1, dim] (e.g. an FP8 ``Fp8Rows`` with one head per slot, dequantizing on read).
    """
    safe = torch.where(valid, units, 0).reshape(-1)
    rows = pool[safe.to(pool.device)]
    return rows.reshape(*units.shape, -1).to(device=units.device, dtype=torch.float32)


def _masked_attention(logits: Tensor, visible: Tensor, values: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax over the last axis of ``logits`` where ``visible``, then weights @ values.

    Rows with no visible key get zero weights (no NaN). Returns (output, probabilities, the
    masked logits), the logits -inf where not visible."""
    logits = logits.masked_fill(~visible, -math.inf)
    row_max = logits.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    weights = torch.exp(logits - row_max)  # exp(-inf) = 0 at masked keys
    denom = weights.sum(dim=-1, keepdim=True)
    probs = weights / denom.clamp_min(torch.finfo(torch.float32).tiny)
    return torch.matmul(probs, values), probs, logits


def _attend_in_place(logits: Tensor, invisible: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
    """`_masked_attention` with `logits` overwritten by the probabilities, step for step the same
    arithmetic (the same values, bit for bit) without its temporaries: an extend's logits are
    [.., q, N] for a block of q query rows, and on a CPU allocating and faulting in each temporary
    of that size cost more than the arithmetic. ``invisible`` is ``~visible``. Returns (output,
    probabilities)."""
    logits.masked_fill_(invisible, -math.inf)
    row_max = logits.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    weights = logits.sub_(row_max).exp_()  # exp(-inf) = 0 at masked keys
    denom = weights.sum(dim=-1, keepdim=True)
    probs = weights.div_(denom.clamp_min(torch.finfo(torch.float32).tiny))
    return torch.matmul(probs, values), probs


def _log_sum_exp(logits: Tensor) -> Tensor:
    """log sum exp over the last axis of masked logits; a row with no finite logit reads 0 (its
    probabilities exp(-inf - 0) are 0, as the kernels' empty heads)."""
    lse = torch.logsumexp(logits, dim=-1)
    return torch.where(torch.isfinite(lse), lse, 0.0)


def per_head_decode(
    q: Tensor,
    k_pool: Any,
    v_pool: Any,
    tables: HeadTables,
    scale: float | None = None,
    *,
    return_probs: bool = False,
    probs_rows: Tensor | None = None,
    logit_rows: LogitRows | None = None,
) -> Tensor | tuple[Tensor, Tensor] | tuple[Tensor, DecodeLogits]:
    """One decode query per request over its per-head tables.

    q: [B, H_q, d] (H_q a multiple of H_kv); k_pool [S, d]; v_pool [S, d_v]; ``scale`` defaults to
    1/sqrt(d). Each query sees every token its KV head holds. Returns [B, H_q, d_v] in q's dtype,
    and with ``return_probs`` also the float32 attention [B, H_kv, G, N] over table entries (for
    policies that accumulate attention statistics; zero at padding). ``probs_rows`` (int64 [k],
    implies ``return_probs``): the attention of those requests only, [k, H_kv, G, N].
    ``logit_rows``: instead, the logits of the requests it names and every request's log-sum-exp
    (:class:`DecodeLogits`, what a decode step's statistics read, `core/decode.py`); the
    requests it names must be in increasing order of their rows.
    """
    b, h_q, d = q.shape
    h_kv = tables.num_kv_heads
    if tables.batch_size != b or h_q % h_kv:
        raise ValueError(f"q {tuple(q.shape)} does not match tables of {b} x {h_kv} heads")
    group = h_q // h_kv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    valid = tables.valid()
    units = tables.head_units()
    keys = _gather(k_pool, units, valid)  # [B, H_kv, N, d]
    values = _gather(v_pool, units, valid)  # [B, H_kv, N, d_v]
    qg = q.float().reshape(b, h_kv, group, d)  # query head h -> KV head h // G (eq. 11)
    logits = torch.matmul(qg, keys.transpose(-1, -2)) * scale  # [B, H_kv, G, N]
    out, probs, logits = _masked_attention(logits, valid.unsqueeze(2), values)
    out = out.reshape(b, h_q, -1).to(q.dtype)
    if logit_rows is not None:
        return out, DecodeLogits(logits=logits[logit_rows.rows, ..., : logit_rows.width], lse=_log_sum_exp(logits))
    if probs_rows is not None:
        return out, probs[probs_rows]
    return (out, probs) if return_probs else out


def fast_per_head_decode(
    q: Tensor, k_pool: Any, v_pool: Any, tables: HeadTables, scale: float | None = None,
    *, return_probs: bool = False, probs_rows: Tensor | None = None, logit_rows: LogitRows | None = None,
    splits: Any = None,
) -> Tensor | tuple[Tensor, Tensor] | tuple[Tensor, DecodeLogits]:
    """`per_head_decode` on the fastest implementation for q's device: the Triton kernel on
    CUDA where it supports the operands, else this module's torch version (the same results, and
    the same allocations but the torch version's own gathers). `splits`: the Triton kernel's
    `SplitPlan`, where the caller planned one."""
    kwargs = {"return_probs": return_probs, "probs_rows": probs_rows, "logit_rows": logit_rows}
    if fused_decode(q.device, q.shape[-1], k_pool, v_pool):
        from sgl_kvc.kernels import triton_per_head

        return triton_per_head.triton_per_head_decode(q, k_pool, v_pool, tables, scale, splits=splits, **kwargs)
    return per_head_decode(q, k_pool, v_pool, tables, scale, **kwargs)


def fused_decode(device: torch.device, head_dim: int, k_pool: Any, v_pool: Any) -> bool:
    """Whether decode over these unit pools runs the Triton kernel (CUDA, Triton importable,
    operands it supports): one launch for the whole batch, with no padding to bound."""
    if device.type != "cuda":
        return False
    try:
        from sgl_kvc.kernels import triton_per_head
    except ImportError:  # no triton: the torch version serves
        return False
    probe = torch.empty(1, 1, head_dim, device="meta")  # only its shape is read
    return triton_per_head.supports(probe, k_pool, v_pool)


def flat_heads(cache: Any) -> Any:
    """A slot cache [S, H_kv, d] (a tensor, or an FP8 `Fp8Rows` with one scale per (slot, head))
    viewed as a unit pool [S x H_kv, d]: entry (slot s, head h) is unit s x H_kv + h. A view, no
    copy: per-head tables then read SGLang's own cache."""
    codes = getattr(cache, "codes", None)
    if codes is None:
        return cache.view(-1, cache.shape[-1])
    return type(cache)(codes.view(-1, codes.shape[-1]), cache.scales.view(-1), cache.fp8,
                       cache.scale_format, cache.dtype)


def row_tables(slots: Tensor, lens: Tensor, num_heads: int, rows: Tensor | None = None,
               columns: int = 0) -> HeadTables:
    """Tables over `flat_heads` of a slot cache: every head of request b reads the slots
    `slots[b, :lens[b]]` (slots [b, N] integers, lens [b] int64, on the cache's device); with
    `rows`, the slots `slots[rows[b], :lens[b]]` of a table with a row per request slot (SGLang's
    `req_to_token`, read in place), `columns` wide. One slot table per request, shared by its
    heads (`HeadTables.heads_per_slot`)."""
    return HeadTables(units=slots[:, None, :], lengths=lens[:, None].expand(-1, num_heads).contiguous(),
                      heads_per_slot=num_heads, row_index=rows, columns=columns)


def per_head_extend(
    q: Tensor,
    q_indptr: Tensor,
    q_positions: Tensor,
    k_pool: Any,
    v_pool: Any,
    tables: HeadTables,
    scale: float | None = None,
    *,
    q_block: int = Q_BLOCK,
    on_probs: Callable[[int, int, Tensor], None] | None = None,
    q_max: int | None = None,
) -> Tensor:
    """A block of new queries per request (prefill or extend) over its per-head tables.

    q: [T, H_q, d], the requests' queries packed in order (request b owns rows
    q_indptr[b]:q_indptr[b+1]); q_positions [T]: their logical positions. The new tokens' KV must
    already be in the pool and in every head's table. Key j of (b, h) is visible to a query of b
    at position p iff j < lengths[b, h] and positions[b, h, j] <= p (causal by LOGICAL position).
    Returns [T, H_q, d_v] in q's dtype. `on_probs(start, stop, probs)`: called for each block of
    query rows [start, stop) of every request (padded to the longest) with the float32 attention
    it computed, [B, H_kv, G, stop - start, N] (0 at invisible keys), for policies that add it to
    their statistic. `q_max`: the longest request's query rows, when the caller knows it on the
    host (else it is read from `q_indptr`, which waits for the device once).
    """
    if tables.positions is None:
        raise ValueError("per_head_extend needs HeadTables.positions (logical positions)")
    t, h_q, d = q.shape
    b, h_kv = tables.batch_size, tables.num_kv_heads
    if q_indptr.numel() != b + 1 or h_q % h_kv:
        raise ValueError(f"q_indptr of {q_indptr.numel()} for {b} requests / q {tuple(q.shape)}")
    group = h_q // h_kv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    device = q.device
    q_indptr = q_indptr.to(device=device, dtype=torch.int64)
    q_lens = q_indptr[1:] - q_indptr[:-1]
    if q_max is None:
        q_max = int(q_lens.max()) if b else 0
    # Pack -> pad without a loop: row i of q belongs to request req[i], column col[i].
    req = torch.repeat_interleave(torch.arange(b, device=device), q_lens, output_size=t)
    col = torch.arange(t, device=device) - q_indptr[req]
    qp = q.new_zeros((b, q_max, h_q, d), dtype=torch.float32)
    qp[req, col] = q.float()
    pos = torch.full((b, q_max), -1, dtype=torch.int64, device=device)
    pos[req, col] = q_positions.to(device=device, dtype=torch.int64)
    qg = qp.reshape(b, q_max, h_kv, group, d).permute(0, 2, 3, 1, 4)  # [B, H_kv, G, Q, d]

    valid = tables.valid()
    units = tables.head_units()
    keys = _gather(k_pool, units, valid)  # [B, H_kv, N, d]
    values = _gather(v_pool, units, valid)
    kv_pos = tables.positions.to(device=device, dtype=torch.int64)
    out = torch.zeros(b, h_kv, group, q_max, values.shape[-1], device=device)
    hidden = ~valid[:, :, None, :]
    n = keys.shape[2]
    for start in range(0, q_max, q_block):  # blocks of query rows, never a loop over requests
        stop = min(q_max, start + q_block)
        later = kv_pos[:, :, None, :] > pos[:, None, start:stop, None]  # [B, H_kv, q, N]: not causal
        invisible = later.logical_or_(hidden).unsqueeze(2)  # [B, H_kv, 1, q, N]
        if on_probs is None:
            # No probabilities wanted: PyTorch's fused attention, in one pass over the keys and
            # without the [.., q, N] logits (another rounding of the same softmax; a query that
            # sees no key reads zeros, as below).
            rows = b * h_kv
            block = F.scaled_dot_product_attention(
                qg[:, :, :, start:stop].reshape(rows, group, stop - start, d),
                keys.reshape(rows, 1, n, d).expand(-1, group, -1, -1),
                values.reshape(rows, 1, n, -1).expand(-1, group, -1, -1),
                attn_mask=~invisible.reshape(rows, 1, stop - start, n), scale=scale,
            ).reshape(b, h_kv, group, stop - start, -1)
            out[:, :, :, start:stop] = block.masked_fill_(invisible.all(dim=-1, keepdim=True), 0.0)
            continue
        logits = torch.matmul(qg[:, :, :, start:stop], keys.unsqueeze(2).transpose(-1, -2)).mul_(scale)
        out[:, :, :, start:stop], probs = _attend_in_place(logits, invisible, values.unsqueeze(2))
        on_probs(start, stop, probs)
    out = out.permute(0, 3, 1, 2, 4).reshape(b, q_max, h_q, -1)  # back to [B, Q, H_q, d_v]
    return out[req, col].to(q.dtype)
