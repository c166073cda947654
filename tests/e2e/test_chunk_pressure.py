"""The default chunk moment: a prompt read in chunks is compressed between them only when its next
chunk would not fit the memory left (`adapter/scheduling/chunk_pressure.py`).

`make serve`'s server (`--policy rkv`, the default moments) with a 2048-slot pool and chunks of 256,
`SGLKVC_CHECK=1` so a broken pool or tree stops it: a prompt of 4x the pool is served, compressed
only a few times on the way (when the pool runs short, not after every chunk); a prompt that fits
is compressed once after its last chunk and keeps exactly the positions it keeps on a server
without the chunk moment (the compaction trace of both).
"""

from __future__ import annotations

import random
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from kvc_reference import assert_pool_whole, generate, trace_events
from loadtest.server import ServerProcess

pytestmark = pytest.mark.e2e

POOL, CHUNK, BUDGET, BUFFER = 2048, 256, 64, 32
VOCAB = 2000  # ids below the demo tokenizer's vocabulary
SERVER = [
    sys.executable, "-m", "sgl_kvc.launch", "--model-path", "demo", "--policy", "rkv",
    "--kv-budget", str(BUDGET), "--kv-buffer", str(BUFFER), "--max-total-tokens", str(POOL),
    "--chunked-prefill-size", str(CHUNK),
]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    """(the default server, the same without the chunk moment), each with its compaction trace."""
    traces = [tmp_path_factory.mktemp(name) / "compactions.jsonl" for name in ("default", "no-chunk")]
    with ServerProcess.launch(SERVER, env={"SGLKVC_CHECK": "1", "SGLKVC_TRACE": str(traces[0])}) as default:
        default.trace = traces[0]  # type: ignore[attr-defined]
        no_chunk = SERVER + ["--compress-on", "prefill,decode,preempt"]
        with ServerProcess.launch(no_chunk, env={"SGLKVC_CHECK": "1", "SGLKVC_TRACE": str(traces[1])}) as plain:
            plain.trace = traces[1]  # type: ignore[attr-defined]
            yield default, plain


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, VOCAB) for _ in range(n)]


def test_the_default_server_answers_a_prompt_of_four_times_its_pool(servers) -> None:
    default, plain = servers
    before = default.stats()["compression"]
    n = 4 * POOL
    out = generate(default, _prompt(n, seed=1), 16)
    assert out["meta_info"]["prompt_tokens"] == n and out["meta_info"]["completion_tokens"] == 16
    moments = [e["moment"] for e in trace_events(default.trace, out["meta_info"]["id"])]
    # Compressed between chunks when the pool ran short, not after each of its 31 middle chunks:
    # each pass frees all but the budget, so the next several chunks fit again.
    assert 0 < moments.count("chunk") <= n // CHUNK // 3, moments
    stats = default.wait_idle()
    c = stats["compression"]
    assert c["failed_requests"] == before["failed_requests"] and c["max_row_slots"] <= POOL, c
    assert_pool_whole(stats)
    # Without the chunk moment the same prompt is longer than the pool: a 400, as SGLang answers.
    r = plain.post("/v1/completions", json={"model": "m", "prompt": _prompt(n, seed=1), "max_tokens": 4})
    assert r.status_code == 400, r.text[:300]


@pytest.mark.parametrize("selection", ["per-head", "shared"])
def test_a_prompt_that_fits_keeps_what_it_keeps_without_the_chunk_moment(servers, selection: str) -> None:
    """Four chunks, far from filling the pool: no pass between them, and the one pass after the
    last chunk keeps the same positions in every layer and head as on a server without it."""
    prompt = _prompt(3 * CHUNK + 100, seed=20 + len(selection))
    kept = []
    for server in servers:
        out = generate(server, prompt, 8, sampling={"custom_params": {"sgl_kvc": {"selection": selection}}})
        events = trace_events(server.trace, out["meta_info"]["id"])
        assert [e["moment"] for e in events] == ["prefill"], [e["moment"] for e in events]
        tokens = [t[1] for t in out["meta_info"]["output_token_logprobs"]]
        kept.append((events[0]["kept_positions"], tokens))
    assert kept[0] == kept[1]


def test_prompts_that_fit_alone_but_not_together_are_all_served(servers) -> None:
    """Five prompts of 900 tokens at once in a 2048-slot pool: admitted by their compressed
    footprint, the ones that run short are compressed between chunks, and all are answered."""
    default, _ = servers
    body = {"model": "m", "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    with ThreadPoolExecutor(5) as pool:
        replies = list(pool.map(
            lambda k: default.post("/v1/completions", json={**body, "prompt": _prompt(900, seed=40 + k)}), range(5)))
    assert [r.status_code for r in replies] == [200] * 5, [r.text[:200] for r in replies]
    assert [r.json()["usage"]["completion_tokens"] for r in replies] == [24] * 5
    assert_pool_whole(default.wait_idle())


@pytest.mark.parametrize("prompt_policy", ["kvzip", "snapkv"])
def test_a_cached_prompt_that_leaves_no_room_is_read_again_in_chunks(servers, prompt_policy: str) -> None:
    """A prompt of 1200 tokens cached whole by an earlier request, then sent with KVzip, whose
    reconstruction forward (a chunk of up to --kvzip-chunk 2048 tokens) cannot sit beside that
    prefix in a 2048-slot pool: it starts from a shorter prefix that leaves it room and is read
    in chunks. Before, SGLang tried to admit it in every round and never could, the scheduler
    spinning and every request behind it waiting until the client gave up. (SnapKV, whose pass
    needs only its budget's copies, starts from the whole prefix.)"""
    default, _ = servers
    prompt = _prompt(1200, seed=60)
    first = generate(default, prompt, 4)
    assert first["meta_info"]["completion_tokens"] == 4
    body = {"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True,
            "kv_compression": {"prompt_policy": prompt_policy}}
    hits = default.stats()["prefix_cache"]["hit_tokens"]
    with ThreadPoolExecutor(2) as pool:  # a request behind it is served too
        behind = pool.submit(requests.post, default.url + "/v1/completions",
                             json={**body, "prompt": _prompt(300, seed=61), "kv_compression": {}}, timeout=120)
        r = requests.post(default.url + "/v1/completions", json=body, timeout=120)
        assert behind.result().status_code == 200, behind.result().text[:300]
    assert r.status_code == 200, r.text[:300]
    cached = default.stats()["prefix_cache"]["hit_tokens"] - hits  # the other's random ids hit ~nothing
    assert (cached < 1200 - 256) if prompt_policy == "kvzip" else cached >= 1200 - 256, cached
    assert_pool_whole(default.wait_idle())
