"""The served model's RoPE, as the policies see it (`sgl_kvc.adapter.moments.rope`), and Expected
Attention's query advance against transformers' Llama RoPE (the layout SmolLM2 and Llama use)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from sgl_kvc.adapter.moments.compressor import Compressor
from sgl_kvc.adapter.moments.rope import rope_params
from sgl_kvc.policies import PolicyParams
from sgl_kvc.policies.expected_attention import mean_future_phasor, rotate_pairs


def _rotary(cls: type, head_size: int, rotary_dim: int, base: float, neox: bool) -> torch.nn.Module:
    """An instance of SGLang's rotary class with the attributes the adapter reads (its own
    constructor builds kernels this CPU test has no use for)."""
    module = cls.__new__(cls)
    torch.nn.Module.__init__(module)
    module.head_size, module.rotary_dim, module.base, module.is_neox_style = head_size, rotary_dim, base, neox
    return module


def _model(rotary: torch.nn.Module | None) -> torch.nn.Module:
    layer = torch.nn.Module()
    if rotary is not None:
        layer.rotary_emb = rotary
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([layer])
    return model


def test_rope_params_read_the_models_rotary_embedding(caplog: pytest.LogCaptureFixture) -> None:
    from sglang.srt.layers.rotary_embedding import RotaryEmbedding
    from sglang.srt.layers.rotary_embedding.rope_variant import Llama3RotaryEmbedding

    caplog.set_level(logging.WARNING)
    smollm2 = rope_params(SimpleNamespace(model=_model(_rotary(RotaryEmbedding, 64, 64, 100000, True))))
    assert smollm2 == {"rope_theta": 100000.0, "rope_dim": 0, "rope_neox": True}
    assert not caplog.records
    partial = rope_params(SimpleNamespace(model=_model(_rotary(RotaryEmbedding, 128, 64, 10000, False))))
    assert partial == {"rope_theta": 10000.0, "rope_dim": 64, "rope_neox": False}
    PolicyParams(**partial)  # valid parameters
    scaled = rope_params(SimpleNamespace(model=_model(_rotary(Llama3RotaryEmbedding, 128, 128, 500000, True))))
    assert scaled["rope_theta"] == 500000.0 and "unscaled" in caplog.text
    caplog.clear()
    assert rope_params(SimpleNamespace(model=_model(None))) == {} and "no SGLang RotaryEmbedding" in caplog.text
    assert rope_params(SimpleNamespace()) == {}  # a stand-in runner: the defaults


def test_the_compressors_policies_get_the_models_rope(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.layers.rotary_embedding import RotaryEmbedding

    from sgl_kvc.adapter.moments import compressor as compressor_module
    from sgl_kvc.config import KvcConfig

    monkeypatch.setattr(compressor_module.ScoreReducer, "for_sglang_tp_group", classmethod(lambda cls: None))
    monkeypatch.setattr(compressor_module, "tp_rank", lambda: 0)
    k = torch.zeros(8, 1, 4)
    pool = SimpleNamespace(start_layer=0, layer_num=1, get_key_buffer=lambda layer: k)
    runner = SimpleNamespace(
        token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(2, 8, dtype=torch.int32)),
        attn_backend=SimpleNamespace(), server_args=None,
        model=_model(_rotary(RotaryEmbedding, 64, 64, 100000, True)),
    )
    comp = Compressor(KvcConfig(policy="expected_attention", kv_budget=32), runner)
    params = comp.policy("expected_attention", 32).params
    assert (params.rope_theta, params.rope_dim, params.rope_neox, params.budget) == (100000.0, 0, True, 32)


@pytest.mark.parametrize("theta", [10000.0, 100000.0])
def test_advance_matches_transformers_llama_rope(theta: float) -> None:
    """A query that transformers' Llama RoPE rotated at position p, advanced by delta with one
    future position, is the same pre-RoPE query rotated by transformers at p + delta."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    d = 16
    config = LlamaConfig(hidden_size=4 * d, num_attention_heads=4, num_key_value_heads=2, head_dim=d,
                         rope_theta=theta)
    rotary = LlamaRotaryEmbedding(config)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 4, 1, d, generator=g)  # [batch, heads, tokens, d], before RoPE

    def at(position: int) -> torch.Tensor:
        cos, sin = rotary(x, torch.tensor([[position]]))
        return apply_rotary_pos_emb(x, x, cos, sin)[0][0, :, 0]  # [heads, d]

    p = PolicyParams(rope_theta=theta, ea_future_positions=1)
    for position, delta in [(0, 1), (37, 5), (4000, 9)]:
        re, im = mean_future_phasor(torch.tensor([delta]), p, d)
        moved = rotate_pairs(at(position), re, im, p.rope_dim, p.rope_neox)
        # transformers computes the angles t theta in float32: an error of about t u radians
        # (u = 2^-24) at position t, on each pair of norm at most ||x||
        atol = 4 * (position + delta + d) * 2.0**-24 * float(x.norm(dim=-1).max())
        torch.testing.assert_close(moved, at(position + delta), atol=atol, rtol=0.0)
