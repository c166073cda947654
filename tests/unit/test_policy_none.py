"""`--policy none` is plain SGLang: the scheduler hooks a plain server keeps (decode moments,
stats) build no compressor and read nothing of the KV pool, so a pool layout sgl-kvc does not
know (a hybrid model's, SGLang's `HybridLinearKVPool`: no `layer_num`, no `get_key_buffer` of
layer 0) serves as SGLang serves it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sgl_kvc.adapter import hooks
from sgl_kvc.adapter.runtime import collect_stats, KvcRuntime
from sgl_kvc.config import KvcConfig


COMPRESSOR_SURFACE = {"layer_num", "start_layer", "get_key_buffer", "get_value_buffer", "get_kv_buffer", "unit_buffers"}


class _HybridPool:
    """A KV pool without the per-layer surface sgl-kvc's compressor reads (what it is asked for
    is recorded in `asked`)."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def __getattr__(self, name: str):
        self.asked.append(name)
        raise AttributeError(name)


def _scheduler() -> SimpleNamespace:
    runner = SimpleNamespace(token_to_kv_pool=_HybridPool(), req_to_token_pool=SimpleNamespace(),
                             server_args=SimpleNamespace(enable_metrics=False), kv_cache_dtype="bfloat16",
                             memory_pool_config=SimpleNamespace(), is_draft_worker=False)
    return SimpleNamespace(
        tp_worker=SimpleNamespace(model_runner=runner), req_to_token_pool=SimpleNamespace(),
        tree_cache=SimpleNamespace(evictable_size=lambda: 0), max_total_num_tokens=64,
        token_to_kv_pool_allocator=SimpleNamespace(available_size=lambda: 64),
        running_batch=SimpleNamespace(reqs=[]), max_running_requests=8,
    )


def _req(retracted: bool) -> SimpleNamespace:
    return SimpleNamespace(is_retracted=retracted, rid="r")


def test_a_plain_server_builds_no_compressor_and_reads_no_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    config = KvcConfig()  # --policy none
    assert not config.compressing
    monkeypatch.setattr("sgl_kvc.adapter.runtime.pool_bytes", lambda pool: 0)
    scheduler = _scheduler()
    kept, gone = _req(False), _req(True)
    batch = SimpleNamespace(reqs=[kept, gone], check_decode_mem=lambda: False)

    def update_running(sched, b, *args, **kwargs):  # SGLang retracts one request
        b.reqs = [kept]
        return "sglang's result"

    hook = {h.target: h for h in hooks.hook_table(config)}[f"{hooks._SCHEDULER}.update_running_batch"]
    assert hook.fn(update_running, scheduler, batch) == "sglang's result"
    assert "_sgl_kvc_compressor" not in vars(scheduler.tp_worker.model_runner)
    stats = collect_stats(scheduler, KvcRuntime.of(scheduler, config))
    assert stats["compression"]["retractions"] == 1 and stats["compression"]["passes"] == 0
    assert stats["pool"]["observation_bytes"] == 0 and stats["decode_attention"]["kernel"] == "sglang"
    assert not COMPRESSOR_SURFACE & set(scheduler.tp_worker.model_runner.token_to_kv_pool.asked)
