"""One figure from several `benchmarks.eviction` runs that differ in output length: each policy's
output tokens/s against plain SGLang's (median and range over its interleaved rounds), by
output length.

    python -m research.plot_by_output_length benchmarks/results/eviction-long-output-{1024,4096,8192}.json \\
        --out benchmarks/results/eviction-long-output.png
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from benchmarks.eviction import load, ratios


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="eviction result JSON files")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted((load(f) for f in args.runs), key=lambda run: run[1]["output_len"])
    lengths = [setup["output_len"] for _, setup in runs]
    per = [ratios(results) for results, _ in runs]  # each against its run's `none`, round by round
    names = list(dict.fromkeys(n for r in per for n in r if n != "none"))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in names:
        ys = [statistics.median(r[name]) if name in r else float("nan") for r in per]
        lo = [y - min(r.get(name, [y])) for y, r in zip(ys, per)]
        hi = [max(r.get(name, [y])) - y for y, r in zip(ys, per)]
        ax.errorbar(lengths, ys, yerr=[lo, hi], marker="o", capsize=3, label=name)
    ax.axhline(1.0, color="#888", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [f"{n // 1024}K" if n >= 1024 else str(n) for n in lengths])
    ax.set_xlabel("output tokens per request (budget ~10% of it)")
    ax.set_ylabel("output tokens/s vs plain SGLang (same KV pool)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    s = runs[0][1]
    ax.set_title(f"{s['requests']} requests of {s['input_len']} prompt tokens, {s['model']}; {s['machine']}",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
