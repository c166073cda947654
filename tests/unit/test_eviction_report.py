"""The eviction benchmark's table: with interleaved rounds, every ratio compares runs of the
same round (this machine drifts by ~20% between rounds, not within one)."""

from __future__ import annotations

from benchmarks.eviction import ConfigResult, markdown, ratios, representative


def _result(name: str, tok_s: float, round_: int) -> ConfigResult:
    return ConfigResult(
        name=name, flags=[], requests=1, failures=0, wall_s=1.0, output_tokens=int(tok_s),
        output_tokens_per_s=tok_s, max_running=1, round=round_,
    )


def test_ratios_are_taken_within_each_round() -> None:
    results = [
        _result("none", 1000, 0), _result("rkv", 2500, 0),
        _result("none", 1500, 1), _result("rkv", 3000, 1),  # the machine got faster
    ]
    assert ratios(results) == {"none": [1.0, 1.0], "rkv": [2.5, 2.0]}
    table = markdown(results)
    assert "2.25x (2.00-2.50)" in table  # the median and the range over rounds
    assert "of 2 rounds" in table
    # the row shown is the median round's (the lower middle one of two)
    assert representative([r for r in results if r.name == "rkv"]).output_tokens_per_s == 2500


def test_one_round_keeps_the_plain_table() -> None:
    table = markdown([_result("none", 1000, 0), _result("h2o", 2100, 0)])
    assert "| vs none |" in table and "| 2.10x |" in table


def test_ratios_by_output_length_are_taken_within_each_round(tmp_path) -> None:
    """The plot by output length reads each run's file and takes its ratios round by round."""
    import json

    from benchmarks.eviction import load

    rows = [("none", 1, 100.0), ("rkv", 1, 400.0), ("none", 2, 50.0), ("rkv", 2, 250.0), ("h2o", 2, 100.0)]
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"setup": {"output_len": 1024},
                                "results": [vars(_result(n, t, r)) for n, r, t in rows]}))
    results, setup = load(path)
    assert ratios(results) == {"none": [1.0, 1.0], "rkv": [4.0, 5.0], "h2o": [2.0]}
