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


def test_intact_requests_are_attended_as_sglang_attends_them_bit_for_bit() -> None:
    """In bfloat16, SGLang's SDPA rounds its softmax weights before their product with the values;
    a request that holds nothing compressed is read by the same call (`plain_decode`), so a step
    of intact requests, one of them keeping statistics (H2O), gives SGLang's loop's output bit for
    bit, and the statistics its own softmax. A compacted request is read by the batched kernel."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from sgl_kvc.core.decode import DecodeStep
    from sgl_kvc.core.request_state import Budget, ReqKvState
    from sgl_kvc.policies import get_policy

    lens = [9, 2, 30, 17]
    q, k, v, r2t, _, _ = _case(4, lens)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    theirs = torch.empty_like(q)
    backend = object.__new__(TorchNativeAttnBackend)
    TorchNativeAttnBackend._run_sdpa_forward_decode(
        backend, q, theirs, k, v, r2t, torch.arange(len(lens)), torch.tensor(lens),
        scaling=0.3, enable_gqa=True, causal=False,
    )
    h2o = ReqKvState(policy=get_policy("h2o"), budget=Budget(64))
    h2o.stats = [None]
    compacted = ReqKvState(policy=get_policy("snapkv"), budget=Budget(64), offset=3)
    states = {0: h2o, 3: compacted}
    step = DecodeStep.build(list(range(len(lens))), lens, states, r2t, k.shape[1] * k.shape[2], attends=True,
                            kv_heads=k.shape[1])
    assert sorted(len(b.plain_lens or ()) for b in step.blocks) == [0, 3]
    ours = torch.full_like(q, float("nan"))
    step.attend(0, q, k, v, 0.3, ours)
    assert torch.equal(ours[:3], theirs[:3])  # intact: bit for bit
    assert torch.allclose(ours[3].float(), theirs[3].float(), atol=2e-2)  # the kernel: bf16 rounding
    keys = k[r2t[0, : lens[0]].long()].float()  # the H2O request's statistic: its own softmax
    probs = torch.softmax(q[0].float().view(2, -1, keys.shape[-1]) @ keys.permute(1, 2, 0) * 0.3, dim=-1)
    assert torch.allclose(h2o.stats[0][:, : lens[0]], probs.sum(1), atol=1e-5)
