"""The unit pool: SGLang's KV pool as one allocation of (token slot, layer, KV head) units.

KV-Compress's variable allocation (§4.2) lets each (layer, KV head) of a request keep its own
number of entries, within one total for the request. For the evicted entries to free real
memory, a slot must be able to hold kept entries of ANY layer and head: this pool allocates
K [S+1, L, H_kv, d] and V [S+1, L, H_kv, d_v] once (the same bytes as SGLang's per-layer
buffers) and gives SGLang the per-layer views K[:, l] ([S+1, H_kv, d], strided), so prefill,
uncompressed requests and `set_kv_buffer` work as on SGLang's own pool. `K.view(-1, d)` is the
flat unit pool: slot t, layer l (of this rank), head h is unit (t x L + l) x H_kv + h
(`state.unit_index`). A packed request's kept entries fill its first G = ceil(total / (L x H_kv))
slots unit by unit (`compaction.prepare_units`), and the batched decode kernel reads
them through per-head tables (`state.RequestTables`). Slots stay SGLang's allocation unit, so
its accounting, admission and retraction are unchanged.

With `--kv-cache-dtype fp8_*` the FP8 variant (`KvcFp8UnitTokenToKVPool`) lays out the FP8
pool's codes the same way (uint8 [S+1, L, H_kv, d]) with its per-(token, KV head) scales beside
them ([S+1, L, H_kv]): a unit is then one code row and its scale, so a packed request's entries
move as they are (no re-quantization) and the flat unit pool is an `Fp8Rows` that dequantizes
only the units it is indexed with.

Installed with `--kv-head-budget policy` (the default where a server can have it), `layer` or
`variable` (`hook_table`; the FP8 variant by `fp8_pool.hook_table`), through the same pool-class
resolution hook as the FP8 pool.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from torch import Tensor

from sgl_kvc.adapter.memory.fp8_pool import KvcFp8TokenToKVPool, after_configure, after_resolve, fp8_pool_class, write_target
from sgl_kvc.adapter.sglang_api import Hook
from sgl_kvc.config import KvcConfig
from sgl_kvc.kernels.fp8 import Fp8Rows

_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"


class KvcUnitTokenToKVPool(MHATokenToKVPool):
    """MHA/GQA pool whose layers share one allocation per K and V (see the module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["post_capture_active"] = False  # CUDA-VMM late backing: not for this layout
        kwargs["kv_cache_layout"] = "nhd"
        super().__init__(*args, **kwargs)

    def _create_buffers_normal(self) -> None:
        from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE

        rows = self.size + self.page_size  # slot 0's page absorbs padded-token writes
        shape = (rows, self.layer_num, self.head_num)
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
            self.kvc_k_units = torch.zeros((*shape, self.head_dim), dtype=self.store_dtype, device=self.device)
            self.kvc_v_units = torch.zeros((*shape, self.v_head_dim), dtype=self.store_dtype, device=self.device)
        self.k_buffer = list(self.kvc_k_units.unbind(1))
        self.v_buffer = list(self.kvc_v_units.unbind(1))

    def set_kv_buffer(
        self, layer: Any, loc_info: Any, cache_k: Tensor, cache_v: Tensor, k_scale: Any = None,
        v_scale: Any = None, layer_id_override: int | None = None, dcp_kv_mask: Any = None,
    ) -> None:
        """Write by indexing: SGLang's fused store kernels (CUDA; CPU with AMX) take a layer's
        rows as contiguous, and this pool's per-layer rows are strided."""
        i, loc = write_target(self, layer, loc_info, layer_id_override, dcp_kv_mask, "sgl-kvc unit pool")
        if cache_k.dtype != self.dtype:  # a checkpoint's static scales, as SGLang applies them
            cache_k = (cache_k if k_scale is None else cache_k / k_scale).to(self.dtype)
            cache_v = (cache_v if v_scale is None else cache_v / v_scale).to(self.dtype)
        if self.store_dtype != self.dtype:
            cache_k, cache_v = cache_k.view(self.store_dtype), cache_v.view(self.store_dtype)
        self.k_buffer[i][loc] = cache_k
        self.v_buffer[i][loc] = cache_v

    def unit_buffers(self) -> tuple[Tensor, Tensor]:
        """The flat unit pools K [U, d] and V [U, d_v] in the model's dtype (free views)."""
        k, v = self.kvc_k_units, self.kvc_v_units
        if self.store_dtype != self.dtype:
            k, v = k.view(self.dtype), v.view(self.dtype)
        return k.view(-1, self.head_dim), v.view(-1, self.v_head_dim)


class KvcFp8UnitTokenToKVPool(KvcFp8TokenToKVPool):
    """The FP8 pool (per-(token, KV head) scales) with the unit layout: one codes allocation
    [S+1, L, H_kv, d] and one scales allocation [S+1, L, H_kv] per K and V, whose per-layer
    views are the `Fp8Rows` SGLang and sgl-kvc read and write (see the module doc)."""

    def _allocate_rows(self, rows: int, **kw: Any) -> tuple[list[Fp8Rows], list[Fp8Rows]]:
        k_all = Fp8Rows.empty(rows, self.layer_num * self.head_num, self.head_dim, **kw)
        v_all = Fp8Rows.empty(rows, self.layer_num * self.head_num, self.v_head_dim, **kw)
        self.kvc_units = (_flat(k_all), _flat(v_all))
        layers = range(self.layer_num)
        return [_layer(k_all, self.layer_num, i) for i in layers], [_layer(v_all, self.layer_num, i) for i in layers]

    def unit_buffers(self) -> tuple[Fp8Rows, Fp8Rows]:
        """The flat unit pools K and V: `Fp8Rows` of codes [U, d] and scales [U] (free views);
        indexing one dequantizes only the units it names, as the bf16 pool's [U, d] reads."""
        return self.kvc_units


def _layer(rows: Fp8Rows, num_layers: int, layer: int) -> Fp8Rows:
    """Layer `layer` of a [S, L x H, d] buffer, as the [S, H, d] rows (strided views) SGLang uses."""
    s, lh, d = rows.codes.shape
    codes = rows.codes.view(s, num_layers, lh // num_layers, d)[:, layer]
    scales = rows.scales.view(s, num_layers, lh // num_layers)[:, layer]
    return Fp8Rows(codes, scales, rows.fp8, rows.scale_format, rows.dtype)


def _flat(rows: Fp8Rows) -> Fp8Rows:
    """One unit per row: codes [S x L x H, d], scales [S x L x H] (free views)."""
    d = rows.codes.shape[-1]
    return Fp8Rows(rows.codes.view(-1, d), rows.scales.view(-1), rows.fp8, rows.scale_format, rows.dtype)


def fp8_unit_pool_class(config: KvcConfig) -> type[KvcFp8UnitTokenToKVPool] | None:
    """The FP8 pool `--kv-head-budget variable` needs (None: not variable, or not FP8)."""
    if not config.variable_budget or config.fp8_kv is None:
        return None
    return fp8_pool_class(config.fp8_kv, base=KvcFp8UnitTokenToKVPool)


def unsupported_model(model: Any, is_encoder_decoder: bool, flag: str) -> str | None:
    """Why the unit pool cannot serve `model` (its attention layers, as SGLang built them), in
    one line; None if it can. sgl-kvc's batched kernel reads packed requests through per-head
    tables; a layer it does not serve (a logit cap, a sliding window, cross-attention to encoder
    tokens) falls back to SGLang's loop, which reads packed slots as per-layer rows."""
    if is_encoder_decoder:
        return f"{flag} does not support encoder-decoder models (cross-attention to encoder tokens)"
    for module in model.modules():
        if not hasattr(module, "logit_cap") or not hasattr(module, "layer_id"):
            continue  # not an attention layer (SGLang's RadixAttention has both)
        window = getattr(module, "sliding_window_size", None)
        why = ("a logit cap" if getattr(module, "logit_cap", 0) else
               f"a sliding window of {window}" if window is not None and window >= 0 else
               "cross-attention" if getattr(module, "is_cross_attention", False) else None)
        if why:
            return (f"{flag} does not support this model: its attention layer {module.layer_id} uses "
                    f"{why}, which sgl-kvc's per-head decode kernel does not implement "
                    "(--kv-head-budget uniform serves it)")
    return None


def _refuse_unsupported_model(flag: str) -> Callable[..., Any]:
    def hook(result: Any, kvc: Any, *args: Any, **kwargs: Any) -> Any:
        if not kvc.is_draft_worker:
            problem = unsupported_model(kvc.model, bool(getattr(kvc.model_config, "is_encoder_decoder", False)), flag)
            if problem:
                raise SystemExit(f"sgl-kvc: {problem}")
        return result

    return hook


def hook_table(config: KvcConfig) -> list[Hook]:
    """Variable budgets: refuse a model the unit pool cannot serve; in the model's dtype, the
    unit pool class (FP8: `fp8_pool.hook_table(config, fp8_unit_pool_class(config))`)."""
    if not config.variable_budget:
        return []
    flag = f"--kv-head-budget {config.kv_head_budget}"
    hooks = [Hook(f"{_CONFIGURATOR}.configure", _refuse_unsupported_model(flag), "AFTER", (),
                  "refuse a model the unit pool's kernel does not serve")]
    if config.fp8_kv is None:
        hooks += [
            Hook(f"{_CONFIGURATOR}._resolve_kv_pool_class", after_resolve(KvcUnitTokenToKVPool), "AFTER",
                 ("kind",), "the unit pool class"),
            Hook(f"{_CONFIGURATOR}.configure", after_configure(KvcUnitTokenToKVPool, flag), "AFTER", (),
                 "refuse a model that got another pool"),
        ]
    return hooks
