"""The quality benchmark's samples and scores (benchmarks/quality.py), without a server."""

from __future__ import annotations

from benchmarks.quality import (
    common_prefix,
    is_looping,
    parse_lengths,
    rouge_l,
    score_retrieval,
)
from benchmarks.quality_samples import Sample, sentence


def test_rouge_l_prefix_and_loops() -> None:
    assert rouge_l("a b c d", "a b c d") == 1.0
    assert rouge_l("a x c", "a b c") == 2 / 3
    assert rouge_l("", "a") == 0.0
    assert common_prefix([1, 2, 3, 4], [1, 2, 5]) == 2
    assert is_looping([1, 2, 3, 4] * 50) and not is_looping(list(range(200)))


def test_filler_is_varied_and_seeded() -> None:
    import random

    rng = random.Random(0)
    many = [sentence(rng) for _ in range(200)]
    assert len(set(many)) > 190  # not one repeated sentence
    assert sentence(random.Random(1)) == sentence(random.Random(1))


def test_retrieval_is_scored_against_what_the_full_cache_answers() -> None:
    samples = [Sample(f"s{i}", "passkey", [0], answer=str(10000 + i), meta={"length": 1024}) for i in range(4)]
    full = {"s0": "10000", "s1": "10001", "s2": "wrong", "s3": None}
    mine = {"s0": "10000", "s1": "no", "s2": "10002", "s3": "10003"}
    r = score_retrieval("passkey", "x@128", samples, mine, full)
    assert (r.reference_correct, r.kept, r.relative, r.failures) == (2, 1, 0.5, 0)
    assert r.by_length == {"1024": 0.5}
    assert parse_lengths("1024:3,4096") == {1024: 3, 4096: 1}
