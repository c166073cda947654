"""The multi-turn workload's conversations and report (`benchmarks/conversations.py`), without a server."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from benchmarks.conversations import TurnResult, earlier_plain, make_conversations, pool_tokens, row


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from sgl_kvc.model import ensure_smollm2

    return AutoTokenizer.from_pretrained(str(ensure_smollm2()))


def test_each_turn_asks_a_fact_of_its_own_document(tok) -> None:
    conversations, lengths = make_conversations(tok, 3, 512, 4, seed=0)
    assert [len(c.questions) for c in conversations] == [4, 4, 4]
    for c in conversations:
        assert len(set(c.answers)) == 4  # four different facts, each asked once
        assert all(f"is {code}." in c.document for code in c.answers)
    assert all(400 <= n <= 1.5 * 512 for n in lengths), lengths  # a filler piece may overshoot
    again, _ = make_conversations(tok, 3, 512, 4, seed=0)
    assert again == conversations  # the same conversations on every machine
    assert make_conversations(tok, 3, 512, 4, seed=1)[0] != conversations


def test_the_pool_holds_about_a_third_of_the_conversations_whole() -> None:
    lengths = [2000] * 9
    pool = pool_tokens(lengths, turns=8, ratio=0.3, chunk=512)
    whole = sum(n + 8 * 40 for n in lengths)
    assert whole / 3 < pool < whole / 2


def test_a_turns_row_counts_answers_kept_against_plain_sglangs() -> None:
    plain = TurnResult(2, right=[True, True, False], ttfts=[1.0, 2.0, 3.0], prefilled_tokens=90, prompt_tokens=3000)
    mine = TurnResult(2, right=[True, False, True], ttfts=[0.5, 0.7], errors=1, prefilled_tokens=40,
                      prompt_tokens=2000, tree_tokens=600, documents={"compressions": 3})
    r = row("documents", mine, 3, plain)
    assert r["kept"] == "1/2" and r["right"] == 2 and r["errors"] == 1
    assert r["prefilled_per_request"] == 20 and r["ttft_p50"] == 0.6  # per served request
    assert r["tree_tokens_per_conversation"] == 200 and r["documents_compressions"] == 3


def test_long_answers_ask_for_an_explanation_and_get_their_room(tok) -> None:
    conversations, _ = make_conversations(tok, 2, 512, 3, seed=0, explain=True)
    short, _ = make_conversations(tok, 2, 512, 3, seed=0)
    assert all("explain" in q for c in conversations for q in c.questions)
    assert [c.answers for c in conversations] == [c.answers for c in short]  # the same facts asked
    lengths = [1000] * 4
    assert pool_tokens(lengths, 4, 0.3, 512, per_turn=220) - pool_tokens(lengths, 4, 0.3, 512) > 4 * 4 * 180 / 3


def test_plain_sglangs_turns_are_reused_only_from_a_run_of_the_same_conversations(tmp_path) -> None:
    turns = [TurnResult(t, right=[True, False], answers=[f"a{t}", f"b{t}"], ttfts=[1.0, 2.0]) for t in (1, 2)]
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps({"setup": {"document_tokens": [1000, 1100], "turns": 2},
                                "turns": {"plain": [asdict(r) for r in turns]},
                                "answers": {"plain": [["a1", "a2"], ["b1", "b2"]]}}))
    results, answers = earlier_plain(path, [1000, 1100], 2)
    assert results == turns and answers == [["a1", "a2"], ["b1", "b2"]]
    for lengths, count in (([1000, 1101], 2), ([1000, 1100], 3)):  # other documents, other turns
        with pytest.raises(SystemExit, match="not a run of plain SGLang"):
            earlier_plain(path, lengths, count)
