"""The request counts of `/v1/kvc/stats` leave SGLang's own health checks out."""

from __future__ import annotations

from types import SimpleNamespace

from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX

from sgl_kvc.adapter.runtime import KvcRuntime, PrefixStats, client_requests
from sgl_kvc.config import KvcConfig


def _req(rid: str, finished: bool = True) -> SimpleNamespace:
    return SimpleNamespace(rid=rid, finished=lambda: finished, origin_input_ids=[1, 2, 3], cached_tokens=2)


def test_health_checks_are_neither_running_nor_finished_requests() -> None:
    health = _req(f"{HEALTH_CHECK_RID_PREFIX}-1700000000.0")
    sent = [_req("a"), _req("b")]
    assert client_requests([health, *sent]) == 2

    prefix = PrefixStats()
    for req in (health, *sent, _req("retracted", finished=False)):
        prefix.count(req)
    assert (prefix.requests, prefix.prompt_tokens, prefix.hit_tokens) == (2, 6, 4)

    runtime = KvcRuntime(KvcConfig())
    decode = SimpleNamespace(reqs=[health, sent[0]])
    runtime.observe_plan(SimpleNamespace(running_batch=decode, batch_to_run=SimpleNamespace(reqs=[sent[1]])))
    assert runtime.max_running == 2
