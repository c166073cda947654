"""Side-by-side markdown table and one PNG plot of several configurations' summaries."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from loadtest.metrics import Summary

Row = tuple[str, Callable[[Summary], object]]


def _num(value: object, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


ROWS: list[Row] = [
    ("server flags or URL", lambda s: f"`{s.flags}`" if s.flags else "(defaults)"),
    ("successful requests", lambda s: s.requests),
    ("failures", lambda s: s.failures),
    ("requests/s", lambda s: _num(s.requests_per_s, 2)),
    ("output tokens/s", lambda s: _num(s.output_tokens_per_s)),
    ("mean output tokens", lambda s: _num(s.mean_output_tokens)),
    ("TTFT p50 (ms)", lambda s: _num(s.ttft_p50_ms, 0)),
    ("TTFT p90 (ms)", lambda s: _num(s.ttft_p90_ms, 0)),
    ("TTFT p99 (ms)", lambda s: _num(s.ttft_p99_ms, 0)),
    ("TPOT p50 (ms)", lambda s: _num(s.tpot_p50_ms, 0)),
    ("TPOT p99 (ms)", lambda s: _num(s.tpot_p99_ms, 0)),
    ("ITL p99 (ms)", lambda s: _num(s.itl_p99_ms, 0)),
    ("goodput (req/s)", lambda s: _num(s.goodput_rps, 2)),
    ("goodput (% of requests)", lambda s: _pct(s.goodput_fraction)),
    ("max running requests", lambda s: _num(s.max_running)),
    ("peak running (sampled)", lambda s: _num(s.peak_running_sampled)),
    ("prefix hit rate", lambda s: _pct(s.prefix_hit_rate)),
    ("load window (s)", lambda s: _num(s.duration_s)),
]


def markdown_table(summaries: list[Summary]) -> str:
    head = "| metric | " + " | ".join(s.config for s in summaries) + " |"
    rule = "|---|" + "---:|" * len(summaries)
    body = [f"| {label} | " + " | ".join(str(get(s)) for s in summaries) + " |"
            for label, get in ROWS]  # fmt: skip
    return "\n".join([head, rule, *body])


def turn_table(summaries: list[Summary]) -> str:
    """Per conversation turn (the conversations scenario): TTFT p50 and mean prompt tokens of each
    configuration's successful requests; empty for the other scenarios."""
    turns = sorted({int(t) for s in summaries for t in s.by_turn})
    if not turns:
        return ""
    head = "| turn | " + " | ".join(f"{s.config} TTFT p50 (ms) | {s.config} prompt tokens" for s in summaries) + " |"
    rule = "|---|" + "---:|---:|" * len(summaries)
    body = []
    for t in turns:
        cells = []
        for s in summaries:
            row = s.by_turn.get(str(t))
            cells += [_num(row.ttft_p50_ms), _num(row.prompt_tokens, 0)] if row else ["–", "–"]
        body.append(f"| {t} | " + " | ".join(cells) + " |")
    return "\n".join(["Per turn (successful requests):", "", head, rule, *body])


def write_markdown(summaries: list[Summary], path: Path, preamble: str = "") -> None:
    first = summaries[0]
    notes = (
        f"Scenario `{first.scenario}`, {first.users} users. Goodput: requests with "
        f"TTFT <= {first.ttft_limit_ms:g} ms and TPOT <= {first.tpot_limit_ms:g} ms. "
        "Percentiles from locust's histogram (2 significant digits above 100 ms); "
        "max running requests from `/v1/kvc/stats` (peak since server start); "
        "prefix hit rate = hit_tokens / prompt_tokens over the run."
    )
    tables = (markdown_table(summaries), turn_table(summaries))
    parts = [p for p in ("# Load test results", preamble, notes, *tables) if p]
    path.write_text("\n\n".join(parts) + "\n")


PLOTS: list[tuple[str, list[tuple[str, Callable[[Summary], float | None]]]]] = [
    ("output tokens/s", [("tokens/s", lambda s: s.output_tokens_per_s)]),
    ("requests/s", [("all", lambda s: s.requests_per_s), ("goodput", lambda s: s.goodput_rps)]),
    ("TTFT (ms)", [("p50", lambda s: s.ttft_p50_ms), ("p90", lambda s: s.ttft_p90_ms),
                   ("p99", lambda s: s.ttft_p99_ms)]),
    ("TPOT / ITL (ms)", [("TPOT p50", lambda s: s.tpot_p50_ms),
                         ("TPOT p99", lambda s: s.tpot_p99_ms),
                         ("ITL p99", lambda s: s.itl_p99_ms)]),
    ("max running requests", [("max", lambda s: s.max_running)]),
]


def write_plot(summaries: list[Summary], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s.config for s in summaries]
    fig, axes = plt.subplots(1, len(PLOTS), figsize=(4 * len(PLOTS), 3.6))
    for ax, (title, series) in zip(axes, PLOTS):
        width = 0.8 / len(series)
        for i, (label, get) in enumerate(series):
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(names))]
            ax.bar(xs, [get(s) or 0 for s in summaries], width, label=label)
        ax.set_xticks(range(len(names)), names, rotation=20)
        ax.set_title(title)
        if len(series) > 1:
            ax.legend(fontsize=8)
    first = summaries[0]
    fig.suptitle(f"scenario {first.scenario}, {first.users} users")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
