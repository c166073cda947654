"""Compression just before a preemption, and admission by what a request will really hold.

A deliberately small pool: eight generations of ~170 tokens need ~1400 slots, the pool has 600.
Plain SGLang admits three at a time (prompt + max_tokens each). With R-KV the scheduler admits
by what a request will really hold (budget + buffer), so all eight run at once; with only the
`preempt` moment on, they grow until the decode memory check fails, then get compressed
instead of retracted. With the prefill moment alone nothing brings the generated tokens back to
the budget: a request is admitted for its budget + max_tokens, and none is retracted.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvc_reference import assert_pool_whole
from loadtest.server import ServerProcess

pytestmark = pytest.mark.e2e

N_REQ, NEW_TOKENS, POOL = 8, 150, 600


@pytest.fixture(scope="module")
def preempt_server():
    cmd = [
        sys.executable, "-m", "sgl_kvc.launch", "--model-path", "demo", "--policy", "rkv",
        "--kv-budget", "32", "--kv-buffer", "16", "--compress-on", "preempt",
        "--max-total-tokens", str(POOL), "--enable-metrics",
    ]
    with ServerProcess.launch(cmd, env={"SGLKVC_CHECK": "1"}) as server:
        yield server


def test_compress_before_preempt_and_admit_by_footprint(preempt_server) -> None:
    def one(i: int) -> int:
        r = preempt_server.post(
            "/v1/completions",
            json={
                "model": "m", "prompt": f"Request {i}: the weather was mild in the valley.",
                "max_tokens": NEW_TOKENS, "ignore_eos": True,
            },
        )
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    with ThreadPoolExecutor(N_REQ) as pool:
        assert list(pool.map(one, range(N_REQ))) == [NEW_TOKENS] * N_REQ
    s = preempt_server.stats()
    c = s["compression"]
    assert c["preempt_passes"] > 0 and c["avoided_retractions"] > 0, c
    assert c["decode_passes"] == 0 and c["prefill_passes"] == 0  # only the preempt moment is on
    assert c["retractions"] == 0, c
    # Plain SGLang would run POOL // (prompt + max_tokens) = 3 at a time.
    assert s["requests"]["max_running"] >= 6, s["requests"]
    assert_pool_whole(s)


def test_a_request_that_cannot_fit_even_compressed_is_a_400_not_cut_short(preempt_server) -> None:
    """Its budget + buffer alone exceed the pool: SGLang would cut its output to what fits,
    silently; it is refused, saying so."""
    r = preempt_server.post("/v1/completions", json={
        "model": "m", "prompt": "The weather was mild.", "max_tokens": 1000, "ignore_eos": True,
        "kv_compression": {"budget": POOL + 100},
    })
    assert r.status_code == 400, r.text[:300]
    assert "cannot hold this request even compressed" in r.text
    ok = preempt_server.post("/v1/completions", json={
        "model": "m", "prompt": "The weather was mild.", "max_tokens": 40, "ignore_eos": True,
        "kv_compression": {"budget": POOL + 100},  # never reaches its budget: it fits
    })
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 40, ok.text[:300]


PREFILL_POOL = 2048


@pytest.fixture(scope="module")
def whole_pass_server():
    """The prefill moment alone (no decode or preempt moment), every pass whole."""
    cmd = [
        sys.executable, "-m", "sgl_kvc.launch", "--model-path", "demo", "--policy", "snapkv",
        "--kv-budget", "16", "--kv-window", "4", "--kv-pass-work", "0", "--compress-on", "prefill",
        "--max-total-tokens", str(PREFILL_POOL),
    ]
    with ServerProcess.launch(cmd, env={"SGLKVC_CHECK": "1"}) as server:
        yield server


def test_requests_due_in_the_same_step_are_compacted_together(whole_pass_server) -> None:
    """Prompts prefilled in one batch are compacted right after it by one batched move
    (`compact_requests_per_head`); the invariant check runs over all of them."""
    prompts = [f"Request {i:02d}: the weather was mild in the valley all week." for i in range(N_REQ)]
    r = whole_pass_server.post(
        "/generate",
        json={"text": prompts, "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}},
    )  # one request carrying N_REQ prompts: they reach the scheduler together
    r.raise_for_status()
    assert [o["meta_info"]["completion_tokens"] for o in r.json()] == [8] * N_REQ
    s = whole_pass_server.wait_idle()
    c = s["compression"]
    assert c["prefill_passes"] == N_REQ and c["max_compacted_together"] >= 2, c
    assert c["staged_passes"] == 0 and c["failed_requests"] == 0, c
    assert_pool_whole(s)


def test_without_a_decode_moment_requests_are_admitted_for_budget_plus_max_tokens(whole_pass_server) -> None:
    """16 requests of 60-token prompts and 200-token outputs in a 2048-slot pool: each is cut to
    its budget after prefill (copying 16 entries out of the tree), then holds up to budget + 200.
    Admitted by that, none is retracted (admitted by budget + buffer, SGLang would retract many)."""
    import random

    before = whole_pass_server.wait_idle()["compression"]

    def one(i: int) -> int:
        rng = random.Random(100 + i)
        r = whole_pass_server.post("/v1/completions", json={
            "model": "m", "prompt": [rng.randrange(10, 2000) for _ in range(60)], "max_tokens": 200,
            "ignore_eos": True,
        })
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(one, range(16))) == [200] * 16
    s = whole_pass_server.wait_idle()
    c = s["compression"]
    assert c["retractions"] == before["retractions"] == 0, c
    assert c["skipped"] == before["skipped"] and c["decode_passes"] == 0, c
    assert s["requests"]["max_running"] >= PREFILL_POOL // (16 + 200 + 1) - 1, s["requests"]
    assert_pool_whole(s)
    # One that cannot fit even compressed (budget + max_tokens over the pool) is a 400.
    r = whole_pass_server.post("/v1/completions", json={"model": "m", "prompt": "Hello", "max_tokens": PREFILL_POOL})
    assert r.status_code == 400 and "cannot hold this request even compressed" in r.text, r.text[:300]


def test_prometheus_metrics(preempt_server) -> None:
    text = preempt_server.get("/metrics").text
    passes = [l for l in text.splitlines() if l.startswith("sgl_kvc:compression_passes_total{")]
    assert any('moment="preempt"' in l and float(l.rsplit(" ", 1)[1]) > 0 for l in passes), passes
    for name in ("evicted_tokens_total", "compression_seconds_total", "avoided_retractions_total"):
        assert f"sgl_kvc:{name}" in text


STAGED_POOL, STAGED_PROMPT = 1200, 900


@pytest.fixture(scope="module")
def staged_server():
    """A pool that holds one long prompt, and passes staged one KV head per step (4 steps on
    the demo model), so a request holds its whole prompt for a few steps after prefill."""
    cmd = [
        sys.executable, "-m", "sgl_kvc.launch", "--model-path", "demo", "--policy", "rkv",
        "--kv-budget", "32", "--kv-buffer", "16", "--kv-pass-work", "16",
        "--max-total-tokens", str(STAGED_POOL),
    ]
    with ServerProcess.launch(cmd, env={"SGLKVC_CHECK": "1"}) as server:
        yield server


def test_memory_a_compaction_frees_admits_waiting_requests(staged_server) -> None:
    """A request that finds no room while another's staged pass still holds a whole prompt must
    be admitted once the compaction frees it, not only when the first request finishes (SGLang
    shuts admission after a request does not fit and reopens it when one leaves)."""
    import random

    def one(i: int) -> int:
        rng = random.Random(i)
        r = staged_server.post(
            "/v1/completions",
            json={"model": "m", "prompt": [rng.randrange(10, 2000) for _ in range(STAGED_PROMPT)],
                  "max_tokens": 96, "ignore_eos": True},
        )
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    with ThreadPoolExecutor(3) as pool:
        assert list(pool.map(one, range(3))) == [96] * 3
    s = staged_server.stats()
    assert s["compression"]["staged_passes"] >= 3, s["compression"]
    # Two prompts never fit together; a compressed request and a new prompt do.
    assert s["requests"]["max_running"] >= 2, s["requests"]
    assert_pool_whole(s)
