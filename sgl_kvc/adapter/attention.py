"""The attention backend: SGLang's own backend for the device, with this project's layer on top.

Why wrap instead of registering a new backend name: SGLang 0.5.23 compares the backend *name*
in about eighty places (`"torch_native"` switches off Triton helpers on CPU, `"flashinfer"`
selects its planners, ...). A new name would silently take the wrong branch in many of them.
So `register()` re-registers the factories of the backends this project runs on, under their
own names, to build the same object with `KvcAttentionMixin`'s members added to its class.

The layer leaves prefill attention to SGLang (page size 1 over `req_to_token`, so a compacted
row is just shorter) and, when a compressing policy is active, records what the policies need
after each call: the last `window` queries of every request and, for policies with attention
statistics (H2O, Batch-Max, KV-Compress), the softmax attention of new queries.

Decode attention on the CPU backend (`torch_native`) is sgl-kvc's batched kernel
(`sgl_kvc.core.decode`) instead of SGLang's loop over requests, unless
`--kv-decode-attention sglang`: it replaces only the backend's inner SDPA loop, so SGLang still
writes the new token's KV, and it hands the attention it computed to the statistics. FlashInfer
keeps its kernel; statistics are then computed beside it. SGLang's Triton backend (CUDA without
FlashInfer, and AMD) keeps its kernels for SGLang's own pool (uniform budgets, as FlashInfer);
over the unit pool (variable and layer budgets) and the FP8 pool, whose layouts its kernels
cannot read, its decode kernel call is sgl-kvc's (`TritonKernelMixin`). An extend of a packed
request (variable budgets, the next chunk of a prompt compacted between chunks) attends through
its per-head tables (`KvcStore.attend_extend`); the batch's other requests keep SGLang's extend.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, Callable

import torch

from sgl_kvc.adapter.safety import failpoints
from sgl_kvc.core.graph_step import GraphStep
from sgl_kvc.core.reconstruction import ForwardAttention
from sgl_kvc.core.store import KvcStore
from sgl_kvc.kernels.attention_lse import has_fused_cpu
from sgl_kvc.kernels.extend_attention import prefix_extend_attention, scored_extend_attention
from sgl_kvc.kernels.fp8 import Fp8Rows

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Backends sgl-kvc runs on (the launcher's choice per device: CPU torch_native; CUDA flashinfer,
# or triton where FlashInfer is not installed or the pool is sgl-kvc's own).
WRAPPED_BACKENDS: tuple[str, ...] = ("torch_native", "flashinfer", "triton")


class KvcAttentionMixin:
    """Members copied into the wrapped backend class (see `_kvc_class`)."""

    kvc_wrapped_name: str = ""
    kvc_base: type = object
    kvc_store: KvcStore | None = None
    kvc_attends: bool = False  # whether sgl-kvc's kernel can run this class's decode attention
    _kvc_attend_layer: Any = None  # the layer whose decode attention the kernel runs now
    _kvc_decode_batch: Any = None  # its forward batch (a graph step reads its rows and lengths)
    _kvc_extend: Any = None  # (layer, forward batch) of an extend with packed requests, while it runs

    @property
    def kvc_name(self) -> str:
        return f"sgl_kvc({self.kvc_wrapped_name})"

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        store = self.kvc_store
        ours = store is not None and (store.extend_tables or store.reconstruction is not None)
        self._kvc_extend = (layer, forward_batch) if ours else None
        try:
            out = self.kvc_base.forward_extend(
                self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs
            )
        finally:
            self._kvc_extend = None
        if store is not None and save_kv_cache:
            _observe(_observe_extend, store, q, layer, forward_batch)
        return out

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        store = self.kvc_store
        attend = store is not None and _kernel_attends(store, q, layer, forward_batch)
        self._kvc_attend_layer = layer if attend else None
        self._kvc_decode_batch = forward_batch if attend else None
        try:
            out = self.kvc_base.forward_decode(
                self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs
            )
        finally:
            self._kvc_attend_layer = self._kvc_decode_batch = None
        if store is not None and save_kv_cache:
            _observe(_observe_decode, store, q, layer, forward_batch, attend)
        return out


class TorchNativeKernelMixin:
    """`torch_native`'s inner loops (sglang 0.5.23): decode (`_run_sdpa_forward_decode`) replaced
    by the batched kernel while `forward_decode` has chosen it for this layer; extend
    (`_run_sdpa_forward_extend`) through per-head tables for the packed requests of the batch, and
    for a reconstruction forward's rows over their prefix without SGLang's padded prefix rows."""

    def _run_sdpa_forward_extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                                 seq_lens, extend_prefix_lens, extend_seq_lens, *args, **kwargs):
        current = self._kvc_extend
        if current is None:
            return self.kvc_base._run_sdpa_forward_extend(
                self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                extend_prefix_lens, extend_seq_lens, *args, **kwargs,
            )
        layer, fb = current
        store = self.kvc_store
        round_ = store.reconstruction
        reconstruction = round_.rows if round_ is not None else {}
        start = 0
        for i, (row, e) in enumerate(zip(store.extend_rows, fb.extend_seq_lens_cpu)):
            stop = start + e
            if e and row in store.extend_tables:
                output[start:stop] = store.attend_extend(
                    layer.layer_id, row, query[start:stop], fb.positions[start:stop], layer.scaling
                )
            elif e and row in reconstruction:  # a KVzip reconstruction forward: its new rows only
                output[start:stop] = _reconstruction_attention(
                    round_, store, layer, row, query[start:stop], k_cache, v_cache, req_to_token,
                    fb.extend_prefix_lens_cpu[i],
                )
            elif e:  # SGLang's loop, for this request alone
                self.kvc_base._run_sdpa_forward_extend(
                    self, query[start:stop], output[start:stop], k_cache, v_cache, req_to_token,
                    req_pool_indices[i : i + 1], seq_lens[i : i + 1], extend_prefix_lens[i : i + 1],
                    extend_seq_lens[i : i + 1], *args, **kwargs,
                )
            start = stop
        return output

    def _run_sdpa_forward_decode(self, query, output, k_cache, v_cache, *args, **kwargs):
        layer = self._kvc_attend_layer
        if layer is None:
            return self.kvc_base._run_sdpa_forward_decode(
                self, query, output, k_cache, v_cache, *args, **kwargs
            )
        store = self.kvc_store
        # SGLang passes (req_to_token, req_pool_indices, seq_lens, ...) after the caches
        store.attend_decode(layer.layer_id, store.decode_step, query, k_cache, v_cache, layer.scaling, output,
                            rows=args[1], seq_lens=args[2])
        return output


class TritonKernelMixin:
    """SGLang's Triton backend (sglang 0.5.23): its kernels read a layer's K and V buffers as
    tensors through `kv_indices`. Over sgl-kvc's pools that is not enough: the FP8 pool's
    buffers are `Fp8Rows` (codes and scales) and a packed request's heads hold different
    entries. So the decode kernel call (`decode_attention_fwd`, an instance attribute SGLang sets
    in `__init__`, replaced in `_wrap`) is sgl-kvc's kernel while the step planned it
    (`_kvc_attend_layer`), and both calls read an FP8 pool's rows dequantized (`dense_rows`);
    a packed request's extend output is its per-head tables' attention."""

    @property
    def kvc_attends(self) -> bool:
        # SGLang's own pool: its kernel (statistics beside it, as on FlashInfer). sgl-kvc's
        # pools: sgl-kvc's kernel, which reads them.
        return _kvc_pool(self.token_to_kv_pool)

    def _forward_extend_kernel(self, layer, q, k, v, o, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
                               *args, **kwargs):
        if isinstance(k_buffer, Fp8Rows):
            k_buffer, v_buffer, kv_indices = dense_rows(k_buffer, v_buffer, kv_indices)
        out = self.kvc_base._forward_extend_kernel(
            self, layer, q, k, v, o, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, *args, **kwargs
        )
        current = self._kvc_extend
        if current is not None:
            _packed_extend(self.kvc_store, current[0], current[1], q, o)
        return out


def _kvc_pool(pool: Any) -> bool:
    """Whether `pool` is one of sgl-kvc's: the FP8 pool (`kvc_fp8`) or the unit pool of variable
    and layer budgets (`unit_buffers`), in either dtype."""
    return hasattr(pool, "kvc_fp8") or hasattr(pool, "unit_buffers")


def dense_rows(k_rows: Any, v_rows: Any, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows `indices` of an FP8 pool's layer, dequantized, for a kernel that reads tensors:
    (K, V, new indices into them). Only what the call reads is dequantized; an empty read keeps
    one row so the kernel gets a real buffer."""
    idx = indices.long()
    if idx.numel() == 0:
        idx = idx.new_zeros(1)
    keys, values = k_rows[idx].as_subclass(torch.Tensor), v_rows[idx].as_subclass(torch.Tensor)
    return keys, values, torch.arange(indices.numel(), device=indices.device, dtype=indices.dtype)


def _packed_extend(store: KvcStore, layer: Any, fb: Any, q: torch.Tensor, o: torch.Tensor) -> None:
    """Overwrite the packed requests' rows of an extend output with their per-head tables'
    attention (SGLang's kernel read their rows as if every head held the same entries)."""
    start = 0
    for row, e in zip(store.extend_rows, fb.extend_seq_lens_cpu):
        stop = start + e
        if e and row in store.extend_tables:
            o[start:stop] = store.attend_extend(
                layer.layer_id, row, q[start:stop], fb.positions[start:stop], layer.scaling
            )
        start = stop


def _triton_decode(backend: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """The Triton backend's decode kernel call, as `TritonKernelMixin` says."""

    def decode(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, *args, **kwargs):
        layer = backend._kvc_attend_layer
        if layer is not None:
            store, fb = backend.kvc_store, backend._kvc_decode_batch
            store.attend_decode(layer.layer_id, store.decode_step, q, k_buffer, v_buffer, layer.scaling, o,
                                rows=fb.req_pool_indices, seq_lens=fb.seq_lens)
            return None
        if isinstance(k_buffer, Fp8Rows):
            k_buffer, v_buffer, kv_indices = dense_rows(k_buffer, v_buffer, kv_indices)
        return original(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, *args, **kwargs)

    # As SGLang's own call: kept out of torch.compile's graphs (`--enable-torch-compile`).
    disabled = torch.compiler.disable(decode)
    disabled.__sgl_kvc__ = True  # type: ignore[attr-defined]
    return disabled


def _reconstruction_attention(round_: Any, store: KvcStore, layer: Any, row: int, query: torch.Tensor,
                              k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                              prefix: int) -> torch.Tensor:
    """A reconstruction row's attention over its prefix and its new tokens. Where the kernel can,
    it also returns its score softmax's normalizer (the scored columns apart), which the layer's
    fold then takes, with the keys gathered here, instead of a pass and a gather of its own."""
    slots = req_to_token[row, : prefix + query.shape[0]]
    keys, values = k_cache[slots], v_cache[slots]
    scored = None
    if has_fused_cpu(query.device) and round_.rows[row].prefix == prefix:
        try:
            scored = round_.scored_columns(store, layer.layer_id, row)
        except Exception:  # noqa: BLE001 - the fold computes the normalizer itself
            logger.exception("sgl-kvc: row %s's scored columns failed in layer %s", row, layer.layer_id)
    if scored is None:
        return prefix_extend_attention(query, keys, values, prefix, layer.scaling)
    out, lse = scored_extend_attention(query, keys, values, prefix, layer.scaling, scored.to(keys.device))
    round_.given[(row, layer.layer_id)] = ForwardAttention(keys, lse)
    return out


def _kernel_attends(store: KvcStore, q: Any, layer: Any, fb: ForwardBatch) -> bool:
    """Whether this layer's decode attention is the batched kernel's: the step was planned
    for it, and the layer needs nothing the kernel does not do (cross-attention, a sliding
    window, encoder tokens, a logit cap). A graph step reads the batch SGLang runs (its graph's
    batch size, padded), whatever it was planned from."""
    step = store.decode_step
    window = getattr(layer, "sliding_window_size", None)
    return (
        store.attends
        and step is not None
        and step.attends
        and (isinstance(step, GraphStep) or step.size * layer.tp_q_head_num * layer.qk_head_dim == q.numel())
        and not getattr(layer, "is_cross_attention", False)
        and (window is None or window < 0)
        and getattr(fb, "encoder_lens", None) is None
        and not getattr(layer, "logit_cap", 0)
    )


def _observe(fn: Callable[..., None], store: KvcStore, q, layer, fb, *args: Any) -> None:
    """Observation is bookkeeping for later compressions: a failure here must not fail the
    forward pass of the whole batch. What failed for a row empties that row's observations
    (`KvcStore.lose_observations`), so it is never scored with stale queries."""
    try:
        fn(store, q, layer, fb, *args)
    except Exception:  # noqa: BLE001
        logger.exception("sgl-kvc: attention observation failed in layer %s", layer.layer_id)


def _layer_keys(store: KvcStore, layer: Any, row: int, n: int) -> torch.Tensor:
    slots = store.req_to_token[row, :n].long()
    return store.kv_pool.get_key_buffer(layer.layer_id)[slots]


def _observe_decode(store: KvcStore, q: torch.Tensor, layer: Any, fb: ForwardBatch, attended: bool) -> None:
    h_q, d = layer.tp_q_head_num, layer.qk_head_dim
    q = q.reshape(-1, h_q, d)
    pool_rows = store.req_to_token.shape[0]
    rows = store.decode_rows  # the batch's rows in order, from the scheduler's host-side batch
    try:
        failpoints.check_observation(store, layer.layer_id - store.first_layer, rows)
        store.record_decode(layer.layer_id, fb.req_pool_indices, q, pool_rows)
    except Exception:  # noqa: BLE001 - again one row at a time: only the rows that fail alone lose theirs
        logger.exception("sgl-kvc: recording decode queries failed in layer %s; retrying row by row", layer.layer_id)
        lost = []
        for j, row in enumerate(rows):
            try:
                failpoints.check_observation(store, layer.layer_id - store.first_layer, [row])
                store.record_decode(layer.layer_id, fb.req_pool_indices[j : j + 1], q[j : j + 1], pool_rows)
            except Exception:  # noqa: BLE001
                lost.append(row)
        store.lose_observations(lost)
    step = store.decode_step  # set by the scheduler hook for this step: no host sync here
    if step is not None and step.has_stats and not attended:  # else the kernel fed them
        # A failure here leaves this step's attention out of the layer's statistics (each still
        # the request's own): logged by `_observe`.
        step.accumulate(layer.layer_id, q, store.kv_pool.get_key_buffer(layer.layer_id), layer.scaling,
                        store.unit_pools)


def _observe_extend(store: KvcStore, q: torch.Tensor, layer: Any, fb: ForwardBatch) -> None:
    if store.reconstruction is not None:  # a reconstruction forward (KVzip): its scores only
        from sgl_kvc.adapter.kvzip.forwards import observe_reconstruction

        observe_reconstruction(store, q, layer, fb)
        return
    h_q, d = layer.tp_q_head_num, layer.qk_head_dim
    q = q.reshape(-1, h_q, d)
    pool_rows = store.req_to_token.shape[0]
    start = 0
    rows = store.extend_rows  # the batch's rows in order, from the scheduler's host-side batch
    if len(rows) != len(fb.extend_seq_lens_cpu):
        raise RuntimeError(f"{len(rows)} extend rows recorded for {len(fb.extend_seq_lens_cpu)} requests")
    lost = []
    for i, row in enumerate(rows):
        e, p = fb.extend_seq_lens_cpu[i], fb.extend_prefix_lens_cpu[i]
        qi = q[start : start + e]
        start += e
        if e == 0:
            continue
        try:  # one request at a time: what fails for it empties its observations alone
            failpoints.check_observation(store, layer.layer_id - store.first_layer, [row])
            _observe_extend_row(store, layer, row, qi, p, e, pool_rows, fb.positions[start - e : start])
        except Exception:  # noqa: BLE001
            logger.exception("sgl-kvc: observing row %s failed in layer %s", row, layer.layer_id)
            lost.append(row)
    store.lose_observations(lost)


def _observe_extend_row(
    store: KvcStore, layer: Any, row: int, qi: torch.Tensor, p: int, e: int, pool_rows: int, positions: torch.Tensor,
) -> None:
    store.record_extend(layer.layer_id, row, qi, pool_rows)
    state = store.states.get(row)
    if state is not None and state.query_moments is not None:
        # Every query of the prompt, for a prompt policy that reads their moments (Expected
        # Attention); `positions` are logical (the RoPE the model applied), as is the chunk's
        # first, p + offset, on the host.
        store.add_query_moments(row, layer.layer_id, qi, positions, p + state.offset)
    if row in store.extend_tables:
        return  # its attention, through its tables, fed its statistic (`attend_extend`)
    if state is not None and state.policy.uses_stats and state.policy.accumulate_prefill:
        keys = _layer_keys(store, layer, row, p + e)
        dev = keys.device
        store.accumulate(
            row, layer.layer_id, qi, keys,
            torch.arange(p, p + e, device=dev), torch.arange(p + e, device=dev), layer.scaling,
        )


@functools.cache
def _kvc_class(base: type, wrapped_name: str) -> type:
    # Single inheritance with the mixin's members copied in: CPython refuses `__class__`
    # assignment to a class with an extra base, even one that adds no instance layout.
    members = {k: v for k, v in vars(KvcAttentionMixin).items() if not k.startswith("__")}
    if wrapped_name == "torch_native":
        members.update({k: v for k, v in vars(TorchNativeKernelMixin).items() if not k.startswith("__")})
        members["kvc_attends"] = hasattr(base, "_run_sdpa_forward_decode")
    elif wrapped_name == "triton":
        members.update({k: v for k, v in vars(TritonKernelMixin).items() if not k.startswith("__")})
    return type(
        f"Kvc{base.__name__}",
        (base,),
        {
            **members,
            "__slots__": (),
            "kvc_wrapped_name": wrapped_name,
            "kvc_base": base,
            "__sgl_kvc__": True,
        },
    )


def is_kvc_backend(backend: Any) -> bool:
    return bool(getattr(type(backend), "__sgl_kvc__", False))


def _wrap(name: str, factory: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def create(runner: ModelRunner) -> Any:
        backend = factory(runner)
        if not is_kvc_backend(backend):
            backend.__class__ = _kvc_class(type(backend), name)
            original = getattr(backend, "decode_attention_fwd", None)
            if name == "triton" and original is not None and not getattr(original, "__sgl_kvc__", False):
                backend.decode_attention_fwd = _triton_decode(backend, original)
            logger.info("sgl-kvc attention backend: %s", backend.kvc_name)
        return backend

    create.__sgl_kvc__ = True  # type: ignore[attr-defined]
    return create


def register() -> None:
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    for name in WRAPPED_BACKENDS:
        factory = ATTENTION_BACKENDS.get(name)
        if factory is not None and not getattr(factory, "__sgl_kvc__", False):
            ATTENTION_BACKENDS[name] = _wrap(name, factory)
