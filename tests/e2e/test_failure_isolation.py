"""Nothing one request does, or sgl-kvc does for it, stops the other requests; and the invariant
checker really stops a server whose pool accounting is broken.

Faults are planted with `SGLKVC_FAILPOINTS` (see `sgl_kvc.adapter.safety.failpoints`). The server
compresses between the chunks of a prompt (chunks of 64 tokens) and its pool is small, so a
request that fails between two chunks must be released before its next chunk: a prompt longer
than the pool cannot go on uncompressed.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from kvc_reference import assert_pool_whole
from loadtest.server import ServerProcess

pytestmark = pytest.mark.e2e

POOL = 1536
CMD = [
    sys.executable, "-m", "sgl_kvc.launch", "--model-path", "demo", "--policy", "rkv",
    "--kv-budget", "32", "--kv-buffer", "16", "--max-total-tokens", str(POOL),
    "--chunked-prefill-size", "64", "--compress-on", "chunk-always,prefill,decode,preempt",
    "--kvzip-chunk", "128",  # KVzip's reconstruction forwards fit this small pool beside a chunk
]
PROMPT = list(range(100, 300))  # 200 token ids: over budget, compressed between chunks and after prefill
SHORT = list(range(300, 320))  # 20 token ids: first compressed during decode (at budget + buffer)


def _generate(server: ServerProcess, rid: str, n: int = 24, prompt: list[int] = PROMPT, **sampling) -> requests.Response:
    return server.post("/generate", json={
        "rid": rid, "input_ids": prompt,
        "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True, **sampling},
    })


@pytest.fixture(scope="module")
def faulty_server():
    env = {"SGLKVC_FAILPOINTS": "compress_raise,rewrite_raise,leak_slot,observe_raise,skip_compaction,"
                                "reconstruct_raise",
           "SGLKVC_CHECK": "1"}
    with ServerProcess.launch(CMD, env=env) as server:
        yield server


def test_an_exception_for_one_request_aborts_only_that_request(faulty_server) -> None:
    _only_the_planted_request_fails(faulty_server, "failpoint-compress-1")


def test_a_failed_row_rewrite_aborts_only_its_request_and_leaves_the_pool_whole(faulty_server) -> None:
    """The kept entries of every request due in the step move together; one request's row
    rewrite then fails: its old row still owns its slots (freed when it is aborted), the others
    are rewritten and freed, and the invariant check (SGLKVC_CHECK=1) finds the pool whole."""
    _only_the_planted_request_fails(faulty_server, "failpoint-rewrite-1")


def test_a_prompt_longer_than_the_pool_whose_compression_fails_is_released_at_once(faulty_server) -> None:
    """It fails at its first chunk: SGLang's abort of a chunked prefill releases it before its next
    chunk (uncompressed, the rest of its prompt would never fit), and it is counted once."""
    long_prompt = [(7 * i) % 1500 + 10 for i in range(3 * POOL)]
    _only_the_planted_request_fails(faulty_server, "failpoint-compress-long", planted_prompt=long_prompt)


def test_a_failed_reconstruction_pass_fails_only_its_request(faulty_server) -> None:
    """KVzip's reconstruction forward is shared by the requests compressed in the same moment; a
    fault while one request's scores are folded fails that request alone, also between two chunks
    of a prompt three times the pool (released before its next chunk), and leaves nothing held."""
    kvzip = {"custom_params": {"sgl_kvc": {"prompt_policy": "kvzip"}}}
    _only_the_planted_request_fails(faulty_server, "failpoint-reconstruct-1", sampling=kvzip)
    long_prompt = [(11 * i) % 1500 + 10 for i in range(3 * POOL)]
    _only_the_planted_request_fails(faulty_server, "failpoint-reconstruct-long", planted_prompt=long_prompt,
                                    sampling=kvzip)
    assert faulty_server.wait_idle()["compression"]["reconstruction"]["passes"] > 0


def test_lost_observations_fail_only_their_request(faulty_server) -> None:
    """The planted request's queries fail to record in the second layer at every step: its
    observations are emptied each time (never left stale), and it fails alone when it is
    compressed, after prefill or during decode; its neighbours, in the same batches, record
    theirs row by row and compress with them."""
    lost_before = faulty_server.wait_idle()["compression"]["lost_observations"]
    _only_the_planted_request_fails(faulty_server, "failpoint-observe-prefill")
    _only_the_planted_request_fails(faulty_server, "failpoint-observe-decode", prompt=SHORT, n=40)
    stats = faulty_server.wait_idle()
    assert stats["compression"]["lost_observations"] > lost_before
    assert stats["compression"]["decode_passes"] > 0


def test_a_compaction_without_free_slots_between_chunks_fails_only_its_request(faulty_server) -> None:
    """Its next chunk cannot fit uncompressed: it is released at once with a clear error, and the
    server never reaches SGLang's "Prefill out of memory"."""
    long_prompt = [(11 * i) % 1500 + 10 for i in range(3 * POOL)]
    bad = _only_the_planted_request_fails(faulty_server, "failpoint-skip-chunk-1", planted_prompt=long_prompt)
    assert "between two chunks of its prompt" in bad.text and "no free slots" in bad.text


def test_a_compaction_without_free_slots_after_prefill_is_put_off(faulty_server) -> None:
    """The prompt (50 tokens, one chunk) is not cut after prefill: the request goes on, and is
    compressed by its first decode pass once it is due again."""
    before = faulty_server.wait_idle()["compression"]
    r = _generate(faulty_server, "failpoint-skip-prefill-1", 40, prompt=list(range(400, 450)))
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 40, r.text[:300]
    c = faulty_server.wait_idle()["compression"]
    assert c["skipped"] == before["skipped"] + 1 and c["failed_requests"] == before["failed_requests"], c
    assert c["decode_passes"] > before["decode_passes"]


def test_decode_compactions_without_free_slots_back_off(faulty_server) -> None:
    """Every decode compaction of the request finds no free slots: its pass is put off by 2, 4, 8
    and 16 tokens, not scored and thrown away at each of the 32 steps it is over its trigger."""
    before = faulty_server.wait_idle()["compression"]
    r = _generate(faulty_server, "failpoint-skip-decode-1", 60, prompt=SHORT)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 60, r.text[:300]
    stats = faulty_server.wait_idle()
    c = stats["compression"]
    assert 1 <= c["skipped"] - before["skipped"] <= 6 and c["failed_requests"] == before["failed_requests"], c
    assert_pool_whole(stats)


def _only_the_planted_request_fails(
    server: ServerProcess, planted: str, prompt: list[int] = PROMPT, n: int = 24, planted_prompt: list[int] | None = None,
    sampling: dict | None = None,
) -> requests.Response:
    failed_before = server.wait_idle()["compression"]["failed_requests"]
    rids = [planted, "ok-1", "ok-2", "ok-3"]

    def one(rid: str) -> requests.Response:
        return _generate(server, rid, n, planted_prompt if rid == planted and planted_prompt else prompt,
                         **(sampling or {}))

    with ThreadPoolExecutor(len(rids)) as pool:
        responses = dict(zip(rids, pool.map(one, rids)))
    bad = responses.pop(planted)
    assert bad.status_code >= 400 or bad.json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert "sgl-kvc could not compress" in bad.text
    for rid, r in responses.items():
        assert r.status_code == 200, (rid, r.text[:300])
        assert r.json()["meta_info"]["completion_tokens"] == n
    stats = server.wait_idle()
    assert stats["compression"]["failed_requests"] == failed_before + 1  # once, however many chunks
    assert_pool_whole(stats)
    assert stats["pool"]["request_state_bytes"] == 0
    assert _generate(server, "ok-after").status_code == 200
    return bad


@pytest.mark.parametrize(
    "settings",
    [{"policy": "bogus"}, {"budget": "x"}, {"budget": -5}, {"budget": 1.5}, {"unknown": 1}, ["rkv"], None],
    ids=["policy", "budget-str", "budget-neg", "budget-float", "unknown-key", "list", "null"],
)
def test_bad_custom_params_are_a_400_for_that_request(faulty_server, settings) -> None:
    r = _generate(faulty_server, f"bad-{time.monotonic_ns()}", custom_params={"sgl_kvc": settings})
    assert r.status_code == 400, r.text[:300]
    assert "sgl_kvc" in r.text
    assert faulty_server.get("/health").status_code == 200


def test_request_mix(faulty_server, request_mix) -> None:
    """The request-mix fuzz test (tests/request_mix.py): uniform per-head budgets, the chunk moment on."""
    request_mix(faulty_server, ci_seed=1000)


def test_invariant_check_stops_a_server_with_a_planted_accounting_error(faulty_server) -> None:
    """The last test of the module: the server it stops is the module's."""
    try:
        _generate(faulty_server, "failpoint-leak-1", n=40)  # decode-time compactions evict owned slots
    except requests.RequestException:
        pass  # the scheduler died mid-request
    deadline = time.monotonic() + 60
    while faulty_server.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    log = faulty_server.log_path.read_text(errors="replace")
    assert "InvariantViolation" in log and "pool accounting" in log, log[-2000:]
