"""Tensor parallelism on CPU (two ranks, one KV head each).

Each rank runs its own scheduler and compresses with the scores of its own KV heads. With the
shared selection both ranks must keep the same tokens: the scores are averaged over the TP group
before choosing (`sgl_kvc.adapter.safety.tp`); the planted fault `tp_local_scores` turns the averaging
off for requests named `failpoint-tp-...`, to show that this test can fail. One server serves both
tests. Per head, each rank chooses for its own heads alone (no
all-reduce): the ranks keep different tokens but the same number of entries, so their slot
tables stay identical. The compaction trace records each rank's kept logical positions.

Faults planted on rank 1 alone (`name@1`) show that a request sgl-kvc fails on one rank fails on
both, in the same step: the ranks' schedulers stay in lock step and no rank waits alone in a
collective.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from kvc_reference import assert_pool_whole
from loadtest.server import ServerProcess

pytestmark = pytest.mark.e2e

CMD = [
    sys.executable, "-m", "sgl_kvc.launch", "--model-path", "demo", "--policy", "rkv",
    "--kv-budget", "32", "--kv-buffer", "16", "--tp-size", "2", "--max-total-tokens", "4096",
    "--chunked-prefill-size", "64",  # 160-token prompts: compressed between their chunks too
    "--compress-on", "chunk-always,prefill,decode,preempt",
]
# SGLang's CPU engine wants one NUMA node per rank unless cores are bound explicitly.
ENV = {"SGLKVC_CHECK": "1", "SGLANG_CPU_OMP_THREADS_BIND": "0|1",
       "SGLKVC_FAILPOINTS": "tp_local_scores,compress_raise@1,rewrite_raise@1,reconstruct_raise@1,document_raise@1,"
                            "kvzip_plan_raise@1,turn_raise@1,node_raise@1"}
POLICIES = ("rkv", "snapkv", "h2o", "kvcompress")


def _kept_by_rank(trace: Path) -> dict[tuple[str, int], list[tuple[str, list]]]:
    """(rid, rank) -> (moment, kept positions) of each compaction, in order."""
    out: dict[tuple[str, int], list[tuple[str, list]]] = defaultdict(list)
    for line in trace.read_text().splitlines():
        e = json.loads(line)
        out[(e["rid"], e["tp_rank"])].append((e["moment"], e["kept_positions"]))
    return out


@pytest.fixture(scope="module")
def tp_server(trace: Path):
    with ServerProcess.launch(CMD, env={**ENV, "SGLKVC_TRACE": str(trace)}, timeout_s=400) as server:
        yield server


def _run(server: ServerProcess, trace: Path, prefix: str, selections: tuple[str, ...]) -> dict[str, list[tuple[list, list]]]:
    """selection -> (rank 0's, rank 1's) kept positions of every compaction of the requests
    named `<prefix>-<selection>-<policy>`. They run concurrently (one batch: each rank compacts
    several requests in the same step)."""

    def one(selection: str, k: int, policy: str) -> None:
        r = server.post("/generate", json={
            "rid": f"{prefix}-{selection}-{policy}",
            "input_ids": [(37 * i + k) % 1900 + 10 for i in range(160)],
            "sampling_params": {
                "max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True,
                "custom_params": {"sgl_kvc": {"policy": policy, "selection": selection}},
            },
        })
        assert r.status_code == 200, r.text[:300]

    with ThreadPoolExecutor(8) as pool:
        jobs = [pool.submit(one, selection, k, policy) for selection in selections
                for k, policy in enumerate(POLICIES)]
        for job in jobs:
            job.result()
    kept = _kept_by_rank(trace)
    pairs: dict[str, list[tuple[list, list]]] = defaultdict(list)
    for (rid, rank), events in kept.items():
        if rank != 0 or not rid.startswith(prefix + "-"):
            continue
        other = kept[(rid, 1)]
        assert len(other) == len(events), rid  # same number of compactions on both ranks
        pairs[rid.removeprefix(prefix + "-").split("-")[0]] += list(zip(events, other))
    return pairs


def test_ranks_keep_the_same_tokens_or_choose_per_head(tp_server, trace: Path) -> None:
    pairs = _run(tp_server, trace, "tp", ("shared", "per-head"))
    shared = pairs["shared"]
    assert len(shared) >= 8 and all(a == b for a, b in shared)
    per_head = pairs["per"]  # rids "tp-per-head-<policy>"
    assert len(per_head) >= 8
    # [layer][the rank's one KV head] lists: same count on both ranks, chosen by each rank
    assert all(a[0] == b[0] and len(a[1][0][0]) == len(b[1][0][0]) for a, b in per_head)
    assert any(a != b for a, b in per_head)
    moments = {a[0] for a, _ in shared + per_head}
    assert {"chunk", "prefill", "decode"} <= moments, moments  # every moment, in step on both ranks


def test_without_the_all_reduce_ranks_diverge(tp_server, trace: Path) -> None:
    shared = _run(tp_server, trace, "failpoint-tp", ("shared",))["shared"]
    assert len(shared) >= 8 and any(a != b for a, b in shared)


def test_a_request_that_fails_on_one_rank_fails_on_both(tp_server) -> None:
    """Planted on rank 1 only: scoring raises (per head; shared, before the scores' all-reduce) or
    the row rewrite does (after the kept entries moved on both ranks). Each planted request fails
    alone; the others, compacted in the same steps, complete; the server keeps serving."""
    before = tp_server.wait_idle()["compression"]["failed_requests"]
    planted = {"failpoint-compress-shared": "shared", "failpoint-compress-per-head": "per-head",
               "failpoint-rewrite-shared": "shared", "failpoint-rewrite-per-head": "per-head"}
    fine = {f"ok-{selection}-{k}": selection for k in range(2) for selection in ("shared", "per-head")}

    def one(rid: str, selection: str, k: int) -> requests.Response:
        return tp_server.post("/generate", json={
            "rid": rid, "input_ids": [(53 * i + k) % 1900 + 10 for i in range(160)],
            "sampling_params": {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True,
                                "custom_params": {"sgl_kvc": {"selection": selection}}},
        })

    every = {**planted, **fine}
    with ThreadPoolExecutor(len(every)) as pool:
        answers = dict(zip(every, pool.map(one, every, every.values(), range(len(every)))))
    for rid in planted:
        r = answers[rid]
        assert r.status_code >= 400 or r.json()["meta_info"]["finish_reason"]["type"] == "abort", rid
        assert "sgl-kvc could not compress" in r.text, (rid, r.text[:300])
    for rid in fine:
        assert answers[rid].status_code == 200, (rid, answers[rid].text[:300])
        assert answers[rid].json()["meta_info"]["completion_tokens"] == 40
    stats = tp_server.wait_idle()
    assert stats["compression"]["failed_requests"] == before + len(planted)
    assert_pool_whole(stats)
    assert one("ok-after", "shared", 99).status_code == 200


def test_kvzip_reconstruction_runs_on_both_ranks_in_step(tp_server, trace: Path) -> None:
    """KVzip's reconstruction forwards run on both ranks in the same steps (the model's forward
    has its own collectives), each rank scoring its own KV head: the shared selection keeps the
    same tokens on both (its scores averaged over the ranks), per head the same counts. A fault
    while rank 1 alone scores one request's reconstruction fails that request on both ranks; the
    others, sharing its forwards, complete."""
    before = tp_server.wait_idle()["compression"]

    def one(rid: str, selection: str, k: int) -> requests.Response:
        return tp_server.post("/generate", json={
            "rid": rid, "input_ids": [(29 * i + k) % 1900 + 10 for i in range(160)],
            "sampling_params": {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True,
                                "custom_params": {"sgl_kvc": {"prompt_policy": "kvzip", "selection": selection}}},
        })

    rids = {"kvzip-shared-0": "shared", "kvzip-shared-1": "shared", "kvzip-per-head-0": "per-head",
            "failpoint-reconstruct-tp": "per-head"}
    with ThreadPoolExecutor(len(rids)) as pool:
        answers = dict(zip(rids, pool.map(one, rids, rids.values(), range(len(rids)))))
    planted = answers.pop("failpoint-reconstruct-tp")
    assert planted.status_code >= 400 or planted.json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert "sgl-kvc could not compress" in planted.text, planted.text[:300]
    for rid, r in answers.items():
        assert r.status_code == 200, (rid, r.text[:300])
    kept = _kept_by_rank(trace)
    for rid in answers:
        a, b = kept[(rid, 0)], kept[(rid, 1)]
        # between chunks and after the last one (how many chunk passes depends on how the prefill
        # rounds split the concurrent prompts)
        assert len(a) == len(b) and {"chunk", "prefill"} <= {m for m, _ in a}, (rid, [m for m, _ in a])
        if rids[rid] == "shared":
            assert a == b, rid
        else:
            assert all(x[0] == y[0] and len(x[1][0][0]) == len(y[1][0][0]) for x, y in zip(a, b)), rid
    stats = tp_server.wait_idle()
    assert stats["compression"]["failed_requests"] == before["failed_requests"] + 1
    assert stats["compression"]["reconstruction"]["passes"] > before["reconstruction"]["passes"]
    assert_pool_whole(stats)


def test_a_reconstruction_planned_on_one_rank_only_runs_on_neither(tp_server) -> None:
    """Planning one request's KVzip reconstruction fails on rank 1 alone: the ranks vote on their
    plans before the first forward, so both leave it out of the forwards they share with the
    others of its moment, and it fails on both. Without the vote rank 0's forwards held one more
    request than rank 1's and the model's collectives waited forever (here: a bounded wait).
    The same moment's other requests complete, and the server keeps serving."""
    before = tp_server.wait_idle()["compression"]

    def one(rid: str, k: int) -> requests.Response:
        return requests.post(tp_server.url + "/generate", timeout=150, json={
            "rid": rid, "input_ids": [(41 * i + k) % 1900 + 10 for i in range(48)],
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True,
                                "custom_params": {"sgl_kvc": {"prompt_policy": "kvzip", "budget": 16}}},
        })

    rids = ["failpoint-kvzip-plan", "kvzip-plan-0", "kvzip-plan-1"]
    with ThreadPoolExecutor(len(rids)) as pool:
        answers = dict(zip(rids, pool.map(one, rids, range(len(rids)))))
    planted = answers.pop("failpoint-kvzip-plan")
    assert planted.status_code >= 400 or planted.json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert "sgl-kvc could not compress" in planted.text, planted.text[:300]
    for rid, r in answers.items():
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 8, (rid, r.text[:300])
    stats = tp_server.wait_idle()
    assert stats["compression"]["failed_requests"] == before["failed_requests"] + 1
    assert stats["compression"]["reconstruction"]["passes"] >= before["reconstruction"]["passes"] + 2
    assert_pool_whole(stats)
    assert one("kvzip-plan-after", 9).status_code == 200


def test_a_document_is_published_on_both_ranks_or_on_neither(tp_server) -> None:
    """A shared document (`kv_compression.document`) whose compression fails on rank 1 alone is
    published on neither rank (the ranks vote before it enters their trees): the next request
    declaring it compresses it on both, and the one after starts from it on both (had the trees
    diverged, the ranks' prefixes and forwards would no longer match)."""
    doc = [(31 * i + 5) % 1900 + 10 for i in range(48)]  # one chunk with its question

    def ask(rid: str, k: int) -> requests.Response:
        return tp_server.post("/generate", json={
            "rid": rid, "input_ids": doc + [(13 * i + k) % 1900 + 10 for i in range(8)],
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True, "custom_params": {
                "sgl_kvc": {"prompt_policy": "kvzip", "document": {"tokens": len(doc)}}}},
        })

    before = tp_server.wait_idle()["documents"]
    for rid, k in (("failpoint-document-tp", 1), ("document-tp-first", 2), ("document-tp-second", 3)):
        r = ask(rid, k)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 8, (rid, r.text[:300])
    after = tp_server.wait_idle()
    docs = after["documents"]
    assert docs["not_published"] == before["not_published"] + 1, docs
    assert docs["compressions"] == before["compressions"] + 1, docs
    assert docs["hits"] == before["hits"] + 1, docs
    assert_pool_whole(after)


def test_a_document_is_extended_on_both_ranks(tp_server) -> None:
    """A conversation's next turn (a document that begins with a resident one): it starts from the
    resident document on both ranks, each rank chooses its own KV heads' entries of the turn, and the
    extension is published on both (the ranks vote); the next request with that document starts
    from it on both, prefilling only its question, and a rank-1 failure while a turn is published
    loses that extension on both, whether in its pass or in its node's metadata after its entries
    were copied (had the trees diverged, the ranks' prefixes would not match)."""
    doc = [(41 * i + 7) % 1900 + 10 for i in range(48)]
    turns = [[(43 * i + t) % 1900 + 10 for i in range(20)] for t in (3, 4)]

    def ask(rid: str, document: list[int], k: int) -> requests.Response:
        return tp_server.post("/generate", json={
            "rid": rid, "input_ids": document + [(13 * i + k) % 1900 + 10 for i in range(8)],
            "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True, "custom_params": {
                "sgl_kvc": {"prompt_policy": "kvzip", "document": {"tokens": len(document)}}}},
        })

    before = tp_server.wait_idle()
    asks = [("extension-tp-doc", doc, 1), ("failpoint-document-tp-turn", doc + turns[0], 2),
            ("failpoint-node-tp-turn", doc + turns[0], 6), ("extension-tp-turn", doc + turns[0], 3),
            ("extension-tp-hit", doc + turns[0], 4),
            ("extension-tp-branch", doc + turns[1], 5)]
    cached = []
    for rid, document, k in asks:
        r = ask(rid, document, k)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 4, (rid, r.text[:300])
        cached.append(r.json()["meta_info"]["cached_tokens"])
    after = tp_server.wait_idle()
    docs, was = after["documents"], before["documents"]
    assert docs["not_published"] == was["not_published"] + 2, docs
    assert docs["extensions"] == was["extensions"] + 2 and docs["compressions"] == was["compressions"] + 3, docs
    assert docs["hits"] == was["hits"] + 5, docs
    # each turn starts from the document, the hit from the turn (the first request may match a
    # token or so of the tree's other prompts)
    assert cached[1:] == [48, 48, 48, 68, 48], cached
    prefilled = after["prefix_cache"]["prefilled_tokens"] - before["prefix_cache"]["prefilled_tokens"]
    assert prefilled == sum(len(d) + 8 - c for (_, d, _), c in zip(asks, cached)), (prefilled, cached)
    assert_pool_whole(after)


def test_a_finished_turn_is_kept_on_both_ranks(tp_server) -> None:
    """A request that declared a document finishes: both ranks keep its question and answer as a
    turn (from SGLang's fields alone, with no vote: the ranks' rows are alike), and the next turn,
    whose document is that conversation so far, starts from the document and the turn on both,
    prefilling only the answer's last token, a template's tail and its question, then extends
    the chain from the turn's slots; its own turn is kept on both too."""
    doc = [(47 * i + 5) % 1900 + 10 for i in range(48)]

    def ask(prompt: list[int], document: int) -> dict:
        r = tp_server.post("/generate", json={"input_ids": prompt, "sampling_params": {
            "max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True,
            "custom_params": {"sgl_kvc": {"prompt_policy": "kvzip", "document": {"tokens": document}}}}})
        assert r.status_code == 200, r.text[:300]
        return r.json()

    before = tp_server.wait_idle()
    prompt = doc + [(19 * i + 1) % 1900 + 10 for i in range(8)]
    out = ask(prompt, len(doc))
    for t in range(2):
        said = prompt + out["output_ids"]
        prompt = said + [11, 12] + [(19 * i + t + 2) % 1900 + 10 for i in range(8)]
        was = tp_server.stats()["prefix_cache"]["prefilled_tokens"]
        out = ask(prompt, len(said) + 2)
        assert out["meta_info"]["cached_tokens"] == len(said) - 1
        assert tp_server.stats()["prefix_cache"]["prefilled_tokens"] - was == 1 + 2 + 8
    after = tp_server.wait_idle()
    docs, was = after["documents"], before["documents"]
    assert docs["turns"] == was["turns"] + 3 and docs["extensions"] == was["extensions"] + 2, docs
    assert_pool_whole(after)

    # A failure on rank 1 alone while a turn is kept loses it on both ranks (they vote before
    # either inserts it): the next turn starts from the document on both and reads the turn itself.
    doc = [(53 * i + 5) % 1900 + 10 for i in range(48)]
    prompt = doc + [(19 * i + 9) % 1900 + 10 for i in range(8)]
    r = tp_server.post("/generate", json={"rid": "failpoint-turn-tp", "input_ids": prompt, "sampling_params": {
        "max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True,
        "custom_params": {"sgl_kvc": {"prompt_policy": "kvzip", "document": {"tokens": len(doc)}}}}})
    assert r.status_code == 200, r.text[:300]
    assert tp_server.wait_idle()["documents"]["turns"] == docs["turns"]
    said = prompt + r.json()["output_ids"]
    was = tp_server.stats()["prefix_cache"]["prefilled_tokens"]
    out = ask(said + [11, 12] + [(19 * i + 7) % 1900 + 10 for i in range(8)], len(said) + 2)
    assert out["meta_info"]["cached_tokens"] == len(doc)
    assert tp_server.stats()["prefix_cache"]["prefilled_tokens"] - was == len(said) - len(doc) + 2 + 8
    assert_pool_whole(tp_server.wait_idle())


def test_a_compacted_reply_is_kept_on_both_ranks(tp_server) -> None:
    """A request that declared a document compacts its row while it decodes (R-KV): both ranks
    keep its kept entries as a reply and what it decoded since as a turn after it (each rank its
    own heads' positions, the same slots), and the next turn starts from them on both, prefilling
    only the answer's last token, a template's tail and its question, and compresses them again."""
    doc = [(43 * i + 7) % 1900 + 10 for i in range(48)]

    def ask(prompt: list[int], document: int, n: int) -> dict:
        r = tp_server.post("/generate", json={"input_ids": prompt, "sampling_params": {
            "max_new_tokens": n, "temperature": 0.0, "ignore_eos": True,
            "custom_params": {"sgl_kvc": {"prompt_policy": "kvzip", "document": {"tokens": document}}}}})
        assert r.status_code == 200, r.text[:300]
        return r.json()

    before = tp_server.wait_idle()["documents"]
    prompt = doc + [(23 * i + 3) % 1900 + 10 for i in range(8)]
    out = ask(prompt, len(doc), 80)  # past the document's entries + 32 + 16: compacted while decoding
    assert tp_server.wait_idle()["documents"]["replies"] == before["replies"] + 1
    said = prompt + out["output_ids"]
    prompt = said + [11, 12] + [(29 * i + 5) % 1900 + 10 for i in range(8)]
    was = tp_server.stats()["prefix_cache"]["prefilled_tokens"]
    out = ask(prompt, len(said) + 2, 4)
    assert out["meta_info"]["cached_tokens"] == len(said) - 1
    assert tp_server.stats()["prefix_cache"]["prefilled_tokens"] - was == 1 + 2 + 8
    after = tp_server.wait_idle()
    assert after["documents"]["rebuilds"] == before["rebuilds"] + 1, after["documents"]
    assert_pool_whole(after)


def test_requests_wait_for_a_document_alike_on_both_ranks(tp_server) -> None:
    """Requests of one document sent at once, its 150 tokens read in three chunks: one compresses
    it, the others wait for it, held back alike on both ranks (whether each waited past
    --kv-document-wait is voted, as each rank's clock says), and start from it. Had the ranks held
    different requests, their batches and collectives would no longer match."""
    from concurrent.futures import ThreadPoolExecutor

    doc = [(37 * i + 11) % 1900 + 10 for i in range(150)]

    def ask(k: int) -> requests.Response:
        return tp_server.post("/generate", json={
            "input_ids": doc + [(17 * i + k) % 1900 + 10 for i in range(8)],
            "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True, "custom_params": {
                "sgl_kvc": {"prompt_policy": "streamingllm", "document": {"tokens": len(doc)}}}},
        })

    before = tp_server.wait_idle()["documents"]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(4)))
    assert all(r.status_code == 200 and len(r.json()["output_ids"]) == 4 for r in answers), answers
    after = tp_server.wait_idle()
    docs = after["documents"]
    assert docs["compressions"] == before["compressions"] + 1 and docs["hits"] == before["hits"] + 3, docs
    assert docs["waited_out"] == before["waited_out"], docs
    assert_pool_whole(after)


def test_request_mix(tp_server, request_mix) -> None:
    """The request-mix fuzz test (tests/request_mix.py) on two ranks, the chunk moment on."""
    request_mix(tp_server, ci_seed=3000)


def test_hostile_clients(tp_server: ServerProcess, hostile_documents) -> None:
    """The hostile-client suite for shared documents and KVzip (`tests/hostile_documents.py`) with
    two tensor-parallel ranks: every rank serves, refuses and hangs up the same requests, the pool
    is whole on each, another tenant's answers are unchanged."""
    counts = hostile_documents(tp_server, ci_seed=6300, flags=CMD, long=300)
    assert counts["refused"] and counts["served"], counts
