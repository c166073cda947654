"""FP8 KV storage inside SGLang: a KV pool with one scale per (token, KV head), and its sizing.

What SGLang 0.5.23 does by itself: `--kv-cache-dtype fp8_e4m3` stores FP8 with one scale per
layer (the checkpoint's, else 1.0) and, on a CPU without Intel AMX, refuses to start
("CPU FP8 KV cache requires Intel AMX support", `mem_cache/kv_cache_configurator.py`). So the
launcher hands SGLang `--kv-cache-dtype auto` (the model's dtype) and tells this plugin the real
choice through `KvcConfig.kv_cache_dtype`; here:

* `KvcFp8TokenToKVPool` replaces `MHATokenToKVPool` (through the configurator's pool-class
  resolution, the extension point SGLang offers platforms, `KVCacheConfigurator.
  _resolve_kv_pool_class`). It stores uint8 FP8 codes `[slots, H_kv, D]` and scales `[slots,
  H_kv]` per layer, quantizes in `set_kv_buffer` with scales computed from the rows written,
  and returns from `get_key_buffer` / `get_value_buffer` an `Fp8Rows` that dequantizes only the
  rows it is indexed with: SGLang's torch-native attention (`k_cache[slot_ids]`), the eviction
  policies' scoring (`pool.get_key_buffer(layer)[slots]`) and compaction's moves
  (`buf[dst, heads] = buf[src, heads]`, codes and scales as they are) all work unchanged, and no
  dequantized copy of the cache is ever made.
* The pool's bytes per token (codes + scales) replace SGLang's per-token cost in its sizing
  (`DefaultPoolConfigurator._compute_cell_size`), so the same memory budget buys about twice
  the tokens, minus the scales.
* `--kv-cache-memory-gb` (any dtype) fixes the KV pool's byte budget instead of profiling free
  memory (`KVCacheConfigurator._profile_available_bytes`): on CPU the free memory of a shared
  machine moves from one start to the next, so capacity is only comparable at a fixed budget.

Attention backends: the pool serves SGLang's torch-native backend, which reads KV by indexing the
buffer (CPU, and CUDA with `--attention-backend torch_native`), and its Triton backend (the
launcher's choice for FP8 on CUDA), whose decode kernel call is sgl-kvc's kernel and whose extend
kernel reads the prefix rows dequantized (`adapter/attention.py`, `TritonKernelMixin`). FlashInfer
takes raw paged buffers; the launcher refuses that combination rather than give wrong answers.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, unwrap_write_loc

from sgl_kvc.adapter.sglang_api import Hook
from sgl_kvc.config import KvcConfig
from sgl_kvc.kernels.fp8 import DEFAULT_SCALE_FORMAT, Fp8Rows, bytes_per_token, fp8_spec

logger = logging.getLogger(__name__)

_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
_POOL_CONFIGURATOR = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator"
_GB = 1 << 30


class KvcFp8TokenToKVPool(MHATokenToKVPool):
    """MHA/GQA KV pool in FP8 with per-(token, KV head) scales. `dtype` (what readers get) is
    the model's dtype; storage is uint8 codes plus scales (`scale_format`)."""

    kvc_fp8: str = "fp8_e4m3"
    kvc_scale_format: str = DEFAULT_SCALE_FORMAT

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("quant_method", None)  # this pool quantizes by itself
        kwargs["post_capture_active"] = False  # CUDA-VMM late backing: not for this layout
        kwargs["kv_cache_layout"] = "nhd"
        super().__init__(*args, **kwargs)

    # --- sizes ----------------------------------------------------------------------------
    @classmethod
    def bytes_per_token(cls, head_num: int, head_dim: int, v_head_dim: int, layer_num: int) -> int:
        return bytes_per_token(head_num, head_dim, v_head_dim, layer_num, cls.kvc_scale_format)

    @property
    def kvc_bytes_per_token(self) -> int:
        return self.bytes_per_token(self.head_num, self.head_dim, self.v_head_dim, self.layer_num)

    @property
    def kvc_dtype_name(self) -> str:
        return self.kvc_fp8

    @property
    def kvc_scale_description(self) -> str:
        return f"per (token, kv head), {self.kvc_scale_format}"

    # --- buffers --------------------------------------------------------------------------
    def _create_buffers(self) -> None:
        from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE

        self.store_dtype = torch.uint8
        rows = self.size + self.page_size  # slot 0's page absorbs padded-token writes
        kw = dict(fp8=self.kvc_fp8, scale_format=self.kvc_scale_format, dtype=self.dtype,
                  device=self.device)
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
            self._kvc_k, self._kvc_v = self._allocate_rows(rows, **kw)
        # The raw tensors under SGLang's names: its byte accounting (`get_kv_size_bytes`,
        # which counts the scale buffers too), data pointers and slot moves see codes + scales.
        self.k_buffer = [r.codes for r in self._kvc_k]
        self.v_buffer = [r.codes for r in self._kvc_v]
        self.k_scale_buffer = [r.scales for r in self._kvc_k]
        self.v_scale_buffer = [r.scales for r in self._kvc_v]
        self.native_k_scale_buffer = self.native_v_scale_buffer = None
        self.dq_k_buffer = self.dq_v_buffer = None
        self._kv_buffer_descs = self._build_kv_buffer_descs()
        self._init_data_ptrs_and_strides()

    def _allocate_rows(self, rows: int, **kw: Any) -> tuple[list[Fp8Rows], list[Fp8Rows]]:
        """Per-layer K and V buffers of `rows` slots (one allocation per layer here)."""
        k = [Fp8Rows.empty(rows, self.head_num, self.head_dim, **kw) for _ in range(self.layer_num)]
        v = [Fp8Rows.empty(rows, self.head_num, self.v_head_dim, **kw) for _ in range(self.layer_num)]
        return k, v

    def _finalize_allocation_log(self, num_tokens: int) -> None:
        super()._finalize_allocation_log(num_tokens)  # SGLang's line names the model dtype
        logger.info(
            "sgl-kvc FP8 KV cache: %s codes + %s scales per (token, kv head), %d tokens, "
            "%d bytes per token, %.4f GB", self.kvc_fp8, self.kvc_scale_format, num_tokens,
            self.kvc_bytes_per_token, pool_bytes(self) / _GB,
        )

    # --- reads: lazily dequantizing views -------------------------------------------------
    def _get_key_buffer(self, layer_id: int) -> Fp8Rows:  # type: ignore[override]
        return self._kvc_k[layer_id - self.start_layer]

    def _get_value_buffer(self, layer_id: int) -> Fp8Rows:  # type: ignore[override]
        return self._kvc_v[layer_id - self.start_layer]

    def get_key_buffer(self, layer_id: int) -> Fp8Rows:  # type: ignore[override]
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(layer_id - self.start_layer)
        return self._get_key_buffer(layer_id)

    def get_value_buffer(self, layer_id: int) -> Fp8Rows:  # type: ignore[override]
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(layer_id - self.start_layer)
        return self._get_value_buffer(layer_id)

    def get_kv_buffer(self, layer_id: int) -> tuple[Fp8Rows, Fp8Rows]:  # type: ignore[override]
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    # --- writes: quantize as stored -------------------------------------------------------
    def set_kv_buffer(
        self, layer: Any, loc_info: Any, cache_k: torch.Tensor, cache_v: torch.Tensor,
        k_scale: Any = None, v_scale: Any = None, layer_id_override: int | None = None,
        dcp_kv_mask: Any = None,
    ) -> None:
        # k_scale / v_scale are a checkpoint's static per-layer FP8 scales; this pool computes
        # its scales from the data, so they are not used.
        i, loc = write_target(self, layer, loc_info, layer_id_override, dcp_kv_mask, "sgl-kvc FP8 pool")
        self._kvc_k[i].store(loc, cache_k)
        self._kvc_v[i].store(loc, cache_v)

    # --- retraction offload (codes and scales travel together) ------------------------------
    def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None):
        out = []
        for k, v in zip(self._kvc_k, self._kvc_v):
            out.append([(r.codes[indices].cpu(), r.scales[indices].cpu()) for r in (k, v)])
        return out

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None, req_pool_index=None):
        for (k, v), saved in zip(zip(self._kvc_k, self._kvc_v), kv_cache_cpu):
            for rows, (codes, scales) in zip((k, v), saved):
                rows.codes[indices] = codes.to(rows.codes.device)
                rows.scales[indices] = scales.to(rows.scales.device)


@functools.cache
def fp8_pool_class(
    fp8: str, scale_format: str = DEFAULT_SCALE_FORMAT, base: type | None = None
) -> type[KvcFp8TokenToKVPool]:
    """The pool class for one FP8 format (SGLang builds pools from a class and its kwargs);
    `base`: a subclass of `KvcFp8TokenToKVPool` with another layout (the unit pool's)."""
    fp8_spec(fp8)  # validates
    base = base or KvcFp8TokenToKVPool
    name = f"KvcFp8{fp8.removeprefix('fp8_').upper()}{base.__name__.removeprefix('KvcFp8')}"
    return type(name, (base,), {"kvc_fp8": fp8, "kvc_scale_format": scale_format})


def write_target(
    pool: MHATokenToKVPool, layer: Any, loc_info: Any, layer_id_override: int | None, dcp_kv_mask: Any,
    what: str,
) -> tuple[int, torch.Tensor]:
    """(this rank's layer index, slots) of a `set_kv_buffer` call on one of sgl-kvc's pools,
    which write by indexing (what SGLang's own write checks, then unwraps)."""
    if dcp_kv_mask is not None:
        raise NotImplementedError(f"{what}: decode context parallelism is not supported")
    pool._check_physical_write_loc(loc_info, f"set_kv_buffer ({what})")
    loc, _, _ = unwrap_write_loc(loc_info)
    layer_id = layer_id_override if layer_id_override is not None else layer.layer_id
    return layer_id - pool.start_layer, loc


def pool_bytes(pool: Any) -> int:
    """Bytes of the pool's K and V buffers (codes and scales for FP8), as SGLang counts them;
    0 for a pool that does not say."""
    try:
        sizes = pool.get_kv_size_bytes()
        return int(sum(sizes) if isinstance(sizes, tuple) else sizes)
    except Exception:  # pools of other layouts
        return 0


# --- hooks ---------------------------------------------------------------------------------
def _plain_mha(kvc: Any) -> bool:
    return not (kvc.use_mla_backend or kvc.is_hybrid_swa or kvc.mambaish_config is not None)


def hook_table(config: KvcConfig, pool_cls: type[KvcFp8TokenToKVPool] | None = None) -> list[Hook]:
    """`pool_cls`: the FP8 pool to install (default: `fp8_pool_class` of the config's format;
    the unit pool's FP8 variant under `--kv-head-budget variable`)."""
    hooks: list[Hook] = []
    if config.kv_cache_memory_gb is not None:
        hooks.append(Hook(f"{_CONFIGURATOR}._profile_available_bytes", _around_profile(config.kv_cache_memory_gb),
                          "AROUND", (), "--kv-cache-memory-gb fixes the KV budget"))
    if config.fp8_kv is not None:
        pool_cls = pool_cls or fp8_pool_class(config.fp8_kv)
        hooks += [
            Hook(f"{_CONFIGURATOR}._resolve_kv_pool_class", after_resolve(pool_cls), "AFTER", ("kind",),
                 "the FP8 pool class"),
            Hook(f"{_POOL_CONFIGURATOR}._compute_cell_size", _around_cell_size(pool_cls), "AROUND",
                 ("kvc", "num_layers"), "bytes per token of the FP8 pool"),
            Hook(f"{_CONFIGURATOR}.configure", after_configure(pool_cls, f"--kv-cache-dtype {config.fp8_kv}"),
                 "AFTER", (), "refuse a model that got another pool"),
        ]
    return hooks


def _around_profile(gb: float):
    def hook(original: Callable[..., Any], kvc: Any, *args: Any, **kwargs: Any) -> int:
        budget = int(gb * _GB)
        logger.info("sgl-kvc: KV pool budget fixed at %.4f GB (--kv-cache-memory-gb)", gb)
        return budget

    return hook


def after_resolve(pool_cls: type):
    """Hook: SGLang's plain MHA pool class -> `pool_cls` (sgl-kvc's pools of that layout)."""

    def hook(result: type, kvc: Any, *args: Any, kind: str | None = None, **kwargs: Any) -> type:
        if kind == "mha" and result is MHATokenToKVPool and _plain_mha(kvc) and not kvc.is_draft_worker:
            return pool_cls
        return result

    return hook


def _around_cell_size(pool_cls: type):
    def hook(original: Callable[..., Any], self: Any, kvc: Any, num_layers: int, *a: Any, **kw: Any) -> int:
        cell = original(self, kvc, num_layers, *a, **kw)
        if not _plain_mha(kvc) or kvc.is_draft_worker:
            return cell
        from sglang.srt.runtime_context import get_parallel

        mc = kvc.model_config
        heads = mc.get_num_kv_heads(get_parallel().attn_tp_size, get_parallel().attn_dcp_size)
        plain = heads * (mc.head_dim + mc.v_head_dim) * num_layers * kvc.kv_cache_dtype.itemsize
        fp8 = pool_cls.bytes_per_token(heads, mc.head_dim, mc.v_head_dim, num_layers)
        logger.info("sgl-kvc: %s KV pool, %d bytes per token (%d at %s)", pool_cls.kvc_fp8, fp8,
                    plain, kvc.kv_cache_dtype)
        return cell - plain + fp8

    return hook


def after_configure(pool_cls: type, what: str):
    """Hook: refuse to start when `what` (a flag) asked for `pool_cls` and the model got
    another pool (not a plain MHA/GQA model)."""

    def hook(result: Any, kvc: Any, *args: Any, **kwargs: Any) -> Any:
        pool = result.token_to_kv_pool
        if not kvc.is_draft_worker and not isinstance(pool, pool_cls):
            raise RuntimeError(
                f"{what}: sgl-kvc's {pool_cls.__name__} serves plain MHA/GQA models only; this "
                f"model got {type(pool).__name__}"
            )
        return result

    return hook
