"""Nothing one request does, or sgl-kvc does for it, stops the other requests; and the invariant
checker really stops a server whose pool accounting is broken.

Faults are planted with `SGLKVC_FAILPOINTS` (see `sgl_kvc.adapter.failpoints`).
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

CMD = [
    sys.executable, "-m", "sgl_kvc.launch", "--model-path", "demo", "--policy", "rkv",
    "--kv-budget", "32", "--kv-buffer", "16",
]
PROMPT = list(range(100, 300))  # 200 token ids: over budget, so compressed after prefill


def _generate(server: ServerProcess, rid: str, n: int = 24, **sampling) -> requests.Response:
    return server.post("/generate", json={
        "rid": rid, "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True, **sampling},
    })


@pytest.fixture(scope="module")
def faulty_server():
    env = {"SGLKVC_FAILPOINTS": "compress_raise", "SGLKVC_CHECK": "1"}
    with ServerProcess.launch(CMD, env=env) as server:
        yield server


def test_an_exception_for_one_request_aborts_only_that_request(faulty_server) -> None:
    rids = ["failpoint-1", "ok-1", "ok-2", "ok-3"]
    with ThreadPoolExecutor(len(rids)) as pool:
        responses = dict(zip(rids, pool.map(lambda rid: _generate(faulty_server, rid), rids)))
    bad = responses.pop("failpoint-1")
    assert bad.status_code >= 400 or bad.json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert "sgl-kvc could not compress" in bad.text
    for rid, r in responses.items():
        assert r.status_code == 200, (rid, r.text[:300])
        assert r.json()["meta_info"]["completion_tokens"] == 24
    stats = faulty_server.wait_idle()
    assert stats["compression"]["failed_requests"] == 1
    assert_pool_whole(stats)
    assert _generate(faulty_server, "ok-after").status_code == 200


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


def test_invariant_check_stops_a_server_with_a_planted_accounting_error() -> None:
    env = {"SGLKVC_FAILPOINTS": "leak_slot", "SGLKVC_CHECK": "1"}
    with ServerProcess.launch(CMD, env=env) as server:
        try:
            _generate(server, "leaky", n=40)  # decode-time compactions evict owned slots
        except requests.RequestException:
            pass  # the scheduler died mid-request
        deadline = time.monotonic() + 60
        while server.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        log = server.log_path.read_text(errors="replace")
    assert "InvariantViolation" in log and "pool accounting" in log, log[-2000:]
