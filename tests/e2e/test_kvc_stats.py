"""`GET /v1/kvc/stats` reads the live scheduler; the plugin really is in use."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvc_reference import assert_pool_whole, served_backend

pytestmark = pytest.mark.e2e


def test_stats_shape(kvc_server) -> None:
    s = kvc_server.stats()
    assert s["policy"] == "none"
    # the demo model is bfloat16; a CPU that emulates bfloat16 serves it in float32 by default
    import torch

    from sgl_kvc.launcher.machine import native_bf16
    from sgl_kvc.launcher.sglang_argv import EMULATED_BF16_DTYPE

    native = torch.cuda.is_available() or native_bf16()  # as the launcher decides
    assert s["kv_cache_dtype"] == ("bfloat16" if native else EMULATED_BF16_DTYPE)
    for block, keys in {
        "pool": ("total_tokens", "free_tokens", "cached_tokens"),
        "prefix_cache": ("prompt_tokens", "hit_tokens"),
        "compression": ("passes", "evicted_tokens", "seconds"),
        "requests": ("running", "max_running"),
    }.items():
        for key in keys:
            assert isinstance(s[block][key], (int, float)), (block, key)
    assert s["prefix_cache"]["backend"] == "UnifiedRadixCache"  # SGLang's own default
    # --policy none is plain SGLang: its own decode attention, never sgl-kvc's kernel
    assert s["decode_attention"] == {"kernel": "sglang", "layers": 0, "graph_steps": 0, "graph_replays": 0,
                                     "eager_steps": {}}


def test_pool_accounting_when_idle(kvc_server, openai_client) -> None:
    openai_client.completions.create(
        model=openai_client.models.list().data[0].id, prompt="The weather was mild", max_tokens=12
    )
    s = kvc_server.wait_idle()
    assert s["requests"]["running"] == 0
    assert s["pool"]["cached_tokens"] > 0  # the finished request's KV stays in the tree
    assert_pool_whole(s)


def test_health_checks_are_not_counted_as_requests(kvc_server, openai_client) -> None:
    """SGLang's `/health` generates a token through the scheduler; a gateway polls it every few
    seconds, and those are not requests a user sent."""
    openai_client.completions.create(
        model=openai_client.models.list().data[0].id, prompt="Count me", max_tokens=2
    )
    before = kvc_server.wait_idle()["prefix_cache"]
    for _ in range(3):
        assert kvc_server.get("/health").status_code == 200
    after = kvc_server.wait_idle()["prefix_cache"]
    assert (after["requests"], after["prompt_tokens"]) == (before["requests"], before["prompt_tokens"])


def test_plugin_components_in_use(kvc_server) -> None:
    log = Path(kvc_server.log_path).read_text(errors="replace")
    assert f"sgl-kvc attention backend: sgl_kvc({served_backend()})" in log
    if not torch.cuda.is_available():  # SGLang imported once: its workers forked from the launcher
        assert "worker processes are forked from the launcher" in log


def test_standins_never_called(kvc_server, openai_client, standin_log: Path) -> None:
    """A full request cycle (prefill, decode, prefix hit) calls no stand-in function."""
    model = openai_client.models.list().data[0].id
    prompt = "Mathematics rewards patience. " * 12
    openai_client.completions.create(model=model, prompt=prompt, max_tokens=16)
    before = kvc_server.stats()["prefix_cache"]["hit_tokens"]
    openai_client.completions.create(model=model, prompt=prompt, max_tokens=16)
    assert kvc_server.stats()["prefix_cache"]["hit_tokens"] > before  # the prefix hit happened
    events = standin_log.read_text().splitlines() if standin_log.exists() else []
    imports = [e for e in events if e.startswith("import ")]
    calls = [e for e in events if e.startswith("call ")]
    try:
        import sgl_kernel  # noqa: F401
        from sgl_kvc.compat.standins import is_standin

        standins_expected = is_standin(sgl_kernel)
    except ImportError:
        standins_expected = False
    if standins_expected:
        assert any(" sgl_kernel " in e for e in imports), "stand-ins were expected to be in use"
    assert calls == []
