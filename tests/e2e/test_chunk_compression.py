"""Compression between the chunks of a long prompt (Batch-Max's prefill-time eviction).

A compressing request whose prompt is longer than the chunked-prefill size is cut back to its
budget after every chunk: it never holds more than budget + one chunk, so a prompt several times
the pool is served; the next chunk's queries attend to what was kept, at logical positions (a
dense reference checks the served log-probabilities); the radix tree only ever gets the exact
KV of the prompt's first chunk. A server with a 2048-slot pool and 256-token chunks,
`SGLKVC_CHECK=1`, so a broken pool or tree stops it: in bf16, and with sgl-kvc's FP8 pool.
"""

from __future__ import annotations

import random
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvc_reference import assert_pool_whole, fp8_attention, generate, logprob_error, trace_events
from loadtest.server import ServerProcess

pytestmark = pytest.mark.e2e

POOL, CHUNK, BUDGET, BUFFER, WINDOW = 2048, 256, 64, 32, 8
VOCAB = 2000  # ids below the demo tokenizer's vocabulary


@pytest.fixture(scope="module", params=["bf16", "fp8_e4m3"])
def chunk_server(request: pytest.FixtureRequest, trace: Path):
    # bfloat16 (the demo model's dtype) on every CPU: the accuracy thresholds were measured in it
    cmd = [
        sys.executable, "-m", "sgl_kvc.launch", "--model-path", "demo", "--dtype", "bfloat16", "--policy", "rkv",
        "--kv-budget", str(BUDGET), "--kv-buffer", str(BUFFER), "--kv-window", str(WINDOW),
        "--max-total-tokens", str(POOL), "--chunked-prefill-size", str(CHUNK),
        "--compress-on", "chunk-always,prefill,decode,preempt",
    ]
    fp8 = None if request.param == "bf16" else request.param
    if fp8:
        cmd += ["--kv-cache-dtype", fp8]
    with ServerProcess.launch(cmd, env={"SGLKVC_CHECK": "1", "SGLKVC_TRACE": str(trace)}) as server:
        server.fp8 = fp8  # type: ignore[attr-defined]
        yield server


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, VOCAB) for _ in range(n)]


def _complete(server: ServerProcess, ids: list[int], max_tokens: int, kvc: dict | None = None):
    body = {"model": "m", "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    if kvc is not None:
        body["kv_compression"] = kvc
    return server.post("/v1/completions", json=body)


def test_prompts_four_times_the_pool_are_served_within_budget_plus_one_chunk(chunk_server) -> None:
    """Four prompts of 4x the pool at once: each is compressed after every chunk and never holds
    more than its budget + one chunk (+ the window recomputed on a hit), so they all run."""
    before = chunk_server.stats()["compression"]
    n = 4 * POOL
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda k: _complete(chunk_server, _prompt(n, seed=k), 16), range(4)))
    for r in replies:
        assert r.status_code == 200, r.text[:300]
        assert r.json()["usage"] == {"prompt_tokens": n, "completion_tokens": 16, "total_tokens": n + 16,
                                     **{k: v for k, v in r.json()["usage"].items() if k not in (
                                         "prompt_tokens", "completion_tokens", "total_tokens")}}
    stats = chunk_server.wait_idle()
    c = stats["compression"]
    assert c["chunk_passes"] - before["chunk_passes"] >= 4 * (n // CHUNK - 2), c
    assert c["max_row_slots"] <= BUDGET + CHUNK + WINDOW, c  # measured: 320 = 64 + 256
    assert c["failed_requests"] == before["failed_requests"]
    assert stats["requests"]["max_running"] >= 2  # several long prompts in flight in one pool
    assert_pool_whole(stats)


def test_expected_attention_reads_every_chunk_and_lets_go_of_it(chunk_server) -> None:
    """Expected Attention as the prompt policy keeps the moments of every query of the prompt
    (`core/query_moments.py`) while it is read in chunks: the prompts are served within budget +
    one chunk, and nothing the requests held is left once they are done."""
    before = chunk_server.stats()["compression"]
    n = 2 * POOL
    kvc = [{"policy": "expected_attention"}, {"policy": "rkv", "prompt_policy": "expected_attention"}]
    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda k: _complete(chunk_server, _prompt(n, seed=20 + k), 8, kvc[k]), range(2)))
    for r in replies:
        assert r.status_code == 200, r.text[:300]
    stats = chunk_server.wait_idle()
    c = stats["compression"]
    assert c["chunk_passes"] - before["chunk_passes"] >= 2 * (n // CHUNK - 2), c
    assert c["max_row_slots"] <= BUDGET + CHUNK + WINDOW, c
    assert c["failed_requests"] == before["failed_requests"]
    assert stats["pool"]["request_state_bytes"] == 0, stats["pool"]
    assert_pool_whole(stats)


def test_a_request_not_compressed_gets_the_pool_bound_as_a_400(chunk_server) -> None:
    r = _complete(chunk_server, _prompt(4 * POOL, seed=9), 4, {"policy": "none"})
    assert r.status_code == 400, r.text[:300]
    assert "exceeds the maximum allowed length" in r.json()["error"]["message"]
    assert chunk_server.get("/health").status_code == 200


@pytest.mark.parametrize("selection", ["per-head", "shared"])
def test_later_chunks_attend_to_the_kept_entries_at_logical_positions(
    chunk_server, trace: Path, demo_model_path: str, selection: str
) -> None:
    """The served log-probabilities equal a dense forward in which every query (of a later
    chunk, then of decoding) sees exactly the keys its layer's KV head kept, at their logical
    positions; ignoring the evictions is far off, so the test can fail."""
    prompt = _prompt(3 * CHUNK + 100, seed=20 + len(selection))
    out = generate(chunk_server, prompt, 24, sampling={"custom_params": {"sgl_kvc": {"selection": selection}}})
    events = trace_events(trace, out["meta_info"]["id"])
    assert [e["moment"] for e in events].count("chunk") == 3, [e["moment"] for e in events]
    assert all(e["physical_len"] <= BUDGET + CHUNK for e in events)
    # The reference rounds K and V as the FP8 pool stores them.
    attention = fp8_attention(chunk_server.fp8) if chunk_server.fp8 else "eager"
    error = logprob_error(demo_model_path, prompt, out, events)
    err = error(attn_implementation=attention)
    print(f"{chunk_server.fp8 or 'bf16'} {selection}: max |logprob error| {err:.4f}; "
          f"without eviction {error(evict=False, attn_implementation=attention):.3f}")
    # measured: bf16 0.026-0.028; FP8 e4m3 0.077-0.093 (the pool rounds K after RoPE in bf16)
    assert err < (0.12 if chunk_server.fp8 else 0.05), f"served logprobs differ from the dense reference by {err}"
    assert error(evict=False, attn_implementation=attention) > 3 * max(err, 0.05)


def test_the_tree_holds_only_the_prompts_exact_first_chunk(chunk_server, demo_model_path: str) -> None:
    """After a request compressed between chunks, a request for the same prompt without
    compression hits the first chunk only (what was published before the first compaction),
    and its answer is the full cache's: nothing compressed was ever inserted."""
    prompt = _prompt(3 * CHUNK + 50, seed=31)
    generate(chunk_server, prompt, 8)
    plain = generate(chunk_server, prompt, 24, sampling={"custom_params": {"sgl_kvc": {"policy": "none"}}})
    assert plain["meta_info"]["cached_tokens"] == CHUNK
    attention = fp8_attention(chunk_server.fp8) if chunk_server.fp8 else "eager"
    err = logprob_error(demo_model_path, prompt, plain, [])(attn_implementation=attention)
    assert err < 0.05, f"a prefix hit on the published chunk differs from the full cache by {err}"
    assert_pool_whole(chunk_server.wait_idle())
