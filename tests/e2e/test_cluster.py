"""Two sgl-kvc workers (`--policy rkv`, demo model) behind the SGLang Model Gateway (`smg`).

The module's cluster is started once by `sgl_kvc.cluster.LocalCluster` (the code behind
`python -m sgl_kvc.cluster`: the workers together, then a `cache_aware` gateway), with a second,
`round_robin` gateway in front of the same workers for comparison. Everything is on loopback and
every wait is bounded. Checked: the official `openai` client through the gateway (chat, stream,
completions, `kv_compression` reaching a worker), prefix locality (a shared-prefix load through
`cache_aware` hits the radix cache as often as one worker alone and clearly more often than
`round_robin`), the locust runner on the gateway's URL, a worker killed mid-load (only its in-flight requests fail, visibly, and the
gateway sends the rest to the other worker), a restarted worker rejoining, and that stopping
the cluster leaves no process behind.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest
import requests

from loadtest import run
from loadtest.prompts import system_prompt
from loadtest.server import ServerProcess, free_port
from sgl_kvc.server_process import group_members
from sgl_kvc.cluster import (
    ClusterConfig,
    LocalCluster,
    gateway_command,
    healthy_workers,
    wait_all_healthy,
)
from sgl_kvc.cluster_stats import kvc_stats

pytestmark = pytest.mark.e2e
openai = pytest.importorskip("openai")
pytest.importorskip("smg", reason="the gateway is the [cluster] extra (make install installs it)")

WORKER_FLAGS = (
    "--model-path", "demo", "--policy", "rkv", "--kv-budget", "64", "--kv-buffer", "32",
    "--max-total-tokens", "8192",
)  # fmt: skip
TIMEOUT_S = 60.0  # no client call may take longer: a hang fails the test instead of stalling it
# A stream the victim holds must outlast the wait before the kill: 600 tokens took 2.6 s on a
# fast CPU, 1,500 are several seconds on any, and well inside TIMEOUT_S on a loaded one.
STREAM_TOKENS = 1500
# Distinct long system prompts ("applications"), odd: with an even number, requests arriving in
# the same order every round would give round_robin the same worker for a prefix every time.
PREFIXES = 7
ROUNDS = 4  # each round: one request per system prompt, one after another


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    config = ClusterConfig(workers=2, router_policy="cache_aware", port=free_port(),
                           server_flags=WORKER_FLAGS)  # fmt: skip
    with LocalCluster.start(config) as c:
        yield c
        groups = [p.proc.pid for p in (c.gateway, *c.workers)]  # restarted workers included
    left = {g: group_members(g) for g in groups if group_members(g)}
    assert not left, f"process groups left behind: {left}"


@pytest.fixture(scope="module")
def round_robin(cluster: LocalCluster) -> Iterator[ServerProcess]:
    """A second gateway, round_robin, in front of the same two workers."""
    urls = [w.url for w in cluster.workers]
    with ServerProcess.launch(
        gateway_command(urls, "round_robin"), timeout_s=TIMEOUT_S, ready_path="/readiness"
    ) as gateway:
        wait_all_healthy(gateway.url, urls, TIMEOUT_S)
        yield gateway


@pytest.fixture(scope="module")
def client(cluster: LocalCluster):
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0,
                         timeout=TIMEOUT_S)  # fmt: skip


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _total(cluster: LocalCluster, block: str, key: str) -> int:
    return sum(w.stats()[block][key] for w in cluster.workers if w.proc.poll() is None)


def test_openai_client_through_the_gateway(cluster: LocalCluster, client, model: str) -> None:
    # ignore_eos: the demo model samples at random and may end before max_tokens
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello there"}], max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Stream please"}], max_tokens=8,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))  # fmt: skip
    assert chunks[-1].usage.completion_tokens == 8
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    done = client.completions.create(model=model, prompt="The river and the bridge", max_tokens=6,
                                     extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 6

    # kv_compression travels through the gateway untouched: a bad budget is the worker's 400 ...
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            extra_body={"kv_compression": {"budget": 0}},
        )  # fmt: skip
    assert bad.value.status_code == 400 and "kv_compression.budget" in str(bad.value.body)
    # ... and a good one compresses on the worker that serves the request
    passes = _total(cluster, "compression", "passes")
    client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": system_prompt(5, 120)}], max_tokens=40,
        extra_body={"kv_compression": {"policy": "snapkv", "budget": 16}, "ignore_eos": True},
    )  # fmt: skip
    assert _total(cluster, "compression", "passes") > passes

    # the cluster's /v1/kvc/stats view: the workers' sum, each worker listed
    view = kvc_stats(cluster.url)
    assert view is not None and view["cluster"] == {"workers": 2, "answering": 2}
    assert {w["url"] for w in view["per_worker"]} == {w.url for w in cluster.workers}
    assert view["pool"]["total_tokens"] == sum(w.stats()["pool"]["total_tokens"] for w in cluster.workers)


def _shared_prefix_load(url: str, model: str) -> None:
    """ROUNDS rounds; in each, PREFIXES users send one chat each, one after another, each with its
    own long system prompt and a new question. One at a time, so that the gateway sees them in
    the same order every time: round_robin then alternates the workers for a prefix from round
    to round (it misses each prefix twice, hit rate about 1/2), where requests sent all at once
    reached it in an order that varied with the machine's load (a CI run measured 0.65), and a
    request's hit depends only on where the earlier ones of its prefix went."""
    systems = [system_prompt(11, 160, i) for i in range(PREFIXES)]

    def one(job: tuple[int, int]) -> None:
        round_, k = job
        r = requests.post(url + "/v1/chat/completions", timeout=TIMEOUT_S, json={
            "model": model, "max_tokens": 4, "temperature": 0.0,
            "messages": [{"role": "system", "content": systems[k]},
                         {"role": "user", "content": f"Question {round_} about note {k}."}],
        })  # fmt: skip
        assert r.status_code == 200, r.text[:300]

    for round_ in range(ROUNDS):
        for k in range(PREFIXES):
            one((round_, k))


def _hit_rate(cluster: LocalCluster, run: Any) -> float:
    """Prefix hit rate over both workers (hit / prompt tokens, from /v1/kvc/stats) of `run()`,
    both caches emptied first."""
    for w in cluster.workers:
        w.wait_idle()
        # SGLang refuses a flush while anything is queued, the gateway's health checks included:
        # `timeout` makes it wait (up to 30 s) for the queue to empty instead.
        flushed = w.post("/flush_cache?timeout=30", json={})
        assert flushed.status_code == 200, flushed.text
    before = [w.stats()["prefix_cache"] for w in cluster.workers]
    run()
    after = [w.wait_idle()["prefix_cache"] for w in cluster.workers]
    hits = sum(a["hit_tokens"] - b["hit_tokens"] for a, b in zip(after, before))
    prompt = sum(a["prompt_tokens"] - b["prompt_tokens"] for a, b in zip(after, before))
    return hits / prompt


def test_cache_aware_routing_keeps_prefixes_together(
    cluster: LocalCluster, round_robin: ServerProcess, model: str
) -> None:
    alone = _hit_rate(cluster, lambda: _shared_prefix_load(cluster.workers[0].url, model))
    aware = _hit_rate(cluster, lambda: _shared_prefix_load(cluster.url, model))
    robin = _hit_rate(cluster, lambda: _shared_prefix_load(round_robin.url, model))
    rates = f"one worker {alone:.2f}, cache_aware {aware:.2f}, round_robin {robin:.2f}"
    print(f"prefix hit rate: {rates}")  # shown with -s / in the CI log of a failure
    # One worker misses each prefix once (1 of ROUNDS); round_robin twice (once per worker).
    assert alone > 0.5, rates
    assert aware >= alone - 0.05, rates
    assert aware >= robin + 0.12, rates


def test_the_load_test_runs_against_the_gateway(cluster: LocalCluster, tmp_path: Path) -> None:
    """The locust runner, unchanged, on the gateway's URL: the cluster view of /v1/kvc/stats
    gives it the prefix hit rate and the requests in flight over both workers."""
    (s,) = run.main([
        "--url", cluster.url, "--name", "gateway", "--users", "4", "--spawn-rate", "4",
        "--duration", "6", "--scenario", "shared_prefix", "--system-prompts", "3",
        "--stop-timeout", "30", "--out", str(tmp_path),
    ])  # fmt: skip
    assert s.failures == 0 and s.requests >= 4, s
    assert s.prefix_hit_rate and s.prefix_hit_rate > 0.3, s
    assert s.peak_running_sampled and s.max_running, s
    summary = json.loads((tmp_path / "gateway" / "summary.json").read_text())
    assert summary["kvc_stats_after"]["cluster"] == {"workers": 2, "answering": 2}


def _stream(url: str, model: str, k: int, max_tokens: int) -> tuple[bool, str, float]:
    """One streamed chat: (completed, error the client saw, seconds). Completed means the
    stream ended with a finish reason and the usage; anything else is a visible failure."""
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)
    t0 = time.monotonic()
    finish, usage = None, None
    try:
        for chunk in c.chat.completions.create(
            model=model, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": f"User {k}: write about the valley."}],
        ):  # fmt: skip
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            usage = chunk.usage or usage
    except Exception as e:  # noqa: BLE001 - the error is what the test looks at
        return False, f"{type(e).__name__}: {e}"[:200], time.monotonic() - t0
    ok = finish == "length" and usage is not None and usage.completion_tokens == max_tokens
    return ok, "" if ok else f"stream ended early (finish={finish})", time.monotonic() - t0


def test_a_killed_worker_fails_only_its_requests(cluster: LocalCluster, model: str) -> None:
    with ThreadPoolExecutor(16) as pool:
        # Long streams, one after another, until a worker holds two: the victim. Which one
        # depends on the gateway (cache_aware sends similar prompts mostly to one worker, and
        # spreads them only once that one is loaded enough).
        jobs: list = []
        while not (loaded := [w for w in cluster.workers if w.stats()["requests"]["running"] >= 2]):
            assert len(jobs) < 16, "no worker holds two of 16 streams"
            jobs.append(pool.submit(_stream, cluster.url, model, len(jobs), STREAM_TOKENS))
            time.sleep(0.25)
        victim = loaded[0]
        survivor = next(w for w in cluster.workers if w is not victim)
        # The last stream may still be on its way (in the gateway, or queued at a worker on a
        # loaded machine): let every stream start somewhere, so that each one is either the
        # victim's or the survivor's when the victim dies. Count only the streams still open: one
        # that ended meanwhile runs nowhere, and waiting for it would let the others end too.
        deadline = time.monotonic() + 5
        running = lambda: sum(w.stats()["requests"]["running"] for w in cluster.workers)  # noqa: E731
        while running() < sum(not j.done() for j in jobs) and time.monotonic() < deadline:
            time.sleep(0.05)
        in_flight = victim.stats()["requests"]["running"]
        victim.kill()  # SIGKILL, its whole process group
        results = [job.result(timeout=2 * TIMEOUT_S) for job in jobs]
    failed = [r for r in results if not r[0]]
    print(f"killed with {in_flight} in flight; {len(failed)} of {len(results)} failed: "
          f"{sorted({err for _, err, _ in failed})}")
    assert 1 <= len(failed) <= in_flight, (in_flight, results)
    assert all(err for _, err, _ in failed)  # the client saw each failure
    assert max(s for _, _, s in results) < TIMEOUT_S  # and none hung

    # New requests go to the survivor, and all succeed (some may be retried by the gateway).
    served = survivor.wait_idle()["prefix_cache"]["requests"]
    with ThreadPoolExecutor(4) as pool:
        after = list(pool.map(lambda k: _stream(cluster.url, model, 100 + k, 16), range(6)))
    assert all(ok for ok, _, _ in after), after
    assert survivor.wait_idle()["prefix_cache"]["requests"] - served == 6
    deadline = time.monotonic() + 30
    while victim.url in healthy_workers(cluster.url):
        assert time.monotonic() < deadline, "the gateway still counts the killed worker healthy"
        time.sleep(0.5)
    print(f"killed worker unhealthy at the gateway {30 - (deadline - time.monotonic()):.1f} s "
          "after the survivor's requests")
    view = kvc_stats(cluster.url)  # the cluster view names the missing worker
    assert view is not None and view["cluster"] == {"workers": 2, "answering": 1}


def test_a_restarted_worker_rejoins(cluster: LocalCluster, model: str) -> None:
    # the worker the test above killed; run alone, crash one first
    worker = next((w for w in cluster.workers if w.proc.poll() is not None), cluster.workers[1])
    if worker.proc.poll() is None:
        worker.kill()
    worker.restart(timeout_s=240)  # same command, same address
    t0 = time.monotonic()
    wait_all_healthy(cluster.url, [w.url for w in cluster.workers], TIMEOUT_S)
    print(f"restarted worker healthy at the gateway {time.monotonic() - t0:.1f} s after its own /health")
    before = worker.stats()["prefix_cache"]["requests"]
    for batch in range(4):  # new prompts: the gateway balances them over both workers
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda k: _stream(cluster.url, model, 200 + 4 * batch + k, 8),
                                    range(4)))  # fmt: skip
        assert all(ok for ok, _, _ in results), results
        if worker.wait_idle()["prefix_cache"]["requests"] > before:
            break
    assert worker.stats()["prefix_cache"]["requests"] > before, "no request reached the restarted worker"
