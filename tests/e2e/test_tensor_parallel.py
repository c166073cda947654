"""Tensor parallelism on CPU (two ranks, one KV head each).

Each rank runs its own scheduler and compresses with the scores of its own KV heads. With the
shared selection both ranks must keep the same tokens: the scores are averaged over the TP group
before choosing (`sgl_kvc.adapter.tp`); the planted fault `tp_local_scores` turns the averaging
off, to show that this test can fail. Per head, each rank chooses for its own heads alone (no
all-reduce): the ranks keep different tokens but the same number of entries, so their slot
tables stay identical. The compaction trace records each rank's kept logical positions.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from loadtest.server import ServerProcess

pytestmark = pytest.mark.e2e

CMD = [
    sys.executable, "-m", "sgl_kvc.launch", "--model-path", "demo", "--policy", "rkv",
    "--kv-budget", "32", "--kv-buffer", "16", "--tp-size", "2", "--max-total-tokens", "4096",
]
# SGLang's CPU engine wants one NUMA node per rank unless cores are bound explicitly.
ENV = {"SGLKVC_CHECK": "1", "SGLANG_CPU_OMP_THREADS_BIND": "0|1"}


def _kept_by_rank(trace: Path) -> dict[tuple[str, int], list[list]]:
    """(rid, rank) -> kept positions of each compaction, in order."""
    out: dict[tuple[str, int], list[list]] = defaultdict(list)
    for line in trace.read_text().splitlines():
        e = json.loads(line)
        out[(e["rid"], e["tp_rank"])].append(e["kept_positions"])
    return out


def _run(
    tmp_path: Path, faults: str, selections: tuple[str, ...] = ("shared", "per-head")
) -> dict[str, list[tuple[list, list]]]:
    """selection -> (rank 0's, rank 1's) kept positions of every compaction. The requests run
    concurrently (one batch: each rank compacts several requests in the same step)."""
    trace = tmp_path / f"trace-{faults or 'none'}.jsonl"
    env = {**ENV, "SGLKVC_TRACE": str(trace), "SGLKVC_FAILPOINTS": faults}

    def one(server: ServerProcess, selection: str, k: int, policy: str) -> None:
        r = server.post("/generate", json={
            "rid": f"tp-{selection}-{policy}",
            "input_ids": [(37 * i + k) % 1900 + 10 for i in range(160)],
            "sampling_params": {
                "max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True,
                "custom_params": {"sgl_kvc": {"policy": policy, "selection": selection}},
            },
        })
        assert r.status_code == 200, r.text[:300]

    with ServerProcess.launch(CMD, env=env, timeout_s=400) as server, ThreadPoolExecutor(8) as pool:
        jobs = [pool.submit(one, server, selection, k, policy) for selection in selections
                for k, policy in enumerate(("rkv", "snapkv", "h2o", "kvcompress"))]
        for job in jobs:
            job.result()
    kept = _kept_by_rank(trace)
    pairs: dict[str, list[tuple[list, list]]] = defaultdict(list)
    for (rid, rank), events in kept.items():
        if rank != 0:
            continue
        other = kept[(rid, 1)]
        assert len(other) == len(events), rid  # same number of compactions on both ranks
        pairs[rid.split("-")[1]] += list(zip(events, other))
    return pairs


def test_ranks_keep_the_same_tokens_or_choose_per_head(tmp_path: Path) -> None:
    pairs = _run(tmp_path, "")
    shared = pairs["shared"]
    assert len(shared) >= 8 and all(a == b for a, b in shared)
    per_head = pairs["per"]  # rids "tp-per-head-<policy>"
    assert len(per_head) >= 8
    # [layer][the rank's one KV head] lists: same count on both ranks, chosen by each rank
    assert all(len(a[0][0]) == len(b[0][0]) for a, b in per_head)
    assert any(a != b for a, b in per_head)


def test_without_the_all_reduce_ranks_diverge(tmp_path: Path) -> None:
    shared = _run(tmp_path, "tp_local_scores", selections=("shared",))["shared"]
    assert len(shared) >= 8 and any(a != b for a, b in shared)
