"""A run's summary from locust's stats CSV, the per-request CSV and two `/v1/kvc/stats` samples.

Latency percentiles (TTFT, TPOT, ITL) and failure counts come from locust's `*_stats.csv`
(rows Type=E2E/TTFT/TPOT/ITL, written by `loadtest/locustfile.py`; locust rounds its
histogram to 2 significant digits above 100 ms). Throughput and goodput come from the
per-request CSV, over the load window (first request start to last request end): goodput is
the rate of successful requests with TTFT <= the TTFT limit and TPOT <= the TPOT limit.
This module imports no locust (locust monkey-patches the interpreter on import).
"""

from __future__ import annotations

import csv
import statistics
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


@dataclass
class RequestRecord:
    """One request's outcome: a row of the per-request CSV the locustfile writes."""

    scenario: str
    t_start: float  # unix seconds
    t_end: float
    ok: int
    status: int
    ttft_ms: float
    tpot_ms: float  # 0 when the request produced fewer than two tokens
    e2e_ms: float
    prompt_tokens: int
    output_tokens: int
    error: str = ""
    turn: int = 0  # the conversations scenario's turn number, from 1; 0 in the others


REQUEST_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(RequestRecord))


@dataclass(frozen=True)
class Limits:
    """Service-level limits for goodput, in milliseconds."""

    ttft_ms: float = 2000.0
    tpot_ms: float = 100.0

    def met_by(self, r: RequestRecord) -> bool:
        return bool(r.ok) and r.ttft_ms <= self.ttft_ms and r.tpot_ms <= self.tpot_ms


@dataclass
class Summary:
    """One configuration's result (the summary JSON); None where the number is unavailable."""

    config: str
    scenario: str
    users: int
    duration_s: float  # load window: first request start to last request end
    requests: int  # successful requests
    failures: int
    requests_per_s: float
    output_tokens_per_s: float
    mean_output_tokens: float
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    itl_p99_ms: float | None
    ttft_limit_ms: float
    tpot_limit_ms: float
    goodput_rps: float
    goodput_fraction: float  # of all requests, failed ones included
    max_running: int | None  # peak requests in flight since server start (/v1/kvc/stats)
    peak_running_sampled: int | None  # peak of `running` polled during the run
    prefix_hit_rate: float | None  # hit_tokens / prompt_tokens over the run
    flags: str = ""
    # the conversations scenario, per turn number (from the per-request CSV, exact, not locust's
    # histogram): its successful requests, their TTFT p50 and mean prompt tokens
    by_turn: dict[str, TurnSummary] = field(default_factory=dict)


@dataclass
class TurnSummary:
    requests: int
    ttft_p50_ms: float
    prompt_tokens: float


def turn_summaries(records: list[RequestRecord]) -> dict[str, TurnSummary]:
    """The successful requests of each conversation turn (`RequestRecord.turn` > 0)."""
    out = {}
    for turn in sorted({r.turn for r in records if r.ok and r.turn > 0}):
        rows = [r for r in records if r.ok and r.turn == turn]
        out[str(turn)] = TurnSummary(len(rows), statistics.median(r.ttft_ms for r in rows),
                                     statistics.fmean(r.prompt_tokens for r in rows))
    return out


def read_locust_stats(path: str | Path) -> dict[str, dict[str, str]]:
    """Rows of a locust `*_stats.csv`, keyed by Type (the metric); the Aggregated row dropped."""
    out: dict[str, dict[str, str]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row["Name"] == "Aggregated" or not row["Type"]:
                continue
            if row["Type"] in out:
                raise ValueError(f"{path}: more than one row of type {row['Type']!r}")
            out[row["Type"]] = row
    return out


def read_requests(path: str | Path) -> list[RequestRecord]:
    with open(path, newline="") as f:
        return [
            RequestRecord(
                scenario=r["scenario"], t_start=float(r["t_start"]), t_end=float(r["t_end"]),
                ok=int(r["ok"]), status=int(r["status"]), ttft_ms=float(r["ttft_ms"]),
                tpot_ms=float(r["tpot_ms"]), e2e_ms=float(r["e2e_ms"]),
                prompt_tokens=int(r["prompt_tokens"]), output_tokens=int(r["output_tokens"]),
                error=r.get("error", ""), turn=int(r.get("turn") or 0),
            )
            for r in csv.DictReader(f)
        ]


def _pct(rows: dict[str, dict[str, str]], metric: str, pct: str) -> float | None:
    """A percentile column of one metric's row; None where locust has no value ("N/A")."""
    value = rows.get(metric, {}).get(pct)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:  # "N/A"
        return None


def prefix_hit_rate(before: dict[str, Any] | None, after: dict[str, Any] | None) -> float | None:
    """hit_tokens / prompt_tokens between two `/v1/kvc/stats` samples."""
    if not before or not after:
        return None
    b, a = before["prefix_cache"], after["prefix_cache"]
    prompt = a["prompt_tokens"] - b["prompt_tokens"]
    return (a["hit_tokens"] - b["hit_tokens"]) / prompt if prompt > 0 else None


def summarize(
    stats_csv: str | Path,
    requests_csv: str | Path,
    limits: Limits,
    *,
    config: str,
    scenario: str,
    users: int,
    stats_before: dict[str, Any] | None = None,
    stats_after: dict[str, Any] | None = None,
    peak_running_sampled: int | None = None,
    flags: str = "",
) -> Summary:
    rows = read_locust_stats(stats_csv)
    records = read_requests(requests_csv) if Path(requests_csv).exists() else []
    ok = [r for r in records if r.ok]
    start = min((r.t_start for r in records), default=0.0)
    window = max((r.t_end for r in records), default=0.0) - start
    per_s = (lambda n: n / window) if window > 0 else (lambda n: 0.0)
    tokens = sum(r.output_tokens for r in ok)
    good = sum(1 for r in records if limits.met_by(r))
    e2e = rows.get("E2E", {})
    return Summary(
        config=config,
        scenario=scenario,
        users=users,
        duration_s=round(window, 3),
        requests=len(ok),
        failures=int(e2e.get("Failure Count") or len(records) - len(ok)),
        requests_per_s=per_s(len(ok)),
        output_tokens_per_s=per_s(tokens),
        mean_output_tokens=tokens / len(ok) if ok else 0.0,
        ttft_p50_ms=_pct(rows, "TTFT", "50%"),
        ttft_p90_ms=_pct(rows, "TTFT", "90%"),
        ttft_p99_ms=_pct(rows, "TTFT", "99%"),
        tpot_p50_ms=_pct(rows, "TPOT", "50%"),
        tpot_p99_ms=_pct(rows, "TPOT", "99%"),
        itl_p99_ms=_pct(rows, "ITL", "99%"),
        ttft_limit_ms=limits.ttft_ms,
        tpot_limit_ms=limits.tpot_ms,
        goodput_rps=per_s(good),
        goodput_fraction=good / len(records) if records else 0.0,
        max_running=stats_after["requests"]["max_running"] if stats_after else None,
        peak_running_sampled=peak_running_sampled,
        prefix_hit_rate=prefix_hit_rate(stats_before, stats_after),
        flags=flags,
        by_turn=turn_summaries(records),
    )
