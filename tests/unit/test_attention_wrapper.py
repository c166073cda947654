"""The attention backend wrapper (sgl_kvc.adapter.attention) on SGLang's backend classes."""

from __future__ import annotations

import torch

from sgl_kvc.kernels.decode_attention import decode_attention
from decode_cases import case as _case


def test_wrapped_torch_native_backend_runs_the_kernel() -> None:
    """The wrapped CPU backend class gets the kernel's loop replacement; FlashInfer's does not."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from sgl_kvc.adapter.attention import _kvc_class

    cls = _kvc_class(TorchNativeAttnBackend, "torch_native")
    assert cls.kvc_attends
    assert cls._run_sdpa_forward_decode is not TorchNativeAttnBackend._run_sdpa_forward_decode
    other = _kvc_class(type("FlashInferLike", (), {}), "flashinfer")
    assert not other.kvc_attends and not hasattr(other, "_run_sdpa_forward_decode")


def test_kernel_matches_sglangs_torch_native_loop() -> None:
    """The kernel replaces `TorchNativeAttnBackend._run_sdpa_forward_decode` (sglang 0.5.23):
    same inputs, same output (bf16, as the demo model runs)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    lens = [9, 2, 30, 17]
    q, k, v, r2t, slots, pad = _case(1, lens)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    theirs = torch.empty_like(q)
    backend = object.__new__(TorchNativeAttnBackend)  # the loop reads nothing of the instance
    TorchNativeAttnBackend._run_sdpa_forward_decode(
        backend, q, theirs, k, v, r2t, torch.arange(len(lens)), torch.tensor(lens),
        scaling=0.3, enable_gqa=True, causal=False,
    )
    ours, _ = decode_attention(q, k, v, slots, pad, 0.3)
    assert torch.allclose(ours.float(), theirs.float(), atol=2e-2)  # bf16 rounding only
