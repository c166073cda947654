"""kvpress's query-agnostic setting in the quality benchmark: each sample knows where its question
starts (`question_at`), and the kvpress runner compresses the context before it, then reads the
question (research/kvpress_runner.py; kvpress itself is not needed here)."""

from __future__ import annotations

import pytest

from benchmarks.quality import build_parser
from benchmarks.quality_samples import multikey_samples, passkey_samples
from research.kvpress_runner import split
from test_quality_scores import WordTokenizer


def test_samples_know_where_their_question_starts() -> None:
    tok = WordTokenizer()
    for s in [*passkey_samples(tok, {512: 1}, [0.1, 0.9], 0), *multikey_samples(tok, 1, 512, 3, 0)]:
        at = s.meta["question_at"]
        question = tok.decode(s.prompt_ids[at:])
        assert question.startswith("What is the") and question.endswith("Answer with the number only.")
        assert s.answer in tok.decode(s.prompt_ids[:at])  # the fact is in the compressed context


def test_the_runner_splits_context_question_and_last_token() -> None:
    s = {"id": "x", "prompt_ids": list(range(10)), "meta": {"question_at": 7}}
    assert split(s, False) == (list(range(9)), [], 9)  # the default: all but the last token compressed
    assert split(s, True) == (list(range(7)), [7, 8], 9)
    with pytest.raises(ValueError, match="question boundary"):
        split({**s, "meta": {}}, True)


def test_the_benchmark_flag() -> None:
    assert build_parser().parse_args(["--kvpress-query-agnostic"]).kvpress_query_agnostic
    assert not build_parser().parse_args([]).kvpress_query_agnostic
