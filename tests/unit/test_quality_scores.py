"""The quality benchmark's samples and scores (benchmarks/quality.py), without a server."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from benchmarks.long_generation import common_prefix, is_looping, rouge_l
from benchmarks.quality import markdown, parse_lengths, score_retrieval
from benchmarks.quality_fillers import STYLES
from benchmarks.quality_samples import Sample, document_samples, multikey_samples, passkey_samples, sentence


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


class WordTokenizer:
    """One token per whitespace-separated word; the chat template is the user text itself."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]

    def apply_chat_template(self, conversation: list[dict[str, str]], **kw: object) -> list[int]:
        return self.encode(conversation[-1]["content"])

    def decode(self, ids: list[int]) -> str:
        words = {i: w for w, i in self.vocab.items()}
        return " ".join(words[i] for i in ids)


@pytest.mark.parametrize("style", STYLES)
def test_every_style_fills_to_the_length_with_the_key_at_its_depth(style: str) -> None:
    tok = WordTokenizer()
    for depth in (0.1, 0.9):
        (s,) = passkey_samples(tok, {1024: 1}, [depth], 0, style)
        assert 1024 * 0.9 <= s.prompt_len <= 1024 * 1.1
        text = tok.decode(s.prompt_ids)
        at = text.index(f"pass key is {s.answer}.") / len(text)
        assert abs(at - depth) < 0.1, (style, depth, at)
        assert s.meta["style"] == style and (style == "templated") == s.id.startswith("passkey-1024")
        assert passkey_samples(tok, {1024: 1}, [depth], 0, style)[0].prompt_ids == s.prompt_ids
    (m,) = multikey_samples(tok, 1, 1536, 5, 0, style)
    assert tok.decode(m.prompt_ids).count("code of the ") == 5 + 1  # five facts and the question


def test_styles_are_scored_apart_and_reported_side_by_side() -> None:
    samples = [Sample(f"{st}{i}", "passkey", [0], answer=str(10000 + i), meta={"length": 1024, "style": st})
               for st in ("templated", "code") for i in range(2)]  # fmt: skip
    full = {s.id: s.answer for s in samples}
    mine = {"templated0": "10000", "templated1": "10001", "code0": "10000", "code1": "x"}
    r = score_retrieval("passkey", "snapkv@256", samples, mine, full)
    assert r.by_style == {"templated": [2, 2], "code": [1, 2]}
    ref = score_retrieval("passkey", "full", samples, full, full)
    data = {
        "setup": {"budgets": [256], "policies": ["snapkv"], "styles": ["templated", "code"],
                  "samples": [{"id": s.id, "task": s.task, **s.meta} for s in samples]},
        "retrieval": [asdict(r), asdict(ref)], "timing": [],
    }  # fmt: skip
    table = markdown(data)
    assert "| policy | templated @256 | code @256 |" in table
    assert "| snapkv | 2/2 | 1/2 |" in table and "full cache correct: templated 2/2, code 2/2" in table


def test_long_generation_settings_and_scores() -> None:
    """A configuration name becomes the request's `kv_compression`; outputs are scored against
    the full cache's, and a configuration whose requests were never compacted says so."""
    from collections import Counter

    from benchmarks.long_generation import FULL, config_budget, score, settings
    from benchmarks.quality import UNCOMPRESSED, Outcome
    from benchmarks.quality_samples import long_output_samples

    assert settings("rkv@256") == {"policy": "rkv", "budget": 256}
    assert settings("rkv>rkv@128") == {"policy": "rkv", "budget": 128, "prompt_policy": "rkv"}
    assert settings(FULL) == {"budget": UNCOMPRESSED}
    tok = WordTokenizer()
    samples = long_output_samples(tok, 1, 64, 0)
    assert [s.meta["kind"] for s in samples] == ["retell", "list", "steps"]
    assert all(s.ignore_eos and s.max_tokens == 64 for s in samples)
    ref_text = " ".join(f"w{i}" for i in range(40))
    reference = {s.id: Outcome(s.id, FULL, ref_text, rid=f"f{s.id}") for s in samples}
    half = " ".join(f"w{i}" for i in range(20)) + " x" * 20
    outs = {s.id: Outcome(s.id, "rkv@8", half if i else ref_text, rid=s.id) for i, s in enumerate(samples)}
    r = score("rkv@8", samples, outs, reference, Counter({samples[0].id: 2, samples[1].id: 1}), tok)
    assert (r.samples, r.failures, r.compacted) == (3, 0, 2) and r.compactions == 1.0
    assert abs(r.identical_share - (1 + 0.5 + 0.5) / 3) < 1e-9 and r.by_kind["retell"][0] == 1.0
    assert r.loop_rate == 2 / 3  # " x" repeated: the second half is one n-gram
    # the identical share over the prompts that fit the budget (only the output compressed)
    assert config_budget("kvpress:snapkv@256") == 256 and config_budget(FULL) == UNCOMPRESSED
    short = max(s.prompt_len for s in samples[1:])
    assert samples[0].prompt_len > short  # the retelling's passage makes the longest prompt
    r = score(f"rkv@{short}", samples, outs, reference, Counter(), tok)
    assert (r.within_budget, r.identical_share_within_budget) == (2, 0.5)
    assert score(FULL, samples, reference, reference, Counter(), tok).within_budget == 3
    # new loops: only where the reference's output on the same prompt does not loop
    assert r.new_loop_rate == 2 / 3
    loopy = {s.id: Outcome(s.id, FULL, half, rid=s.id) for s in samples}
    r = score("rkv@8", samples, loopy, loopy, Counter(), tok)
    assert (r.loop_rate, r.new_loop_rate) == (1.0, 0.0)


def test_long_generation_rescore_keeps_outputs_and_compactions(tmp_path) -> None:
    """`--rescore` scores a result file's stored outputs again; the compaction counts (from a
    trace that is not kept) stay the stored ones."""
    from collections import Counter

    from benchmarks.long_generation import FULL, rescore, score_all
    from benchmarks.quality import Outcome
    from benchmarks.quality_samples import long_output_samples

    tok = WordTokenizer()
    samples = long_output_samples(tok, 1, 64, 0)
    ref_text = " ".join(f"w{i}" for i in range(40))
    loop = " ".join(f"w{i}" for i in range(20)) + " x" * 20
    outcomes = {FULL: [Outcome(s.id, FULL, ref_text, rid=f"f{s.id}") for s in samples],
                "rkv@8": [Outcome(s.id, "rkv@8", loop, rid=s.id) for s in samples]}  # fmt: skip
    scores = [asdict(r) for r in score_all(outcomes, samples, Counter({samples[0].id: 2}), tok)]
    for r in scores:
        del r["new_loop_rate"]  # a file written before the score existed
    data = {"setup": {"per_kind": 1, "tokens": 64, "seed": 0, "samples": [{"id": s.id} for s in samples]},
            "scores": scores, "outcomes": [asdict(o) for outs in outcomes.values() for o in outs]}  # fmt: skip
    path = tmp_path / "long-generation.json"
    path.write_text(json.dumps(data))
    got = {r["config"]: r for r in rescore(path, tok)["scores"]}
    assert got["rkv@8"]["new_loop_rate"] == 1.0 and got[FULL]["new_loop_rate"] == 0.0
    assert (got["rkv@8"]["compacted"], got["rkv@8"]["compactions"]) == (1, 2 / 3)
    assert got["rkv@8"]["identical_share"] == 0.5


def test_long_generation_reference_and_per_prompt_table(tmp_path) -> None:
    """`--reference` takes `full` from a result file of the same prompts, tokens and dtype and
    refuses any other; the report lists every prompt's identical tokens and loops."""
    from collections import Counter

    from benchmarks.long_generation import FULL, markdown, score_all, stored_reference
    from benchmarks.quality import Outcome
    from benchmarks.quality_samples import long_output_samples

    tok = WordTokenizer()
    samples = long_output_samples(tok, 1, 64, 0)
    ref_text = " ".join(f"w{i}" for i in range(40))
    loop = " ".join(f"w{i}" for i in range(20)) + " x" * 20
    outcomes = {FULL: [Outcome(s.id, FULL, ref_text, rid=f"f{s.id}") for s in samples]}
    setup = {"tokens": 64, "per_kind": 1, "seed": 0, "server": ["--policy", "rkv", "--dtype", "float32"],
             "samples": [{"id": s.id, "prompt_tokens": s.prompt_len, **s.meta} for s in samples]}  # fmt: skip
    path = tmp_path / "long-generation.json"
    path.write_text(json.dumps({"meta": {"commit": "abc1234"}, "setup": setup,
                                "outcomes": [asdict(o) for o in outcomes[FULL]]}))  # fmt: skip
    full, name = stored_reference(path, samples, 64, "float32")
    assert [o.text for o in full] == [ref_text] * 3 and name == "`long-generation.json` (commit abc1234)"
    for bad in [(samples, 128, "float32"), (samples, 64, "bfloat16"), (samples[:2], 64, "float32")]:
        with pytest.raises(SystemExit):
            stored_reference(path, *bad)
    outcomes["rkv@8"] = [Outcome(s.id, "rkv@8", loop if i else ref_text, rid=s.id) for i, s in enumerate(samples)]
    scores = score_all(outcomes, samples, Counter(), tok)
    assert scores[1].per_prompt == {samples[0].id: [40, False], samples[1].id: [20, True], samples[2].id: [20, True]}
    table = markdown({"setup": {**setup, "reference": name}, "scores": [asdict(r) for r in scores],
                      "failures": 0})  # fmt: skip
    assert f"| {samples[1].id} | {samples[1].prompt_len} | 40 | 20 loop |" in table
    assert "`full`: the stored outputs of `long-generation.json` (commit abc1234)" in table


def test_kept_evidence_reads_the_first_prompt_compaction(tmp_path) -> None:
    """The trace's kept positions say whether a request was compacted before it answered and
    how much of its answer an average (layer, KV head) kept."""
    import json

    from benchmarks.quality_trace import answer_positions, evidence, prompt_compactions

    prompt = [7, 1, 2, 9, 9, 1, 2, 5, 6, 8, 3, 4]
    at = answer_positions(prompt, [1, 2])
    assert at == [1, 2, 5, 6]
    trace = tmp_path / "trace.jsonl"
    per_head = [[[0, 1, 2, 10, 11], [0, 5, 6, 10, 11]], [[0, 1, 5, 10, 11], [0, 3, 4, 10, 11]]]
    events = [
        {"rid": "a", "tp_rank": 0, "moment": "prefill", "logical_len": 12, "kept_positions": per_head},
        {"rid": "a", "tp_rank": 0, "moment": "decode", "logical_len": 20, "kept_positions": [[[0] * 5] * 2] * 2},
        {"rid": "b", "tp_rank": 0, "moment": "prefill", "logical_len": 14, "kept_positions": [0, 1, 2, 5]},
        {"rid": "c", "tp_rank": 0, "moment": "chunk", "logical_len": 6, "kept_positions": [0, 1, 2, 5]},
        {"rid": "c", "tp_rank": 1, "moment": "prefill", "logical_len": 12, "kept_positions": [0]},
        {"rid": "c", "tp_rank": 0, "moment": "prefill", "logical_len": 12, "kept_positions": [0, 8, 10, 11]},
    ]
    trace.write_text("".join(json.dumps(e) + "\n" for e in events))
    last = prompt_compactions(trace)
    assert last["a"]["moment"] == "prefill"  # the prompt's compaction, not a later decode one
    a = evidence(last["a"], len(prompt), at)
    assert a.landed and a.answer_kept == (2 + 2 + 2 + 0) / 16
    assert a.early_share == 7 / 20  # positions < 3 (a quarter of 12)
    b = evidence(last["b"], len(prompt), at)  # shared selection: one list for every head
    assert b.answer_kept == 3 / 4
    assert not b.landed  # a staged pass that landed after two tokens were decoded from the full cache
    c = evidence(last["c"], len(prompt), at)  # chunk moment: the pass after the last chunk, rank 0's
    assert c.landed and c.answer_kept == 0
    missing = evidence(None, len(prompt), at)
    assert not missing.landed and missing.answer_kept is None


def test_policy_rows_name_selection_and_prompt_policy() -> None:
    from benchmarks.quality import policy_settings

    assert policy_settings("snapkv") == {"policy": "snapkv"}
    assert policy_settings("snapkv/shared") == {"policy": "snapkv", "selection": "shared"}
    assert policy_settings("rkv/variable") == {"policy": "rkv"}  # the server's head-budget mode
    assert policy_settings("rkv>rkv") == {"policy": "rkv", "prompt_policy": "rkv"}
    assert policy_settings("snapkv>h2o/shared") == {"policy": "h2o", "prompt_policy": "snapkv", "selection": "shared"}


def test_long_output_prompts_are_distinct_up_to_the_limit() -> None:
    """Every prompt of `--per-kind` at its limit is different; above it, the benchmark refuses
    (lists and tasks would repeat and count twice)."""
    from benchmarks.long_generation import build_parser
    from benchmarks.quality_samples import MAX_LONG_OUTPUT_PER_KIND, long_output_samples

    samples = long_output_samples(WordTokenizer(), MAX_LONG_OUTPUT_PER_KIND, 64, 0)
    assert len({tuple(s.prompt_ids) for s in samples}) == len(samples) == 3 * MAX_LONG_OUTPUT_PER_KIND
    with pytest.raises(ValueError, match="distinct prompts"):
        long_output_samples(WordTokenizer(), MAX_LONG_OUTPUT_PER_KIND + 1, 64, 0)
    parser = build_parser()
    assert parser.parse_args(["--per-kind", str(MAX_LONG_OUTPUT_PER_KIND)]).per_kind == MAX_LONG_OUTPUT_PER_KIND
    for bad in ("0", str(MAX_LONG_OUTPUT_PER_KIND + 1)):
        with pytest.raises(SystemExit):
            parser.parse_args(["--per-kind", bad])


def test_plot_skips_empty_panels_and_tells_coinciding_lines_apart(tmp_path) -> None:
    """A policy with nothing measured draws no line, a run without retrieval no figure; a line
    equal to an earlier one at every budget is named as such (it is drawn beside it)."""
    from benchmarks.quality import coinciding, plot, retrieval_series

    def row(config: str, kept: int) -> dict:
        return {"task": "passkey", "config": config, "kept": kept, "reference_correct": 4}

    data = {
        "setup": {"budgets": [128, 256], "policies": ["snapkv", "streamingllm", "h2o"], "model": "m", "machine": "x"},
        "retrieval": [row("snapkv@128", 3), row("snapkv@256", 4), row("streamingllm@128", 1),
                      row("streamingllm@256", 2), row("kvpress:streamingllm@128", 1),
                      row("kvpress:streamingllm@256", 2), row("kvpress:snapkv@128", 1)],
        "kvpress": {"presses": ["snapkv", "streamingllm"]},
    }  # fmt: skip
    series = retrieval_series(data)
    assert list(series) == ["snapkv", "streamingllm", "kvpress:snapkv", "kvpress:streamingllm"]  # no h2o
    assert series["snapkv"] == [0.75, 1.0] and series["kvpress:snapkv"][0] == 0.25
    assert coinciding(series) == {"kvpress:streamingllm": ("streamingllm", 1)}
    png = tmp_path / "quality.png"
    png.write_text("an older figure")
    assert not plot({**data, "retrieval": []}, png) and not png.exists()


def test_a_documents_facts_are_asked_one_at_a_time_over_the_same_context() -> None:
    tokenizer = WordTokenizer()
    samples = document_samples(tokenizer, 2, 1024, 4, seed=0)
    assert [s.task for s in samples] == ["multidoc"] * 8
    for doc in (samples[:4], samples[4:]):
        contexts = {tuple(s.prompt_ids[: s.meta["question_at"]]) for s in doc}
        assert len(contexts) == 1  # only the question differs
        assert len({s.answer for s in doc}) == 4
        depths = [s.meta["asked_depth"] for s in doc]
        assert all(j / 4 < d < (j + 1) / 4 for j, d in enumerate(depths))  # one fact per slice
        for s in doc:
            assert tokenizer.decode(s.prompt_ids).count(f" is {s.answer}.") == 1
    assert samples[0].prompt_ids != samples[4].prompt_ids
