"""Tensor parallelism on CPU (two ranks, one KV head each): both ranks must keep the same tokens.

Each rank runs its own scheduler and compresses with the scores of its own KV heads; the scores
are averaged over the TP group before choosing (`sgl_kvc.adapter.tp`). The compaction trace
records each rank's kept logical positions. The planted fault `tp_local_scores` turns the
averaging off, to show that this test can fail.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
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


def _kept_by_rank(trace: Path) -> dict[tuple[str, int], list[list[int]]]:
    """(rid, rank) -> kept positions of each compaction, in order."""
    out: dict[tuple[str, int], list[list[int]]] = defaultdict(list)
    for line in trace.read_text().splitlines():
        e = json.loads(line)
        out[(e["rid"], e["tp_rank"])].append(e["kept_positions"])
    return out


def _run(tmp_path: Path, faults: str) -> tuple[int, int]:
    """(compactions compared, compactions where the two ranks kept different tokens)."""
    trace = tmp_path / f"trace-{faults or 'none'}.jsonl"
    env = {**ENV, "SGLKVC_TRACE": str(trace), "SGLKVC_FAILPOINTS": faults}
    with ServerProcess.launch(CMD, env=env, timeout_s=400) as server:
        for k, policy in enumerate(("rkv", "snapkv", "h2o", "kvcompress")):
            r = server.post("/generate", json={
                "rid": f"tp-{policy}", "input_ids": [(37 * i + k) % 1900 + 10 for i in range(160)],
                "sampling_params": {
                    "max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True,
                    "custom_params": {"sgl_kvc": {"policy": policy}},
                },
            })
            assert r.status_code == 200, r.text[:300]
    kept = _kept_by_rank(trace)
    compared = differ = 0
    for (rid, rank), events in kept.items():
        if rank != 0:
            continue
        other = kept[(rid, 1)]
        assert len(other) == len(events), rid  # same number of compactions on both ranks
        compared += len(events)
        differ += sum(a != b for a, b in zip(events, other))
    return compared, differ


def test_ranks_keep_the_same_tokens(tmp_path: Path) -> None:
    compared, differ = _run(tmp_path, "")
    assert compared >= 8 and differ == 0


def test_without_the_all_reduce_ranks_diverge(tmp_path: Path) -> None:
    compared, differ = _run(tmp_path, "tp_local_scores")
    assert compared >= 8 and differ > 0
