"""Triton decode attention over head-flattened KV tables (installed as
`sgl_kvc.kernels.triton_per_head`): the CUDA path of `per_head_attention.per_head_decode`.

Same contract as the torch version: one query per request, each (request, KV head) a sequence
of its own length whose entry j is unit `tables.units[b, h, j]` of a flat pool K [U, d],
V [U, d_v] (KV-Compress §4.2.1, eq. 12, with page size 1); query head h reads KV head h // G
(eq. 11). The pool may be the FP8 unit pool (`Fp8Rows`: uint8 codes [U, d] and one scale per
unit, bf16 or fp32 storage), dequantized as it is loaded.

One program per (request, KV head, split): it loads the G query heads of the group once, walks
its split of the table in blocks of BLOCK_N units (gathered by index: the units of a head are
anywhere in the pool) with an online softmax in float32, and writes its unnormalized output,
running max and sum. The splits of a sequence are merged in torch (flash-decoding), so short
batches of long sequences still fill the GPU. With `return_probs` the kernel also writes the
scaled logits, and the probabilities the statistics need are exp(logit - max) / sum.

`per_head_attention.fast_per_head_decode` picks it for CUDA tensors it `supports`. Without a
GPU it runs under Triton's interpreter (`TRITON_INTERPRET=1`, set before import; the CPU install
has triton, a dependency of xgrammar), which is how CI checks it against the torch version.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from sgl_kvc.kernels.per_head_attention import HeadTables

BLOCK_N = 64  # units per block of the table walk
SPLIT_N = 512  # table columns per split (one program each)
_FP8_TYPES = {"fp8_e4m3": tl.float8e4nv, "fp8_e5m2": tl.float8e5}


@triton.jit
def _per_head_decode_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, units_ptr, lens_ptr,
    acc_ptr, max_ptr, sum_ptr, logits_ptr,
    scale, n_cols, n_splits,
    num_kv_heads: tl.constexpr, group: tl.constexpr, group_pad: tl.constexpr,
    dim: tl.constexpr, dim_v: tl.constexpr, split_n: tl.constexpr, block_n: tl.constexpr,
    fp8_type: tl.constexpr, is_fp8: tl.constexpr, store_logits: tl.constexpr,
):
    bh = tl.program_id(0)  # request b, KV head h
    split = tl.program_id(1)
    b = bh // num_kv_heads
    h = bh % num_kv_heads
    length = tl.load(lens_ptr + bh)
    start = split * split_n
    stop = tl.minimum(start + split_n, length)

    g = tl.arange(0, group_pad)
    g_ok = g < group
    d = tl.arange(0, dim)
    dv = tl.arange(0, dim_v)
    q_rows = b * num_kv_heads * group + h * group + g  # query head h x G + g of request b
    q = tl.load(q_ptr + q_rows[:, None] * dim + d[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32)

    run_max = tl.full([group_pad], float("-inf"), tl.float32)
    run_sum = tl.zeros([group_pad], tl.float32)
    acc = tl.zeros([group_pad, dim_v], tl.float32)
    for col0 in range(start, stop, block_n):
        cols = col0 + tl.arange(0, block_n)
        ok = cols < stop
        unit = tl.load(units_ptr + bh * n_cols + cols, mask=ok, other=0).to(tl.int64)
        k = tl.load(k_ptr + unit[:, None] * dim + d[None, :], mask=ok[:, None], other=0)
        v = tl.load(v_ptr + unit[:, None] * dim_v + dv[None, :], mask=ok[:, None], other=0)
        if is_fp8:  # codes -> FP8 -> float32, times the unit's scale
            k = k.to(fp8_type, bitcast=True).to(tl.float32)
            v = v.to(fp8_type, bitcast=True).to(tl.float32)
            k = k * tl.load(ks_ptr + unit, mask=ok, other=0).to(tl.float32)[:, None]
            v = v * tl.load(vs_ptr + unit, mask=ok, other=0).to(tl.float32)[:, None]
        else:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        logits = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, block_n]
        logits = tl.where(ok[None, :], logits, float("-inf"))
        if store_logits:
            out_rows = (bh * group + g) * n_cols
            tl.store(logits_ptr + out_rows[:, None] + cols[None, :], logits, mask=g_ok[:, None] & ok[None, :])
        new_max = tl.maximum(run_max, tl.max(logits, axis=1))
        alpha = tl.exp(run_max - new_max)  # 0 on the first block (run_max = -inf)
        p = tl.exp(logits - new_max[:, None])
        run_sum = run_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        run_max = new_max

    part = bh * n_splits + split
    tl.store(max_ptr + part * group_pad + g, run_max)
    tl.store(sum_ptr + part * group_pad + g, run_sum)
    tl.store(acc_ptr + (part * group_pad + g)[:, None] * dim_v + dv[None, :], acc)


def supports(q: Tensor, k_pool: Any, v_pool: Any) -> bool:
    """Whether the kernel serves these operands: power-of-two head dims, a [U, d] pool of a
    float dtype or an FP8 `Fp8Rows` with bf16 / fp32 scales (e8m0 scales: the torch version)."""
    dims = []
    for pool in (k_pool, v_pool):
        codes = getattr(pool, "codes", None)
        if codes is not None and (pool.scale_format not in ("bfloat16", "float32") or pool.fp8 not in _FP8_TYPES):
            return False
        tensor = pool if codes is None else codes
        if tensor.dim() != 2:
            return False
        dims.append(int(tensor.shape[-1]))
    dims.append(int(q.shape[-1]))
    return all(x > 0 and not x & (x - 1) for x in dims) and dims[0] == dims[2]


def _pool_parts(pool: Any) -> tuple[Tensor, Tensor | None, str | None]:
    """(values or codes [U, d], scales [U] or None, FP8 format or None) of a unit pool."""
    codes = getattr(pool, "codes", None)
    return (pool, None, None) if codes is None else (codes, pool.scales, pool.fp8)


def triton_per_head_decode(
    q: Tensor, k_pool: Any, v_pool: Any, tables: HeadTables, scale: float | None = None,
    *, return_probs: bool = False, split_n: int = SPLIT_N, block_n: int = BLOCK_N,
) -> Tensor | tuple[Tensor, Tensor]:
    """`per_head_attention.per_head_decode` in Triton (same arguments and results)."""
    b, h_q, d = q.shape
    h_kv = tables.num_kv_heads
    if tables.batch_size != b or h_q % h_kv:
        raise ValueError(f"q {tuple(q.shape)} does not match tables of {b} x {h_kv} heads")
    if not supports(q, k_pool, v_pool):
        raise NotImplementedError("Triton per-head decode: unsupported pool or head dims (see `supports`)")
    group = h_q // h_kv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k, k_scales, fp8 = _pool_parts(k_pool)
    v, v_scales, _ = _pool_parts(v_pool)
    d_v = int(v.shape[-1])
    n = int(tables.units.shape[-1])
    splits = max(1, -(-n // split_n))
    group_pad = triton.next_power_of_2(group)
    device = q.device
    units = tables.units.contiguous()
    lens = tables.lengths.to(torch.int64).contiguous()
    acc = torch.empty(b * h_kv, splits, group_pad, d_v, dtype=torch.float32, device=device)
    run_max = torch.empty(b * h_kv, splits, group_pad, dtype=torch.float32, device=device)
    run_sum = torch.empty_like(run_max)
    logits = (torch.full((b, h_kv, group, n), -math.inf, dtype=torch.float32, device=device)
              if return_probs else run_max)  # any tensor when unused
    _per_head_decode_kernel[(b * h_kv, splits)](
        q.contiguous(), k, v, k_scales if k_scales is not None else k, v_scales if v_scales is not None else v,
        units, lens, acc, run_max, run_sum, logits, scale, n, splits,
        num_kv_heads=h_kv, group=group, group_pad=group_pad, dim=d, dim_v=d_v, split_n=split_n,
        block_n=block_n, fp8_type=_FP8_TYPES.get(fp8 or "fp8_e4m3"), is_fp8=fp8 is not None,
        store_logits=return_probs,
    )
    # Merge the splits (flash-decoding): rescale each split's output to the global max.
    top = run_max.amax(dim=1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)
    weight = torch.exp(run_max - top)  # 0 for an empty split
    total = (run_sum * weight).sum(dim=1)  # [B x H_kv, G']
    merged = (acc * weight[..., None]).sum(dim=1) / total.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    out = merged[:, :group].reshape(b, h_q, d_v).to(q.dtype)
    if not return_probs:
        return out
    norm = (top.squeeze(1) + torch.log(total.clamp_min(torch.finfo(torch.float32).tiny)))[:, :group]
    probs = torch.exp(logits - norm.reshape(b, h_kv, group, 1))  # exp(-inf) = 0 at padding
    return out, probs
