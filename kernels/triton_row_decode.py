"""Triton decode attention that reads request rows in place: the CUDA path of
`row_decode.row_decode`, the attention of a captured decode step (`core/graph_step.py`).

Same contract as the torch version, without its padding: one program per (request, KV head,
split), a fixed number of splits (`NUM_SPLITS`), so the grid is the batch's size times constants
and a CUDA graph of it replays any batch of that size. Each program finds its own columns on the
device: request b's head h holds `lens[row, h]` packed entries (units `table[start[row, h] + j]`)
and then its row's tail (positions `packed[row]` to its length of `req_to_token[row]`, unit slot x
`slot_units` + `layer_units` + h); split s walks columns [s x w, (s + 1) x w) of them, w the
columns over `NUM_SPLITS` rounded up to a block. It loads the G query heads of the group once
(padded to 16 rows, the matrix units' smallest product), gathers keys and values by unit, keeps
an online softmax in float32 and writes its unnormalized output, maximum and sum; a second kernel
merges the splits (flash-decoding) into the output, in its dtype. FP8 pools (`Fp8Rows`: uint8
codes and one scale per unit) are dequantized as they load, as in `triton_per_head.py`.

Without a GPU it runs under Triton's interpreter (`TRITON_INTERPRET=1`), which is how the CPU
checks it against the torch version (`tests/core/test_row_decode_triton.py`).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from sgl_kvc.kernels.row_decode import PackedLayer
from sgl_kvc.kernels import triton_per_head
from sgl_kvc.kernels.triton_per_head import FP8_TYPES, MIN_DOT, interpreted, pool_parts

NUM_SPLITS = 8  # splits of each (request, head): the grid's third size, whatever the lengths
BLOCK_N = 64  # columns per block of a split's walk (FP8: twice, as many bytes in flight)
FP8_BLOCK_N = 128


@triton.jit
def _row_decode_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, r2t_ptr, rows_ptr, lens_ptr,
    table_ptr, start_ptr, own_ptr, packed_ptr, work_ptr,
    scale, r2t_stride, layout_stride, slot_units, layer_units,
    num_kv_heads: tl.constexpr, group: tl.constexpr, group_pad: tl.constexpr, dim: tl.constexpr,
    dim_v: tl.constexpr, num_splits: tl.constexpr, block_n: tl.constexpr, has_table: tl.constexpr,
    fp8_type: tl.constexpr, is_fp8: tl.constexpr, dot_fp32: tl.constexpr,
):
    bh = tl.program_id(0)  # request b, KV head h
    split = tl.program_id(1)
    b = bh // num_kv_heads
    h = bh % num_kv_heads
    row = tl.load(rows_ptr + b).to(tl.int64)
    n = tl.load(lens_ptr + b).to(tl.int64)
    if has_table:
        first = tl.load(packed_ptr + row).to(tl.int64)
        own = tl.load(own_ptr + row * layout_stride + h).to(tl.int64)
        at = tl.load(start_ptr + row * layout_stride + h).to(tl.int64)
    else:
        first = n * 0
        own = n * 0
        at = n * 0
    total = own + n - first
    per_split = tl.cdiv(tl.cdiv(total, num_splits), block_n) * block_n
    start = split * per_split
    stop = tl.minimum(start + per_split, total)

    g = tl.arange(0, group_pad)
    g_ok = g < group
    d = tl.arange(0, dim)
    dv = tl.arange(0, dim_v)
    q_rows = bh * group + g  # query head h x G + g of request b
    q = tl.load(q_ptr + q_rows[:, None] * dim + d[None, :], mask=g_ok[:, None], other=0.0)
    if dot_fp32:
        q = q.to(tl.float32)
    dot_type = q.dtype
    row_slots = r2t_ptr + row * r2t_stride

    run_max = tl.full([group_pad], float("-inf"), tl.float32)
    run_sum = tl.zeros([group_pad], tl.float32)
    acc = tl.zeros([group_pad, dim_v], tl.float32)
    for col0 in range(start, stop, block_n):
        cols = col0 + tl.arange(0, block_n)
        ok = cols < stop
        in_table = cols < own
        slot = tl.load(row_slots + (first + cols - own), mask=ok & (cols >= own), other=0).to(tl.int64)
        unit = slot * slot_units + layer_units + h
        if has_table:
            unit = tl.where(in_table, tl.load(table_ptr + at + cols, mask=ok & in_table, other=0).to(tl.int64), unit)
        k = tl.load(k_ptr + unit[:, None] * dim + d[None, :], mask=ok[:, None], other=0)
        v = tl.load(v_ptr + unit[:, None] * dim_v + dv[None, :], mask=ok[:, None], other=0)
        if is_fp8:  # codes -> FP8 -> the dot's dtype (exact); the unit's scale multiplies a column
            k = k.to(fp8_type, bitcast=True)
            v = v.to(fp8_type, bitcast=True)
        logits = tl.dot(q, tl.trans(k.to(dot_type)), input_precision="ieee") * scale  # [G', block_n]
        if is_fp8:
            logits = logits * tl.load(ks_ptr + unit, mask=ok, other=0).to(tl.float32)[None, :]
        logits = tl.where(ok[None, :], logits, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(logits, axis=1))
        alpha = tl.exp(run_max - new_max)  # 0 on the first block (run_max = -inf)
        p = tl.exp(logits - new_max[:, None])
        run_sum = run_sum * alpha + tl.sum(p, axis=1)
        if is_fp8:
            p = p * tl.load(vs_ptr + unit, mask=ok, other=0).to(tl.float32)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(dot_type), v.to(dot_type), input_precision="ieee")
        run_max = new_max

    # the workspace: per (request, query head, split) its partial output [dim_v], then the maxima
    # and the sums of every part
    parts = tl.num_programs(0) * group * num_splits
    part = (bh * group + g) * num_splits + split
    tl.store(work_ptr + part[:, None] * dim_v + dv[None, :], acc, mask=g_ok[:, None])
    tl.store(work_ptr + parts * dim_v + part, run_max, mask=g_ok)
    tl.store(work_ptr + parts * (dim_v + 1) + part, run_sum, mask=g_ok)


@triton.jit
def _merge_kernel(
    work_ptr, out_ptr, parts,
    group: tl.constexpr, group_pad: tl.constexpr, dim_v: tl.constexpr, num_splits: tl.constexpr,
):
    """Flash-decoding's merge of one (request, KV head)'s splits: each rescaled to the global
    maximum, out = sum_s acc_s e^(m_s - m) / sum_s l_s e^(m_s - m). An empty split (maximum -inf,
    sum 0) weighs 0; an empty head reads zeros."""
    bh = tl.program_id(0)
    g = tl.arange(0, group_pad)
    g_ok = g < group
    dv = tl.arange(0, dim_v)
    base = (bh * group + g) * num_splits
    top = tl.full([group_pad], float("-inf"), tl.float32)
    for s in tl.static_range(num_splits):
        top = tl.maximum(top, tl.load(work_ptr + parts * dim_v + base + s, mask=g_ok, other=float("-inf")))
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([group_pad], tl.float32)
    merged = tl.zeros([group_pad, dim_v], tl.float32)
    for s in tl.static_range(num_splits):
        weight = tl.exp(tl.load(work_ptr + parts * dim_v + base + s, mask=g_ok, other=float("-inf")) - top)
        total += tl.load(work_ptr + parts * (dim_v + 1) + base + s, mask=g_ok, other=0.0) * weight
        acc = tl.load(work_ptr + (base + s)[:, None] * dim_v + dv[None, :], mask=g_ok[:, None], other=0.0)
        merged += acc * weight[:, None]
    total = tl.maximum(total, 1.1754943508222875e-38)  # float32's smallest normal: 0 / tiny = 0
    rows = bh * group + g
    result = merged / total[:, None]
    tl.store(out_ptr + rows[:, None] * dim_v + dv[None, :], result.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


def supports(head_dim: int, k_pool: Any, v_pool: Any) -> bool:
    """Whether the kernel serves these operands: those of `triton_per_head.supports` (power-of-two
    head dims of 16 or more, [U, d] pools of a float dtype or FP8 `Fp8Rows` with bf16 / fp32 scales)."""
    return triton_per_head.supports(torch.empty(1, 1, head_dim, device="meta"), k_pool, v_pool)


def triton_row_decode(
    q: Tensor, k_pool: Any, v_pool: Any, req_to_token: Tensor, rows: Tensor, seq_lens: Tensor, scale: float,
    out: Tensor, *, heads: int, slot_units: int, layer_units: int, packed: PackedLayer | None = None,
    num_splits: int = NUM_SPLITS, block_n: int | None = None,
) -> None:
    """`row_decode.row_decode` in Triton (the same arguments but the torch version's `width`):
    two launches, a grid of the batch's size times constants, nothing read back to the host."""
    b, h_q, d = q.shape
    if h_q % heads or not supports(d, k_pool, v_pool):
        raise NotImplementedError("Triton row decode: unsupported pool or head dims (see `supports`)")
    group = h_q // heads
    k, k_scales, fp8 = pool_parts(k_pool)
    v, v_scales, _ = pool_parts(v_pool)
    d_v = int(v.shape[-1])
    if block_n is None:
        block_n = BLOCK_N if fp8 is None else FP8_BLOCK_N
    group_pad = max(MIN_DOT, triton.next_power_of_2(group))
    parts = b * heads * group * num_splits
    work = torch.empty(parts * (d_v + 2), dtype=torch.float32, device=q.device)
    has_table = packed is not None
    if has_table:
        table, start, own, first = packed.table, packed.start, packed.lens, packed.packed
        if start.stride(1) != 1 or own.stride() != start.stride():
            raise ValueError("a packed layer's start and lens must share their row stride, heads contiguous")
        layout_stride = start.stride(0)
    else:
        table = start = own = first = seq_lens  # read, never used
        layout_stride = 0
    if req_to_token.stride(1) != 1:
        raise ValueError("req_to_token must be row-major")
    _row_decode_kernel[(b * heads, num_splits)](
        q.contiguous(), k, v, k_scales if k_scales is not None else k, v_scales if v_scales is not None else v,
        req_to_token, rows, seq_lens, table, start, own, first, work,
        scale, req_to_token.stride(0), layout_stride, slot_units, layer_units,
        num_kv_heads=heads, group=group, group_pad=group_pad, dim=d, dim_v=d_v, num_splits=num_splits,
        block_n=block_n, has_table=has_table, fp8_type=FP8_TYPES.get(fp8 or "fp8_e4m3"), is_fp8=fp8 is not None,
        dot_fp32=q.dtype == torch.float32 or interpreted(),
    )
    target = out if out.is_contiguous() else torch.empty_like(out)
    _merge_kernel[(b * heads,)](work, target, parts, group=group, group_pad=group_pad, dim_v=d_v, num_splits=num_splits)
    if target is not out:
        out.copy_(target)
