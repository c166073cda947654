"""Triton: a decode step's attention added to its requests' statistics, one launch per layer.

The CUDA path of `core/stat_slab.add_attention` for policies whose statistic adds a power of the
attention (`Policy.contribution_power`: H2O and Batch-Max sum_g p, KV-Compress sum_g p^2, eq. 20):
from the decode kernel's scaled logits and log-sum-exp (`triton_per_head.py`), each program takes
one (request, KV head, block of columns), forms p = exp(logit - lse) for the G query heads of the
group, and adds sum_g p^power to the request's columns of the step's slab [H_kv, L, total]. One
launch for a whole group of requests, whatever their number, instead of a softmax, a gather and a
scatter-add per group (and it never writes the probabilities).

Without a GPU it runs under Triton's interpreter in the tests (`tests/core/test_stat_slab.py`),
against the torch version it replaces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from sgl_kvc.core.stat_group import StatGroup
    from sgl_kvc.kernels.per_head_attention import DecodeLogits

BLOCK = 128  # columns per program


@triton.jit
def _add_contribution_kernel(
    logits_ptr, lse_ptr, slab_ptr, rows_ptr, lse_rows_ptr, starts_ptr, lens_ptr,
    n_cols, head_stride, layer_offset,
    num_kv_heads: tl.constexpr, group: tl.constexpr, group_pad: tl.constexpr, power: tl.constexpr,
    block: tl.constexpr,
):
    m = tl.program_id(0)  # member of the group
    h = tl.program_id(1)
    cols = tl.program_id(2) * block + tl.arange(0, block)
    length = tl.load(lens_ptr + m)
    ok = (cols < length) & (cols < n_cols)  # past a layer's table width: nothing attended
    row = tl.load(rows_ptr + m)
    lse_row = tl.load(lse_rows_ptr + m)
    g = tl.arange(0, group_pad)
    g_ok = g < group
    logit_rows = ((row * num_kv_heads + h) * group + g) * n_cols
    logits = tl.load(logits_ptr + logit_rows[:, None] + cols[None, :], mask=g_ok[:, None] & ok[None, :],
                     other=float("-inf"))
    lse = tl.load(lse_ptr + (lse_row * num_kv_heads + h) * group + g, mask=g_ok, other=0.0)
    p = tl.exp(logits - lse[:, None])  # 0 where masked
    if power == 2:
        p = p * p
    added = tl.sum(p, axis=0)
    at = slab_ptr + h * head_stride + layer_offset + tl.load(starts_ptr + m) + cols
    tl.store(at, tl.load(at, mask=ok, other=0.0) + added, mask=ok)


def add_contribution(slab: torch.Tensor, local_layer: int, group: "StatGroup", logits: "DecodeLogits") -> None:
    """slab [H_kv, L, total] (contiguous) += the group's contribution in layer `local_layer`
    (its policy's `contribution_power` is 1 or 2)."""
    if not group.max_len:
        return
    h_kv, layers, total = slab.shape
    g, n = int(logits.logits.shape[2]), int(logits.logits.shape[3])
    grid = (int(group.rows.shape[0]), h_kv, triton.cdiv(group.max_len, BLOCK))
    _add_contribution_kernel[grid](
        logits.logits, logits.lse, slab, group.rows, group.lse_rows, group.starts, group.lens,
        n, layers * total, local_layer * total,
        num_kv_heads=h_kv, group=g, group_pad=max(2, triton.next_power_of_2(g)),
        power=group.policy.contribution_power, block=BLOCK,
    )
