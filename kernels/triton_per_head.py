"""Triton decode attention over head-flattened KV tables: the CUDA path of
`per_head_attention.per_head_decode`.

Same contract as the torch version: one query per request, each (request, KV head) a sequence
of its own length whose entry j is unit `tables.units[b, h, j]` of a flat pool K [U, d],
V [U, d_v] (KV-Compress §4.2.1, eq. 12, with page size 1); query head h reads KV head h // G
(eq. 11). The pool may be the FP8 unit pool (`Fp8Rows`: uint8 codes [U, d] and one scale per
unit, bf16 or fp32 storage), dequantized as it is loaded.

One program per (request, KV head, split): it loads the G query heads of the group once (padded
to 16 rows, the matrix units' smallest product), walks its split of the table in blocks of
BLOCK_N units (FP8_BLOCK_N from an FP8 pool), gathered by index since the units of a head are
anywhere in the pool, with an online softmax in float32 and both products on the matrix units,
and writes its unnormalized output, running max and sum. A second kernel merges the splits of a
sequence (flash-decoding), so short batches of long sequences still fill the GPU; a table of one
split (at most SPLIT_N units) is normalized by the decode kernel itself, with no second launch.
With `return_probs` the kernel also writes the scaled logits, and the probabilities the
statistics need are exp(logit - log-sum-exp).

`per_head_attention.fast_per_head_decode` picks it for CUDA tensors it `supports`. Without a
GPU it runs under Triton's interpreter (`TRITON_INTERPRET=1`, set before import; the CPU install
has triton, a dependency of xgrammar), which is how CI checks it against the torch version.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from sgl_kvc.kernels.per_head_tables import SPLIT_COLUMNS, DecodeLogits, HeadTables, LogitRows, SplitPlan

BLOCK_N = 64  # units per block of the table walk
# FP8 rows are half as wide: twice the units per block keep as many bytes in flight; 3 pipeline
# stages where the shared memory holds them (Hopper), 2 elsewhere (a block's tiles within sm89's).
# Measured on an H100 and an H200: docs/benchmarks.md, "Per-head decode kernel (GPU)".
FP8_BLOCK_N, FP8_STAGES, FP8_STAGES_HOPPER = 128, 2, 3
# What an FP8 pool's codes widen to before the products: "bfloat16" (the query's dtype), or
# "float16", which holds every e4m3 / e5m2 value exactly (the bf16 query then rounded to it,
# clamped to its range); the two measured within a few percent of each other on an H200, bfloat16
# ahead at its best launch settings (the same page).
FP8_DOT = "bfloat16"
MIN_DOT = 16  # tl.dot's smallest size on every side: query groups are padded to it
SPLIT_N = SPLIT_COLUMNS  # table columns per split (one program each)
FP8_TYPES = {"fp8_e4m3": tl.float8e4nv, "fp8_e5m2": tl.float8e5}


@triton.jit
def _store_normalized(out_ptr, lse_ptr, out_rows, lse_rows, ok, acc, total, top, dv, dim_v: tl.constexpr):
    """A (request, KV head)'s final output acc / total at its query rows `out_rows`, and its
    log-sum-exp top + log(total) at `lse_rows` (the real rows: `ok`). An empty head (total 0,
    top -inf) reads zeros."""
    total = tl.maximum(total, 1.1754943508222875e-38)  # float32's smallest normal: 0 / tiny = 0
    tl.store(out_ptr + out_rows[:, None] * dim_v + dv[None, :], acc / total[:, None], mask=ok[:, None])
    top = tl.where(top == float("-inf"), 0.0, top)
    tl.store(lse_ptr + lse_rows, top + tl.log(total), mask=ok)


@triton.jit
def _per_head_decode_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, units_ptr, rows_ptr, lens_ptr, split_ptr,
    work_ptr, logits_ptr, probs_slot_ptr, out_ptr,
    scale, n_cols, units_stride, batch, n_parts,
    num_kv_heads: tl.constexpr, group: tl.constexpr, group_pad: tl.constexpr,
    dim: tl.constexpr, dim_v: tl.constexpr, split_n: tl.constexpr, block_n: tl.constexpr,
    fp8_type: tl.constexpr, is_fp8: tl.constexpr, store_logits: tl.constexpr, dot_fp32: tl.constexpr,
    shared: tl.constexpr, by_row: tl.constexpr, dot_f16: tl.constexpr,
):
    bh = tl.program_id(0)  # request b, KV head h
    split = tl.program_id(1)
    b = bh // num_kv_heads
    h = bh % num_kv_heads
    # This request's splits (its widest head's columns / split_n): a short request among long
    # ones has programs for splits it does not have, which do nothing.
    n_splits = tl.load(split_ptr + b)
    if split < n_splits:
        length = tl.load(lens_ptr + bh)
        start = split * split_n
        stop = tl.minimum(start + split_n, length)
        # the row of the logits this request writes (-1: none; only requests with statistics need them)
        slot = tl.load(probs_slot_ptr + b)

        g = tl.arange(0, group_pad)
        g_ok = g < group
        d = tl.arange(0, dim)
        dv = tl.arange(0, dim_v)
        q_rows = b * num_kv_heads * group + h * group + g  # query head h x G + g of request b
        q = tl.load(q_ptr + q_rows[:, None] * dim + d[None, :], mask=g_ok[:, None], other=0.0)
        if dot_fp32:
            q = q.to(tl.float32)
        elif dot_f16:  # FP8 codes widen to float16 exactly in one instruction; the query follows
            q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        # Both products run on the matrix units in the query's dtype with float32 accumulation (a
        # float32 query: exact float32, "ieee").
        dot_type = q.dtype
        # A slot table (shared by the heads of a slot cache viewed flat; by row: a row of
        # SGLang's `req_to_token`, read in place): head h of slot s is unit s x H_kv + h. A
        # per-head table lists the head's own units.
        if by_row:
            table = units_ptr + tl.load(rows_ptr + b).to(tl.int64) * units_stride
        elif shared:
            table = units_ptr + b.to(tl.int64) * units_stride
        else:
            table = units_ptr + bh.to(tl.int64) * units_stride

        run_max = tl.full([group_pad], float("-inf"), tl.float32)
        run_sum = tl.zeros([group_pad], tl.float32)
        acc = tl.zeros([group_pad, dim_v], tl.float32)
        for col0 in range(start, stop, block_n):
            cols = col0 + tl.arange(0, block_n)
            ok = cols < stop
            unit = tl.load(table + cols, mask=ok, other=0).to(tl.int64)
            if shared:
                unit = unit * num_kv_heads + h
            k = tl.load(k_ptr + unit[:, None] * dim + d[None, :], mask=ok[:, None], other=0)
            v = tl.load(v_ptr + unit[:, None] * dim_v + dv[None, :], mask=ok[:, None], other=0)
            if is_fp8:  # codes -> FP8 -> the dot's dtype (exact); the unit's scale multiplies a column
                k = k.to(fp8_type, bitcast=True)
                v = v.to(fp8_type, bitcast=True)
            logits = tl.dot(q, tl.trans(k.to(dot_type)), input_precision="ieee") * scale  # [G', block_n]
            if is_fp8:  # q . (code x s) = (q . code) x s
                logits = logits * tl.load(ks_ptr + unit, mask=ok, other=0).to(tl.float32)[None, :]
            logits = tl.where(ok[None, :], logits, float("-inf"))
            if store_logits:
                out_rows = ((slot * num_kv_heads + h) * group + g) * n_cols
                keep = (g_ok & (g * 0 + slot >= 0))[:, None] & ok[None, :]
                tl.store(logits_ptr + out_rows[:, None] + cols[None, :], logits, mask=keep)
            new_max = tl.maximum(run_max, tl.max(logits, axis=1))
            alpha = tl.exp(run_max - new_max)  # 0 on the first block (run_max = -inf)
            p = tl.exp(logits - new_max[:, None])
            run_sum = run_sum * alpha + tl.sum(p, axis=1)
            if is_fp8:  # p . (code x s) = (p x s) . code
                p = p * tl.load(vs_ptr + unit, mask=ok, other=0).to(tl.float32)[None, :]
            acc = acc * alpha[:, None] + tl.dot(p.to(dot_type), v.to(dot_type), input_precision="ieee")
            run_max = new_max

        # the workspace: partial outputs [n_parts, dim_v], maxima and sums [n_parts] (a row per
        # query head of each split of the requests that have several), then the log-sum-exp
        # [B x H_kv x G]
        max_ptr = work_ptr + n_parts * dim_v
        sum_ptr = max_ptr + n_parts
        if n_splits == 1:  # nothing to merge: the output and log-sum-exp are final here
            rows = bh * group + g
            _store_normalized(out_ptr, sum_ptr + n_parts, rows, rows, g_ok, acc, run_sum, run_max, dv, dim_v)
        else:
            part = ((tl.load(split_ptr + batch + b) + split) * num_kv_heads + h) * group + g
            tl.store(max_ptr + part, run_max, mask=g_ok)
            tl.store(sum_ptr + part, run_sum, mask=g_ok)
            tl.store(work_ptr + part[:, None] * dim_v + dv[None, :], acc, mask=g_ok[:, None])


@triton.jit
def _merge_splits_kernel(
    work_ptr, out_ptr, split_ptr, batch, n_parts,
    num_kv_heads: tl.constexpr, group: tl.constexpr, group_pad: tl.constexpr, dim_v: tl.constexpr,
):
    """Flash-decoding's merge, one program per (request, KV head) of several splits: each split's
    output rescaled to the global max, out = sum_s acc_s e^(m_s - m) / sum_s l_s e^(m_s - m), and
    the log-sum-exp m + log(sum) the probabilities need. One launch instead of a dozen torch
    operations."""
    bh = tl.program_id(0)
    b = bh // num_kv_heads
    h = bh % num_kv_heads
    n_splits = tl.load(split_ptr + b)
    if n_splits > 1:
        first = tl.load(split_ptr + batch + b)
        g = tl.arange(0, group_pad)
        g_ok = g < group
        dv = tl.arange(0, dim_v)
        max_ptr = work_ptr + n_parts * dim_v  # the decode kernel's workspace
        sum_ptr = max_ptr + n_parts
        top = tl.full([group_pad], float("-inf"), tl.float32)
        for s in range(n_splits):
            part = ((first + s) * num_kv_heads + h) * group + g
            top = tl.maximum(top, tl.load(max_ptr + part, mask=g_ok, other=float("-inf")))
        top = tl.where(top == float("-inf"), 0.0, top)  # an empty head: every weight below is 0
        total = tl.zeros([group_pad], tl.float32)
        merged = tl.zeros([group_pad, dim_v], tl.float32)
        for s in range(n_splits):
            part = ((first + s) * num_kv_heads + h) * group + g
            weight = tl.exp(tl.load(max_ptr + part, mask=g_ok, other=float("-inf")) - top)  # 0 for an empty split
            total += tl.load(sum_ptr + part, mask=g_ok, other=0.0) * weight
            merged += tl.load(work_ptr + part[:, None] * dim_v + dv[None, :], mask=g_ok[:, None], other=0.0) * weight[:, None]
        rows = bh * group + g
        _store_normalized(out_ptr, sum_ptr + n_parts, rows, rows, g_ok, merged, total, top, dv, dim_v)


def supports(q: Tensor, k_pool: Any, v_pool: Any) -> bool:
    """Whether the kernel serves these operands: power-of-two head dims of 16 or more, a [U, d] pool of a
    float dtype or an FP8 `Fp8Rows` with bf16 / fp32 scales (e8m0 scales: the torch version)."""
    dims = []
    for pool in (k_pool, v_pool):
        codes = getattr(pool, "codes", None)
        if codes is not None and (pool.scale_format not in ("bfloat16", "float32") or pool.fp8 not in FP8_TYPES):
            return False
        tensor = pool if codes is None else codes
        if tensor.dim() != 2:
            return False
        dims.append(int(tensor.shape[-1]))
    dims.append(int(q.shape[-1]))
    return all(x >= MIN_DOT and not x & (x - 1) for x in dims) and dims[0] == dims[2]


def interpreted() -> bool:
    """Whether Triton runs kernels under its interpreter (no GPU). Its products of 16-bit floats
    are wrong (Triton 3.9: a bf16 `tl.dot` of 16 x 16 values near 1 gives 1e10), so interpreted
    kernels multiply in float32, which is exact for 16-bit and FP8 inputs."""
    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4
    return bool(knobs is not None and knobs.runtime.interpret) or os.environ.get("TRITON_INTERPRET") == "1"


def pool_parts(pool: Any) -> tuple[Tensor, Tensor | None, str | None]:
    """(values or codes [U, d], scales [U] or None, FP8 format or None) of a unit pool."""
    codes = getattr(pool, "codes", None)
    return (pool, None, None) if codes is None else (codes, pool.scales, pool.fp8)


def triton_per_head_decode(
    q: Tensor, k_pool: Any, v_pool: Any, tables: HeadTables, scale: float | None = None,
    *, return_probs: bool = False, probs_rows: Tensor | None = None, logit_rows: LogitRows | None = None,
    split_n: int = SPLIT_N, block_n: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None, fp8_dot: str | None = None, splits: SplitPlan | None = None,
) -> Tensor | tuple[Tensor, Tensor] | tuple[Tensor, DecodeLogits]:
    """`per_head_attention.per_head_decode` in Triton (same arguments and results). `block_n`,
    `num_warps` and `num_stages` override the decode kernel's defaults for its pool, and
    `fp8_dot` ("bfloat16" / "float16") the dtype an FP8 pool's codes widen to (tuning).
    With `probs_rows` or `logit_rows`, logits are written for those requests only. `splits`: how
    many splits of `split_n` columns each request has (`core/decode.py`'s `split_plan`, planned on the host once
    per step); by default every request gets as many as the widest table (workspace included)."""
    b, h_q, d = q.shape
    h_kv = tables.num_kv_heads
    if tables.batch_size != b or h_q % h_kv:
        raise ValueError(f"q {tuple(q.shape)} does not match tables of {b} x {h_kv} heads")
    if not supports(q, k_pool, v_pool):
        raise NotImplementedError("Triton per-head decode: unsupported pool or head dims (see `supports`)")
    group = h_q // h_kv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k, k_scales, fp8 = pool_parts(k_pool)
    v, v_scales, _ = pool_parts(v_pool)
    d_v = int(v.shape[-1])
    n = tables.width
    if block_n is None:
        block_n = BLOCK_N if fp8 is None else FP8_BLOCK_N
    if num_stages is None and fp8 is not None:
        hopper = q.is_cuda and torch.cuda.get_device_capability(q.device)[0] >= 9
        num_stages = FP8_STAGES_HOPPER if hopper else FP8_STAGES
    launch = {key: x for key, x in (("num_warps", num_warps), ("num_stages", num_stages)) if x is not None}
    if block_n < MIN_DOT or split_n % block_n:
        raise ValueError(f"block_n must be >= {MIN_DOT} and divide split_n, got {block_n} and {split_n}")
    group_pad = max(MIN_DOT, triton.next_power_of_2(group))  # the matrix units' smallest M
    device = q.device
    units = tables.units
    if units.stride(-1) != 1 or (not tables.heads_per_slot and units.stride(0) != units.shape[1] * units.stride(1)):
        units = units.contiguous()
    # a table's row: a request's (slot tables) or a (request, head)'s (per-head tables)
    row_stride = units.stride(0) if tables.heads_per_slot else units.stride(1)
    lens = tables.lengths.to(torch.int64).contiguous()
    most = max(1, -(-n // split_n))  # splits of the widest table
    if splits is None:  # as many as the widest table needs, for every request (a bound)
        counts = torch.full((b,), most, dtype=torch.int64, device=device)
        splits = SplitPlan(torch.cat([counts, torch.arange(b, dtype=torch.int64, device=device) * most]),
                           total=b * most if most > 1 else 0, most=most)
    # One float32 workspace (an allocation costs the host about as much as a small kernel launch,
    # and a compressing server launches each layer's decode, with no CUDA graph): the partial
    # outputs, maxima and sums of the splits of every request that has several, then the
    # log-sum-exp. A request of one split writes its output directly.
    parts = splits.total * h_kv * group
    work = torch.empty(parts * (d_v + 2) + b * h_kv * group, dtype=torch.float32, device=device)
    out = torch.empty(b, h_q, d_v, dtype=q.dtype, device=device)
    width = n  # columns of the logits
    if logit_rows is not None:
        k_logits, probs_slot, width = logit_rows.count, logit_rows.slots, logit_rows.width
    elif return_probs or probs_rows is not None:
        k_logits = b if probs_rows is None else int(probs_rows.shape[0])
        if probs_rows is None:
            probs_slot = torch.arange(b, dtype=torch.int64, device=device)
        else:
            probs_slot = torch.full((b,), -1, dtype=torch.int64, device=device)
            probs_slot[probs_rows] = torch.arange(k_logits, dtype=torch.int64, device=device)
    else:
        k_logits, probs_slot = 0, lens  # read, never used
    store_logits = k_logits > 0
    # Entries past a head's length are never written: the probabilities below mask them, and a
    # step's statistics read each request's own columns only (`kernels/triton_stats.py`).
    logits = torch.empty((k_logits, h_kv, group, width), dtype=torch.float32, device=device) if store_logits else work
    f16 = fp8 is not None and (fp8_dot or FP8_DOT) == "float16" and q.dtype == torch.bfloat16
    by_row = tables.row_index is not None
    _per_head_decode_kernel[(b * h_kv, splits.most)](
        q.contiguous(), k, v, k_scales if k_scales is not None else k, v_scales if v_scales is not None else v,
        units, tables.row_index if by_row else lens, lens, splits.plan, work, logits, probs_slot, out,
        scale, width, row_stride, b, parts,
        num_kv_heads=h_kv, group=group, group_pad=group_pad, dim=d, dim_v=d_v, split_n=split_n,
        block_n=block_n, fp8_type=FP8_TYPES.get(fp8 or "fp8_e4m3"), is_fp8=fp8 is not None,
        store_logits=store_logits, dot_fp32=q.dtype == torch.float32 or interpreted(),
        shared=bool(tables.heads_per_slot), by_row=by_row, dot_f16=f16, **launch,
    )
    if splits.most > 1:
        _merge_splits_kernel[(b * h_kv,)](work, out, splits.plan, b, parts, num_kv_heads=h_kv, group=group,
                                          group_pad=group_pad, dim_v=d_v)
    lse = work[parts * (d_v + 2) :].view(b, h_kv, group)
    if logit_rows is not None:
        return out, DecodeLogits(logits=logits if store_logits else logits[:0], lse=lse)
    if not store_logits:
        return out
    valid = tables.valid() if probs_rows is None else tables.valid()[probs_rows]
    norm = lse if probs_rows is None else lse[probs_rows]
    logits = logits.masked_fill(~valid[:, :, None, :], -math.inf)
    probs = torch.exp(logits - norm[..., None])  # exp(-inf) = 0 at padding
    return out, probs
