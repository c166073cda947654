"""What a decode step's tables cost on the host: the unit pool's per-head tables against a uniform
server's slot rows, for the same requests.

    python -m benchmarks.unit_tables          # benchmarks/results/unit-tables.{json,md}

A decode step on a CPU plans its blocks once for every layer (`core/decode.DecodeStep.build`). On a
uniform server a block is its requests' rows of SGLang's `req_to_token` ([b, N] slots, the same for
every layer and KV head) and a padding mask. On the unit pool (`--kv-head-budget layer` or
`variable`) it is a per-head table of units for every layer (`core/request_state.block_tables`:
[L, b, H_kv, N]), each request's packed entries (a compaction's, `unit_lens[l, h]` per head) then
every slot appended since, after each head's own. Both are timed here alone (median of `--reps`
calls each, interleaved, one thread), with B requests that each keep between `budget / 2` and `budget` entries per head
and hold up to `--buffer` more since their last compaction, for three model shapes: the demo model
of the throughput benchmark, SmolLM2-135M and Llama-3.1-8B. `--baseline COMMIT` times that
commit's `block_tables` too, in the same run, on the same requests (`per_head_ms@COMMIT`).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch

from benchmarks.common import median_ms, module_at, run_metadata, write_table
from sgl_kvc.core.request_state import PackedEntries, block_tables

SHAPES = {"demo (2 layers, 2 KV heads)": (2, 2), "SmolLM2-135M (30, 3)": (30, 3), "Llama-3.1-8B (32, 8)": (32, 8)}


def baseline_block_tables(commit: str) -> Callable:
    """`block_tables` as `core/request_state.py` was at `commit`."""
    return module_at(commit, "sgl_kvc/core/request_state.py").block_tables


def case(layers: int, heads: int, batch: int, budget: int, buffer: int, reps: int, seed: int = 0,
         baselines: dict[str, Callable] | None = None) -> dict:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    states, row_lens = [], []
    for _ in range(batch):
        lens = torch.randint(budget // 2, budget + 1, (layers, heads), generator=gen)
        packed = -(-int(lens.sum()) // (layers * heads))  # slots its packed units fill
        units = torch.randint(0, 1 << 20, (layers, heads, int(lens.max())), generator=gen)
        units *= torch.arange(units.shape[-1]) < lens[..., None]
        # the packed entries (`PackedEntries`), and the tables a commit before them held
        states.append(SimpleNamespace(units=units, unit_lens=lens, packed=packed,
                                      packed_entries=PackedEntries.of(units, lens, torch.zeros_like(units))))
        row_lens.append(packed + rng.randrange(0, buffer + 1))
    req_to_token = torch.randint(0, 1 << 16, (batch, max(row_lens)), dtype=torch.int32, generator=gen)
    width = max(int(s.units.shape[-1]) + n - s.packed for s, n in zip(states, row_lens))
    rows = torch.arange(batch)

    widths = [max(s.packed_entries.widths[layer] + n - s.packed for s, n in zip(states, row_lens))
              for layer in range(layers)]

    def per_head(build: Callable = block_tables) -> object:  # each layer as wide as its widest head
        return build(states, req_to_token[rows, : max(row_lens)], row_lens, layers, heads, widths)

    def per_head_before(build: Callable) -> object:  # a commit's, every layer as wide as the widest
        return build(states, req_to_token[rows, : max(row_lens)], row_lens, layers, heads, width)

    # a uniform row of as many entries per head (budget, then its tail): what `DecodeStep.build` makes
    uniform_lens = [budget + n - s.packed for s, n in zip(states, row_lens)]
    slots_of = torch.randint(0, 1 << 16, (batch, max(uniform_lens)), dtype=torch.int32, generator=gen)

    def uniform() -> object:
        n_max = max(uniform_lens)
        lens = torch.tensor(uniform_lens, dtype=torch.int64)
        slots = slots_of[rows, :n_max].long()
        pad = torch.arange(n_max)[None, :] >= lens[:, None]
        return torch.where(pad, slots[:, :1], slots), pad

    names = ["per_head_ms", *(f"per_head_ms@{name}" for name in baselines or {}), "uniform_ms"]
    fns = [per_head, *(lambda build=build: per_head_before(build) for build in (baselines or {}).values()), uniform]
    out = {"batch": batch, **{n: round(ms, 3) for n, ms in zip(names, median_ms(fns, reps))}}
    return {**out, "table_mib": round(batch * heads * sum(widths) * 8 / 2**20, 2)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--buffer", type=int, default=128)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--baseline", default=None, metavar="COMMIT", help="also time block_tables as it was at COMMIT")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    baselines = {args.baseline: baseline_block_tables(args.baseline)} if args.baseline else {}
    meta = run_metadata("benchmarks.unit_tables", argv)
    rows = [{"shape": name, **case(layers, heads, b, args.budget, args.buffer, args.reps, baselines=baselines)}
            for name, (layers, heads) in SHAPES.items() for b in args.batches]
    setup = {"budget": args.budget, "buffer": args.buffer, "reps": args.reps, "threads": 1, "baseline": args.baseline}
    print(write_table(args.out, "unit-tables", meta, setup, rows,
                      "A decode step's tables, per-head (unit pool) against uniform rows",
                      "milliseconds per step (median), and the per-head tables' size."))


if __name__ == "__main__":
    main()
