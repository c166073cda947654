"""SGLang's Triton attention backend under sgl-kvc (`adapter/attention.py`, `TritonKernelMixin`):
its own kernels over SGLang's pool, sgl-kvc's decode kernel over sgl-kvc's pools, FP8 rows
dequantized for the rows its kernels read, and a packed request's extend through its tables.
SGLang's real Triton kernels run here: compiled on a GPU, interpreted by Triton on a CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sgl_kvc.kernels.fp8 import Fp8Rows

# Triton runs its kernels on the GPU where there is one, and interprets them on the CPU only where
# there is none (`tests/conftest.py` sets TRITON_INTERPRET): CPU tensors cannot reach a compiled kernel.
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


def _backend_class():
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    from sgl_kvc.adapter.attention import _kvc_class

    return TritonAttnBackend, _kvc_class(TritonAttnBackend, "triton")


def _fp8_rows(k: torch.Tensor) -> Fp8Rows:
    rows = Fp8Rows.empty(k.shape[0], k.shape[1], k.shape[2], dtype=k.dtype, device=k.device)
    rows[torch.arange(k.shape[0], device=k.device)] = k
    return rows


def _decode_case(device: str, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(0)
    lens, slots, h_q, h_kv, d = [5, 9, 3], 40, 4, 2, 16
    k = torch.randn(slots, h_kv, d, generator=gen).to(device, dtype)
    v = torch.randn(slots, h_kv, d, generator=gen).to(device, dtype)
    q = torch.randn(len(lens), h_q, d, generator=gen).to(device, dtype)
    indices = torch.randperm(slots, generator=gen)[: sum(lens)].to(device, torch.int32)
    indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    splits = 4
    work = dict(attn_logits=torch.empty(len(lens), h_q, splits, d, device=device),
                attn_lse=torch.empty(len(lens), h_q, splits, device=device),
                num_kv_splits=torch.full((len(lens),), splits, dtype=torch.int32, device=device))
    return q, k, v, indptr, indices, work, splits


def _sglang_decode(q, k, v, indptr, indices, work, splits) -> torch.Tensor:
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

    o = torch.empty_like(q)
    decode_attention_fwd(q, k, v, o, indptr, indices, work["attn_logits"], work["attn_lse"],
                         work["num_kv_splits"], splits, 0.25, 1.0, 1.0)
    return o


def test_the_wrapped_class_reads_sgl_kvc_pools_with_sgl_kvc_kernel() -> None:
    """Over SGLang's own pool the Triton backend keeps its kernels (statistics beside them, as on
    FlashInfer); over the FP8 pool or the unit pool sgl-kvc's kernel runs its decode."""
    base, cls = _backend_class()
    assert cls._forward_extend_kernel is not base._forward_extend_kernel
    backend = object.__new__(cls)
    for pool, ours in [(SimpleNamespace(), False), (SimpleNamespace(kvc_fp8="fp8_e4m3"), True),
                       (SimpleNamespace(unit_buffers=lambda: None), True)]:
        backend.token_to_kv_pool = pool
        assert backend.kvc_attends is ours


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_rows_reach_sglangs_decode_kernel_dequantized(device: str) -> None:
    """Where sgl-kvc's kernel does not attend (`--kv-decode-attention sglang`), SGLang's Triton
    decode kernel reads the FP8 pool's rows of the batch, dequantized: the same output as the
    kernel over the whole pool dequantized."""
    from sgl_kvc.adapter.attention import _triton_decode

    q, k, v, indptr, indices, work, splits = _decode_case(device)
    k_rows, v_rows = _fp8_rows(k), _fp8_rows(v)
    everything = torch.arange(k.shape[0], device=device)
    expected = _sglang_decode(q, k_rows[everything], v_rows[everything], indptr, indices, work, splits)
    backend = SimpleNamespace(_kvc_attend_layer=None, kvc_store=None)
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

    o = torch.empty_like(q)
    _triton_decode(backend, decode_attention_fwd)(
        q, k_rows, v_rows, o, indptr, indices, work["attn_logits"], work["attn_lse"], work["num_kv_splits"],
        splits, 0.25, 1.0, 1.0,
    )
    torch.testing.assert_close(o, expected, rtol=0, atol=1e-6)
    # and FP8 is close to the full-precision cache (e4m3, one scale per row)
    full = _sglang_decode(q, k, v, indptr, indices, work, splits)
    assert float((o - full).norm() / full.norm()) < 0.05


def test_sgl_kvc_kernel_runs_the_planned_decode() -> None:
    """While the step planned sgl-kvc's kernel for a layer, the kernel call is sgl-kvc's and
    SGLang's kernel does not run; otherwise SGLang's kernel runs with the arguments it was given."""
    from sgl_kvc.adapter.attention import _triton_decode

    calls: list[tuple] = []
    store = SimpleNamespace(decode_step="step", attend_decode=lambda *a, **kw: calls.append(("kvc", *a, kw)))
    layer = SimpleNamespace(layer_id=3, scaling=0.5)
    batch = SimpleNamespace(req_pool_indices="rows", seq_lens="lens")  # a graph step reads them
    backend = SimpleNamespace(_kvc_attend_layer=layer, _kvc_decode_batch=batch, kvc_store=store)
    decode = _triton_decode(backend, lambda *a, **kw: calls.append(("sglang", *a)))
    q, k, v, o = (torch.zeros(1) for _ in range(4))
    decode(q, k, v, o, "indptr", "indices", "logits")
    assert calls == [("kvc", 3, "step", q, k, v, 0.5, o, {"rows": "rows", "seq_lens": "lens"})]
    calls.clear()
    backend._kvc_attend_layer = None
    decode(q, k, v, o, "indptr", "indices", "logits")
    assert calls == [("sglang", q, k, v, o, "indptr", "indices", "logits")]


def _extend_case(device: str):
    """Two requests: prefixes of 6 and 0 cached entries, 4 and 3 new tokens."""
    gen = torch.Generator().manual_seed(1)
    h_q, h_kv, d, slots = 4, 2, 16, 32
    prefix, new = [6, 0], [4, 3]
    k_cache = torch.randn(slots, h_kv, d, generator=gen).to(device)
    v_cache = torch.randn(slots, h_kv, d, generator=gen).to(device)
    kv_indices = torch.randperm(slots, generator=gen)[: sum(prefix)].to(device, torch.int32)
    kv_indptr = torch.tensor([0, prefix[0], sum(prefix)], dtype=torch.int32, device=device)
    qo_indptr = torch.tensor([0, new[0], sum(new)], dtype=torch.int32, device=device)
    q = torch.randn(sum(new), h_q, d, generator=gen).to(device)
    k = torch.randn(sum(new), h_kv, d, generator=gen).to(device)
    v = torch.randn(sum(new), h_kv, d, generator=gen).to(device)
    return q, k, v, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, new


def _extend(backend, layer, q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, new) -> torch.Tensor:
    o = torch.empty_like(q)
    backend._forward_extend_kernel(layer, q, k, v, o, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, None, True,
                                   None, max(new), 1.0, 1.0, 0.25)
    return o


@pytest.mark.parametrize("device", DEVICES)
def test_extend_over_fp8_rows_and_packed_requests(device: str) -> None:
    """SGLang's Triton extend kernel reads an FP8 pool's prefix rows dequantized (the same output as
    over the dequantized pool), and a packed request's rows of the output are its per-head tables'
    attention (`KvcStore.attend_extend`), the other request's SGLang's."""
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    _, cls = _backend_class()
    backend = object.__new__(cls)
    backend.dllm_attention = None
    backend.extend_attention_fwd = extend_attention_fwd
    backend._kvc_extend = None
    layer = SimpleNamespace(layer_id=0, scaling=0.25)
    q, k, v, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, new = _extend_case(device)
    k_rows, v_rows = _fp8_rows(k_cache), _fp8_rows(v_cache)
    everything = torch.arange(k_cache.shape[0], device=device)
    expected = _extend(backend, layer, q, k, v, k_rows[everything].as_subclass(torch.Tensor),
                       v_rows[everything].as_subclass(torch.Tensor), qo_indptr, kv_indptr, kv_indices, new)
    got = _extend(backend, layer, q, k, v, k_rows, v_rows, qo_indptr, kv_indptr, kv_indices, new)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)

    # the first request packed: its rows come from its tables, the second's from SGLang's kernel
    marker = torch.full((new[0], q.shape[1], q.shape[2]), 7.0, device=device)
    seen: list[tuple] = []

    def attend_extend(layer_id, row, qi, positions, scale):
        seen.append((layer_id, row, qi.shape[0], positions.tolist(), scale))
        return marker

    store = SimpleNamespace(extend_rows=[11, 12], extend_tables={11: object()}, attend_extend=attend_extend)
    positions = torch.arange(sum(new), device=device)
    backend.kvc_store = store
    backend._kvc_extend = (layer, SimpleNamespace(extend_seq_lens_cpu=new, positions=positions))
    packed = _extend(backend, layer, q, k, v, k_rows, v_rows, qo_indptr, kv_indptr, kv_indices, new)
    assert seen == [(0, 11, new[0], list(range(new[0])), 0.25)]
    assert torch.equal(packed[: new[0]], marker)
    torch.testing.assert_close(packed[new[0]:], expected[new[0]:], rtol=0, atol=1e-6)
