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
    # a file from before the turns recorded their answers: each turn's come from the answers
    older = [{k: v for k, v in asdict(r).items() if k != "answers"} for r in turns]
    path.write_text(json.dumps({"setup": {"document_tokens": [1000, 1100], "turns": 2}, "turns": {"plain": older},
                                "answers": {"plain": [["a1", "a2"], ["b1", "b2"]]}}))
    results, _ = earlier_plain(path, [1000, 1100], 2)
    assert [r.answers for r in results] == [["a1", "b1"], ["a2", "b2"]]
    assert row("documents", results[1], 2, results[1])["agreed"] == 2


def test_a_conversations_segments_are_its_messages_in_the_rendered_prompt(tok) -> None:
    from benchmarks import conversation_segments as segs

    messages = [{"role": "user", "content": "a document " * 30}, {"role": "user", "content": "q one?"},
                {"role": "assistant", "content": "4821."}, {"role": "user", "content": "q two?"}]
    parts = segs.segments(tok, messages)
    assert [s.name for s in parts] == ["document", "q1", "a1", "q2"]
    whole = tok.apply_chat_template(messages, tokenize=True)
    whole = whole["input_ids"] if hasattr(whole, "keys") else whole
    assert parts[0].start == 0 and parts[-1].end == len(whole)
    assert all(a.end == b.start for a, b in zip(parts, parts[1:]))  # contiguous, nothing left out
    # each segment's tokens render its message
    assert "4821" in tok.decode(whole[parts[2].start:parts[2].end])
    assert "q two" in tok.decode(whole[parts[3].start:parts[3].end])


def test_what_a_document_kept_of_each_segment_and_how_alike_two_are() -> None:
    from benchmarks import conversation_segments as segs

    parts = [segs.Segment("document", 0, 10), segs.Segment("q1", 10, 12), segs.Segment("a1", 12, 16)]
    # two layers x one KV head, packed lists of different lengths
    a = {"selection": "per-head", "kept_positions": [[[0, 1, 10, 12, 13]], [[2, 3, 11, 14, 15]]]}
    b = {"selection": "per-head", "kept_positions": [[[0, 1, 10, 12]], [[4, 5, 10, 11]]]}
    shares = segs.kept_shares(a, parts)
    assert shares == {"document": 4 / 20, "q1": 2 / 4, "a1": 4 / 8}
    assert segs.grouped(shares, parts) == {"document": 0.2, "questions": 0.5, "answers": 0.5,
                                           "last_turn": round((0.5 * 2 + 0.5 * 4) / 6, 4)}
    same = segs.overlaps(a, b, parts)
    assert same["document"] == round((2 / 2 + 0 / 4) / 2, 4)  # layer 0 the same two, layer 1 none alike
    assert same["q1"] == round((1 / 1 + 1 / 2) / 2, 4) and same["a1"] == round((1 / 2 + 0 / 2) / 2, 4)
    shared = {"selection": "shared", "kept_positions": [0, 10, 11]}
    assert segs.kept_shares(shared, parts) == {"document": 0.1, "q1": 1.0, "a1": 0.0}


def test_each_requests_last_document_event_of_rank_zero_is_read(tmp_path) -> None:
    from benchmarks import conversation_segments as segs

    trace = tmp_path / "t.jsonl"
    lines = [{"rid": "r", "tp_rank": 0, "moment": "document", "n": 1}, {"rid": "r", "tp_rank": 1, "moment": "document"},
             {"rid": "r", "tp_rank": 0, "moment": "decode"}, {"rid": "r", "tp_rank": 0, "moment": "document", "n": 2}]
    trace.write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert segs.document_events(trace)["r"]["n"] == 2
    assert segs.document_events(tmp_path / "absent.jsonl") == {}
    assert segs.rid("conversations@727fb68", 3, 2) == "conv3-turn2-conversations-at-727fb68"
