"""Prompts longer than the chunked-prefill size, under every policy, with the invariants on.

The workload this project exists for: a prompt that SGLang prefills in several chunks. Two servers:
SGLang's default chunk (4096 on CPU) with the default moments, where a request whose prompt fits is
compressed once its last chunk is in and never between its chunks (the tree holds its earlier chunks
as exact KV and the next chunk extends them; only prompts that together outgrow the pool are cut back
between chunks); and chunks of 256 with `chunk-always`, where every policy cuts the request back
after each chunk. `SGLKVC_CHECK=1` so a broken pool or tree stops the server; each
policy is chosen per request. Prompts go up to the model's context length."""

from __future__ import annotations

import random
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvc_reference import assert_pool_whole
from loadtest.server import ServerProcess
from sgl_kvc.policies import available_policies, decode_policies

pytestmark = pytest.mark.e2e

CONTEXT = 16384  # the demo model's max_position_embeddings
VOCAB = 2000  # ids below the demo tokenizer's vocabulary
BUDGET = 64
# Every decode policy, and every prompt-only policy (KVzip) as the prompt policy of R-KV.
POLICIES = [{"policy": p} for p in decode_policies() if p != "none"] + [
    {"policy": "rkv", "prompt_policy": p} for p in available_policies() if p not in decode_policies()
]


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, VOCAB) for _ in range(n)]


def _complete(server: ServerProcess, ids: list[int], policy: str | dict, max_tokens: int = 4) -> dict:
    settings = {"policy": policy} if isinstance(policy, str) else policy
    r = server.post(
        "/v1/completions",
        json={
            "model": "m", "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "kv_compression": settings,
        },
    )
    assert r.status_code == 200, (policy, len(ids), r.text[:500])
    return r.json()


# (chunked-prefill size or None for SGLang's default 4096 on CPU, prompt length per policy,
# compressed between chunks too)
SERVERS = {"chunk-default": (None, 6000, False), "chunk-256-compressed": (256, 1500, True)}


@pytest.fixture(scope="module", params=list(SERVERS))
def long_server(request):
    chunk, n, between_chunks = SERVERS[request.param]
    cmd = [
        sys.executable, "-m", "sgl_kvc.launch", "--model-path", "demo", "--policy", "rkv",
        "--kv-budget", str(BUDGET), "--kv-buffer", "32", "--max-total-tokens", str(CONTEXT + 512),
    ]
    if chunk is not None:
        cmd += ["--chunked-prefill-size", str(chunk)]
    if between_chunks:
        cmd += ["--compress-on", "chunk-always,prefill,decode,preempt"]
    with ServerProcess.launch(cmd, env={"SGLKVC_CHECK": "1"}) as server:
        server.prompt_len = n  # type: ignore[attr-defined]
        server.chunked = chunk is not None  # type: ignore[attr-defined]
        server.between_chunks = between_chunks  # type: ignore[attr-defined]
        yield server


def test_long_prompt_every_policy(long_server: ServerProcess) -> None:
    """A prompt of several chunks under each policy, one after another."""
    before = long_server.stats()["compression"]
    for k, policy in enumerate(POLICIES):
        out = _complete(long_server, _prompt(long_server.prompt_len, seed=k), policy)
        assert out["usage"]["completion_tokens"] == 4
    stats = long_server.wait_idle()
    c = stats["compression"]
    # Every request was compressed after its prefill (its prompt is far over budget) ...
    assert c["prefill_passes"] - before["prefill_passes"] >= len(POLICIES), c
    # ... between its chunks only where that moment is on (1500 tokens: 5 chunks before the last) ...
    chunk_passes = c["chunk_passes"] - before["chunk_passes"]
    assert chunk_passes >= 5 * len(POLICIES) if long_server.between_chunks else chunk_passes == 0, c
    # ... and nothing is leaked: every slot is free or cached in the tree.
    assert_pool_whole(stats)


def test_prompt_at_context_length(long_server: ServerProcess) -> None:
    """The longest prompt the model takes (context length minus the answer)."""
    n = CONTEXT - 8
    # one policy without and one with attention statistics (only rkv at 64 chunks: slow on CPU)
    policies = ("rkv",) if long_server.chunked else ("rkv", "h2o")
    for policy in policies:
        out = _complete(long_server, _prompt(n, seed=99), policy, max_tokens=4)
        assert out["usage"]["prompt_tokens"] == n


def test_long_prompts_concurrently(long_server: ServerProcess) -> None:
    """Several chunked prompts in flight at once, with decoding requests beside them."""
    base = 2500 if not long_server.chunked else 700
    jobs = [(_prompt(base + 300 * k, seed=100 + k), p) for k, p in enumerate(POLICIES)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda job: _complete(long_server, *job, max_tokens=48), jobs))
    assert [o["usage"]["completion_tokens"] for o in outs] == [48] * len(jobs)
    assert_pool_whole(long_server.wait_idle())
    assert long_server.get("/health").status_code == 200
