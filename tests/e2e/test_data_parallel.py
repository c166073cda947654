"""Data parallelism: `--dp-size 2` runs two schedulers, each with sgl-kvc's hooks and state.

SGLang's data-parallel controller hands each request to one rank; every rank compresses its own
requests with its own pool, and `/v1/kvc/stats` answers for the whole server (the sum) and per
rank. No SGLANG_CPU_OMP_THREADS_BIND is set here: on a machine with fewer NUMA nodes than ranks
the launcher splits the cores between the ranks itself. Every policy is asked for per request
(`kv_compression`), with the pool and tree invariants checked after every compaction.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import pytest

from kvc_reference import assert_pool_whole
from loadtest.server import ServerProcess

pytestmark = pytest.mark.e2e

POLICIES = ("rkv", "h2o", "snapkv", "streamingllm", "batchmax", "kvcompress")
CMD = [
    sys.executable, "-m", "sgl_kvc.launch", "--model-path", "demo", "--policy", "rkv",
    "--kv-budget", "32", "--kv-buffer", "16", "--dp-size", "2", "--max-total-tokens", "4096",
]  # fmt: skip


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess.launch(CMD, env={"SGLKVC_CHECK": "1"}) as s:
        yield s


def _generate(server: ServerProcess, k: int, policy: str) -> None:
    r = server.post("/generate", json={
        "input_ids": [(31 * i + 7 * k) % 1900 + 10 for i in range(160)],
        "sampling_params": {
            "max_new_tokens": 48, "temperature": 0.0, "ignore_eos": True,
            "custom_params": {"sgl_kvc": {"policy": policy}},
        },
    })  # fmt: skip
    assert r.status_code == 200, r.text[:300]
    assert r.json()["meta_info"]["completion_tokens"] == 48


def test_every_policy_compresses_on_both_ranks(server: ServerProcess) -> None:
    before = server.stats()
    jobs = [(k, policy) for k, policy in enumerate(POLICIES * 2)]
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda job: _generate(server, *job), jobs))
    stats = server.wait_idle()
    assert stats["dp_size"] == 2
    ranks = stats["per_rank"]
    assert [r["dp_rank"] for r in ranks] == [0, 1]
    served = [r["prefix_cache"]["requests"] - b["prefix_cache"]["requests"]
              for r, b in zip(ranks, before["per_rank"])]  # fmt: skip
    assert sum(served) == len(jobs) and all(n > 0 for n in served), served  # both ranks served
    assert all(r["compression"]["passes"] > 0 for r in ranks)
    assert all(r["compression"]["failed_requests"] == 0 for r in ranks)
    # the top level is the sum over the ranks
    for block, key in (("compression", "passes"), ("compression", "evicted_tokens"),
                       ("pool", "total_tokens"), ("pool", "free_tokens"),
                       ("prefix_cache", "prompt_tokens")):  # fmt: skip
        assert stats[block][key] == sum(r[block][key] for r in ranks), (block, key)
    assert stats["pool"]["total_tokens"] == 2 * 4096  # one pool per rank
    for rank in ranks:
        assert_pool_whole(rank)
    assert_pool_whole(stats)

