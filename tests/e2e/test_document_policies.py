"""Conversations whose documents each question-free prompt policy compresses (KVzip, KeyDiff,
StreamingLLM), on the server a user starts and on the two other head-budget layouts.

Three servers (demo model, `--policy rkv --kv-budget 64`, invariants checked after every
compaction and publication): the defaults otherwise, which on one CPU rank are `--kv-head-budget
policy` (`auto`: the unit pool, where only KVzip's one sort over every head packs a row); uniform
head budgets (SGLang's own pool); layer ones (every pass packs). On each, a conversation of
`/generate` turns over a document of 1,500 tokens, each turn declaring every token before its
question as its document: each later turn starts from the last turn's extension and its finished
question and answer, prefills only what is new (the answer's last token, never read, and its
question) and publishes its own extension; a reply compacted while it decodes is compressed
again by the next turn (a rebuild). Nothing is left unpublished and the pool adds up.
"""

from __future__ import annotations

import random
import sys
from typing import Callable

import pytest

from hostile_documents import DOCUMENT_POLICIES
from kvc_reference import assert_pool_whole, generate
from loadtest.server import ServerProcess

pytestmark = pytest.mark.e2e

CMD = [sys.executable, "-m", "sgl_kvc.launch", "--model-path", "demo", "--policy", "rkv", "--kv-budget", "64"]
SERVERS = {"default": CMD, "uniform": [*CMD, "--kv-head-budget", "uniform"],
           "layer": [*CMD, "--kv-head-budget", "layer"],
           # the default head budgets where prompts are read whole (documents published from copies)
           "whole": [*CMD, "--compress-on", "prefill,decode,preempt"]}
DOC, QUESTION, ANSWER = 1500, 12, 4
# a reply compacted while it decodes: its own budget of 16 and --kv-buffer's 128 beyond its document,
# past which R-KV compacts it, are less than its question and these tokens
REPLY, REPLY_BUDGET = 150, 16


@pytest.fixture(scope="module")
def servers():
    with ServerProcess.launch_all(list(SERVERS.values()), env={"SGLKVC_CHECK": "1"}) as started:
        yield dict(zip(SERVERS, started))


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n)]


def test_the_default_server_is_on_the_unit_pool(servers) -> None:
    """What `auto` chose where the other servers name their head budgets."""
    assert [servers[name].stats()["head_budget"] for name in SERVERS] == ["policy", "uniform", "layer", "policy"]


def _turns(server: ServerProcess, policy: str) -> Callable[..., tuple[list[int], int, dict]]:
    """`turn(document, question_seed, answer, **own)`: a greedy turn whose document (`policy`,
    kept at 0.3) is `document` and whose question is 12 tokens; returns what it said (its prompt
    and answer), the tokens it prefilled and the documents' stats after it."""

    def turn(document: list[int], question_seed: int, answer: int, **own) -> tuple[list[int], int, dict]:
        was = server.stats()["prefix_cache"]["prefilled_tokens"]
        prompt = document + _tokens(question_seed, QUESTION)
        kv = {"prompt_policy": policy, **own, "document": {"tokens": len(document), "ratio": 0.3}}
        out = generate(server, prompt, answer, sampling={"custom_params": {"sgl_kvc": kv}})
        assert len(out["output_ids"]) == answer
        stats = server.stats()
        return prompt + out["output_ids"], stats["prefix_cache"]["prefilled_tokens"] - was, stats["documents"]

    return turn


@pytest.mark.parametrize("policy", DOCUMENT_POLICIES)
@pytest.mark.parametrize("name", list(SERVERS))
def test_every_document_policy_extends_a_conversation(servers, name: str, policy: str) -> None:
    """Turn by turn, each turn after the first prefills only its new tokens (where prompts are
    read whole, the last question and answer too) and publishes an extension (turns 2 and 3); a long answer compacted while it decodes is kept as a reply (turn
    4), which the next turn with the same settings starts from and compresses again with its own
    tokens (turn 5, a rebuild). No document goes unpublished, no request fails, and the pool adds
    up once idle."""
    server = servers[name]
    seed = 7000 + 100 * list(SERVERS).index(name) + 10 * DOCUMENT_POLICIES.index(policy)
    before = server.stats()
    turn = _turns(server, policy)
    said, _, first = turn(_tokens(seed, DOC), seed + 1, ANSWER)
    assert first["compressions"] == before["documents"]["compressions"] + 1, first
    # turns 2 and 3: the answer's last token (never read by its own turn) and the question are new;
    # where prompts are read whole, the last question and answer too: a request that read its
    # document whole, or extended one beside its extension exact, keeps no turn (its question's KV
    # is not what a turn's key names, `turns.turn_candidate`)
    new = 2 * QUESTION + ANSWER if name == "whole" else 1 + QUESTION
    for t in (2, 3):
        said, prefilled, docs = turn(said, seed + t, ANSWER)
        assert prefilled == new, (t, prefilled, docs)
        assert docs["extensions"] == first["extensions"] + t - 1, (t, docs)
    # turn 4 answers at length: its row is compacted while it decodes, and kept as a reply
    reply = {"budget": REPLY_BUDGET}
    said, _, docs = turn(said, seed + 4, REPLY, **reply)
    assert docs["replies"] == first["replies"] + 1, docs
    # turn 5, with turn 4's settings: starts from the reply and its turn, compresses them again
    said, prefilled, docs = turn(said, seed + 5, ANSWER, **reply)
    assert prefilled == 1 + QUESTION and docs["rebuilds"] == first["rebuilds"] + 1, (prefilled, docs)
    after = server.wait_idle()
    assert after["documents"]["not_published"] == before["documents"]["not_published"], after["documents"]
    assert after["compression"]["failed_requests"] == before["compression"]["failed_requests"]
    assert_pool_whole(after)


@pytest.mark.parametrize("policy", DOCUMENT_POLICIES)
@pytest.mark.parametrize("name", list(SERVERS))
def test_a_first_answer_kept_as_a_reply_is_compressed_again(servers, name: str, policy: str) -> None:
    """A conversation's first turn answers at length: its row, which holds the document it read
    (whole, where prompts are read whole: never packed under `policy` then), is compacted while it
    decodes and kept as a reply; the next turn with the same settings starts from it, prefills
    only its new tokens and compresses the reply and its own tokens again (a rebuild), however
    the reply's heads were laid out. Nothing goes unpublished; the pool adds up."""
    server = servers[name]
    seed = 7500 + 100 * list(SERVERS).index(name) + 10 * DOCUMENT_POLICIES.index(policy)
    before = server.stats()
    turn = _turns(server, policy)
    reply = {"budget": REPLY_BUDGET}
    said, _, first = turn(_tokens(seed, DOC), seed + 1, REPLY, **reply)
    assert first["replies"] == before["documents"]["replies"] + 1, first
    said, prefilled, docs = turn(said, seed + 2, ANSWER, **reply)
    assert prefilled == 1 + QUESTION and docs["rebuilds"] == first["rebuilds"] + 1, (prefilled, docs)
    after = server.wait_idle()
    assert after["documents"]["not_published"] == before["documents"]["not_published"], after["documents"]
    assert after["compression"]["failed_requests"] == before["compression"]["failed_requests"]
    assert_pool_whole(after)


def test_hostile_clients(servers, hostile_documents) -> None:
    """The hostile-client suite for shared documents and KVzip (`tests/hostile_documents.py`, whose
    conversations draw their documents' prompt policy) on the server a user starts: after a burst
    it serves, its pool is whole and no request failed."""
    counts = hostile_documents(servers["default"], ci_seed=6500, flags=SERVERS["default"], long=1000)
    assert counts["refused"] and counts["served"], counts
