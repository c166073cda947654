"""What a packed request's extend attention costs on a CPU: `per_head_extend` against a commit's.

    python -m benchmarks.extend_attention --baseline 0cd1736   # benchmarks/results/extend-attention.{json,md}

On the unit pool (the default server's `--kv-head-budget policy`) a request whose row a pass has
packed reads every later chunk of its prompt, and every repeat of a KVzip reconstruction forward,
through `kernels/per_head_attention.per_head_extend`: one layer's queries of the chunk over each KV
head's kept entries, causal by logical position. Timed here alone, one layer, one request, the
chunk's `--extend` queries over `--contexts` entries per head (each head a little shorter than the
last, their units scattered over the pool as a pass leaves them), for two model shapes, both ways
it runs: without probabilities (what every extend but a prefill statistic's reads) and with them
(`on_probs`: H2O's and Batch-Max's prefill statistic). Median of `--reps` calls each, the commit's
and this checkout's interleaved, one thread; `max_abs_diff` is the largest difference between the
two outputs. `--baseline COMMIT` runs `kernels/per_head_attention.py` as it was at COMMIT.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

import torch

from benchmarks.common import median_ms, module_at, run_metadata, write_table
from sgl_kvc.kernels import per_head_attention
from sgl_kvc.kernels.per_head_tables import HeadTables

# (KV heads, query heads per KV head, head dim)
SHAPES = {"SmolLM2-135M (3 x 3, 64)": (3, 3, 64), "Llama-3.1-8B (8 x 4, 128)": (8, 4, 128)}


def baseline_extend(commit: str) -> Callable:
    """`per_head_extend` as `kernels/per_head_attention.py` was at `commit`."""
    return module_at(commit, "kernels/per_head_attention.py").per_head_extend


def case(shape: tuple[int, int, int], context: int, extend: int, reps: int, baseline: Callable | None,
         probs: bool, seed: int = 0) -> dict:
    h_kv, group, d = shape
    gen = torch.Generator().manual_seed(seed)
    total = context + extend
    pool = h_kv * total * 2
    k_pool, v_pool = torch.randn(pool, d, generator=gen), torch.randn(pool, d, generator=gen)
    lens = torch.tensor([[total - 17 * h for h in range(h_kv)]])
    width = int(lens.max())
    units = torch.stack([torch.randperm(pool, generator=gen)[:width] for _ in range(h_kv)])[None]
    # each head's kept positions, in order, ending with the chunk's (every head holds them)
    kept = [torch.sort(torch.randperm(context, generator=gen)[: width - extend]).values for _ in range(h_kv)]
    positions = torch.stack([torch.cat([p, torch.arange(context, total)]) for p in kept])[None]
    tables = HeadTables(units=units, lengths=lens, positions=positions)
    q = torch.randn(extend, h_kv * group, d, generator=gen)
    q_pos, indptr = torch.arange(context, total), torch.tensor([0, extend])
    on_probs = (lambda start, stop, p: None) if probs else None

    def run(fn: Callable) -> torch.Tensor:
        return fn(q, indptr, q_pos, k_pool, v_pool, tables, on_probs=on_probs, q_max=extend)

    fns = [lambda: run(per_head_attention.per_head_extend), *([lambda: run(baseline)] if baseline else [])]
    ms = median_ms(fns, reps)
    row = {"context": context, "extend": extend, "probabilities": probs, "ms": round(ms[0], 2)}
    if baseline is not None:
        diff = (run(per_head_attention.per_head_extend) - run(baseline)).abs().max().item()
        row.update({"ms@baseline": round(ms[1], 2), "speedup": round(ms[1] / ms[0], 2), "max_abs_diff": f"{diff:.1e}"})
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--extend", type=int, default=512)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--baseline", default=None, metavar="COMMIT", help="also time per_head_extend as it was at COMMIT")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    baseline = baseline_extend(args.baseline) if args.baseline else None
    meta = run_metadata("benchmarks.extend_attention", argv)
    rows = [{"shape": name, **case(shape, n, args.extend, args.reps, baseline, probs)}
            for name, shape in SHAPES.items() for n in args.contexts for probs in (False, True)]
    setup = {"extend": args.extend, "reps": args.reps, "threads": 1, "baseline": args.baseline}
    print(write_table(args.out, "extend-attention", meta, setup, rows, "A packed request's extend attention, one layer",
                      "milliseconds per call (median)."))


if __name__ == "__main__":
    main()
