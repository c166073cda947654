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


def test_budgets_as_fractions_of_the_context() -> None:
    """`--budgets 0.3` keeps 30% of each prompt's context (the prompt up to its question), as
    kvpress's compression ratio 0.7 keeps; a whole number stays a number of entries."""
    import argparse

    from benchmarks.quality import parse_budget, request_budget
    from benchmarks.quality_samples import Sample

    assert [parse_budget(t) for t in ("256", "0.3")] == [256, 0.3]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_budget("2.5")
    s = Sample("x", "passkey", list(range(1000)), "1", meta={"question_at": 900})
    assert request_budget(0.3, s) == 270 and request_budget(256, s) == 256


def test_a_prompt_policy_row_keeps_the_servers_decode_policy() -> None:
    from benchmarks.quality import policy_settings

    assert policy_settings("kvzip") == {"prompt_policy": "kvzip"}
    assert policy_settings("kvzip/variable") == {"prompt_policy": "kvzip"}
    assert policy_settings("snapkv/shared") == {"policy": "snapkv", "selection": "shared"}


def test_sgl_kvc_query_agnostic_runs_compress_the_context_alone() -> None:
    """Per sample and configuration: the radix cache emptied, the context but its last C tokens
    cached by a first request, then the request, whose first chunk is exactly the rest of the
    context (compressed before its question is read)."""
    from benchmarks.quality import Outcome, run_query_agnostic
    from benchmarks.quality_samples import Sample

    calls: list[tuple] = []

    class Server:
        def flush(self) -> bool:
            calls.append(("flush",))
            return True

        def complete(self, sample, config, kvc, timeout):
            calls.append((config, len(sample.prompt_ids), kvc))
            return Outcome(sample.id, config, "ok")

    args = build_parser().parse_args(["--policies", "kvzip", "--budgets", "0.5", "--query-agnostic", "512"])
    s = Sample("x", "passkey", list(range(2100)), "1", meta={"question_at": 2060})
    out = run_query_agnostic(Server(), [s], args)
    assert [o.config for o in out] == ["kvzip@0.5"]
    assert calls == [("flush",), ("warm", 2060 - 512, {"budget": 1 << 20}),
                     ("kvzip@0.5", 2100, {"prompt_policy": "kvzip", "budget": 1030})]


def test_retry_failed_runs_only_what_failed_before(tmp_path) -> None:
    """`--retry-failed` with `--merge`: the pairs that failed in the merged run, and nothing else."""
    import json

    from benchmarks.quality import Outcome, run_query_agnostic
    from benchmarks.quality_samples import Sample

    prev = tmp_path / "prev.json"
    prev.write_text(json.dumps({"outcomes": [
        {"sample": "x", "config": "kvzip@0.5", "text": None}, {"sample": "x", "config": "kvzip@0.3", "text": "ok"},
    ]}))
    ran: list[str] = []

    class Server:
        def flush(self) -> bool:
            return True

        def complete(self, sample, config, kvc, timeout):
            ran.append(config)
            return Outcome(sample.id, config, "ok")

    args = build_parser().parse_args(["--policies", "kvzip", "--budgets", "0.3", "0.5", "--query-agnostic", "512",
                                      "--merge", str(prev), "--retry-failed"])
    s = Sample("x", "passkey", list(range(2100)), "1", meta={"question_at": 2060})
    assert [o.config for o in run_query_agnostic(Server(), [s], args)] == ["kvzip@0.5"]
    assert ran == ["warm", "kvzip@0.5"]
