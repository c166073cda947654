"""The GPU serving table: plain SGLang and sgl-kvc's compressing policies side by side, on one GPU,
with the same KV memory, in one run.

    python -m benchmarks.gpu_serving --write-model DIR      # the model folder (on a machine with the default model)
    python -m benchmarks.gpu_serving --model DIR --tag h100 # on the GPU: benchmarks/results/gpu-serving-h100.*

The model is shaped like Llama-3.1-8B (32 layers, 32 query / 8 KV heads of 128, hidden 4096,
MLP 14336: 128 KiB of bf16 KV per token) with random weights (`--load-format dummy`: only its
`config.json` exists) and the default model's tokenizer; its vocabulary is the tokenizer's
(49152 where Llama-3.1 has 128256), which changes the embedding and LM head, not the KV cache.
Every server gets the same KV bytes (`--kv-cache-memory-gb`: an FP8 pool holds about twice the
tokens), the same seeded token-id prompts, all requests at once, streamed, `ignore_eos`.

Rows (`ROWS`): plain SGLang with and without decode CUDA graphs; R-KV with decode graphs
(`--kv-decode-graphs on`) on the default head budget (the unit pool) and on SGLang's own pool
(uniform), and without them; R-KV over the FP8 pool; SnapKV with variable per-head budgets; H2O
with the flag (its statistics keep graphs off); plain SGLang with graphs and its overlap scheduler
off. Columns: the
peak of requests running, output tok/s, TPOT, the decode step time (from SGLang's decode log
lines: running requests / generation throughput) and the KV pool's bytes per running request at
that peak. Writes `<out>/gpu-serving-<tag>.{json,md,png}`.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.common import gpu_name, machine, metadata_markdown, run_metadata
from benchmarks.eviction import ConfigResult, plot, run_config

# Llama-3.1-8B's shape (its config.json), the context cut to what the workload needs (SGLang sizes
# each request slot's row of `req_to_token` by the context length).
LLAMA_8B_SHAPE: dict = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "attention_bias": False, "mlp_bias": False,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")

# name -> launcher flags; {budget} is --kv-budget; {graphs}: decode graphs captured for every batch
# the workload can run, no more (capturing costs start-up time). In this order by default: the rows
# with decode graphs first (what a user of plain SGLang runs), then without. Plain SGLang runs with
# its overlap scheduler on, as it does by default (`-no-overlap`: off); a compressing server runs
# without it (docs/architecture.md, "Decode CUDA graphs").
GRAPHS = "--cuda-graph-max-bs-decode {requests}"
ROWS: dict[str, str] = {
    "sglang-graphs": f"--policy none {GRAPHS}",
    "rkv-graphs": f"--policy rkv --kv-budget {{budget}} --kv-decode-graphs on {GRAPHS}",
    "rkv-uniform-graphs": f"--policy rkv --kv-budget {{budget}} --kv-head-budget uniform --kv-decode-graphs on {GRAPHS}",
    "sglang": "--policy none --disable-cuda-graph",
    "rkv": "--policy rkv --kv-budget {budget}",
    "rkv-fp8": "--policy rkv --kv-budget {budget} --kv-cache-dtype fp8_e4m3",
    "snapkv-variable": "--policy snapkv --kv-budget {budget} --kv-head-budget variable",
    # H2O keeps attention statistics: with --kv-decode-graphs on the launcher keeps its graphs off
    "h2o-graphs": f"--policy h2o --kv-budget {{budget}} --kv-decode-graphs on {GRAPHS}",
    "sglang-graphs-no-overlap": f"--policy none --disable-overlap-schedule {GRAPHS}",
}
# Run unless --rows names others: the first seven (the last two answer narrower questions).
DEFAULT_ROWS: list[str] = list(ROWS)[:7]
_DECODE_LINE = re.compile(r"Decode batch.*?#running-req: (\d+).*?gen throughput \(token/s\): ([\d.]+)")


def write_model(out: Path, tokenizer_dir: Path | None = None) -> Path:
    """The benchmark's model folder: LLAMA_8B_SHAPE's config.json and the default model's tokenizer."""
    if tokenizer_dir is None:
        from sgl_kvc.model import ensure_smollm2

        tokenizer_dir = ensure_smollm2()
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    source = json.loads((tokenizer_dir / "config.json").read_text())
    config = {**LLAMA_8B_SHAPE, "vocab_size": source["vocab_size"],
              "bos_token_id": source.get("bos_token_id"), "eos_token_id": source.get("eos_token_id")}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def step_ms(log: Path) -> float:
    """Median decode step time over SGLang's decode log lines (running requests / tok/s)."""
    steps = [1000 * int(n) / float(t) for n, t in _DECODE_LINE.findall(log.read_text(errors="replace"))
             if float(t) > 0]
    return statistics.median(steps) if steps else 0.0


@dataclass
class GpuRow:
    result: ConfigResult
    step_ms_p50: float
    pool_tokens: int
    pool_bytes: int
    kv_bytes_per_request: float  # the pool's bytes over the peak of running requests


def markdown(rows: list[GpuRow]) -> str:
    """The table: each row against plain SGLang without decode graphs and with them (where those
    rows ran)."""
    def base(name: str) -> ConfigResult | None:
        return next((r.result for r in rows if r.result.name == name), None)

    eager, graphs = base("sglang"), base("sglang-graphs")

    def ratio(r: ConfigResult, to: ConfigResult | None) -> str:
        return "–" if to is None else f"{r.output_tokens_per_s / max(to.output_tokens_per_s, 1e-9):.2f}x"

    lines = [
        "| config | max running | output tok/s | vs sglang | vs sglang-graphs | TPOT p50 / p99 (ms) | step (ms) "
        "| pool tokens | KV MiB per running request | failures |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        r = row.result
        lines.append(
            f"| {r.name} | {r.max_running} | {r.output_tokens_per_s:.0f} | {ratio(r, eager)} | {ratio(r, graphs)} "
            f"| {r.tpot_ms.get('p50', 0):.1f} / {r.tpot_ms.get('p99', 0):.1f} | {row.step_ms_p50:.1f} "
            f"| {row.pool_tokens} | {row.kv_bytes_per_request / 2**20:.0f} | {r.failures} |"
        )
    errors = [f"- {row.result.name}: {e}" for row in rows for e in row.result.errors]
    return "\n".join(lines + (["", "Why requests failed:", "", *errors] if errors else [])) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write-model", type=Path, help="write the model folder here and exit")
    p.add_argument("--model", type=Path, help="the model folder (--write-model)")
    p.add_argument("--rows", nargs="+", default=DEFAULT_ROWS, choices=list(ROWS))
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=4096)
    p.add_argument("--kv-budget", type=int, default=1024)
    p.add_argument("--fit", type=int, default=16, help="whole requests (prompt + output) the bf16 pool holds")
    p.add_argument("--server-args", default="", help="extra flags for every server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--tag", default=None, help="result files are gpu-serving-<tag>.* (default: the GPU's name)")
    args = p.parse_args(argv)
    if args.write_model:
        print(write_model(args.write_model))
        return 0
    if args.model is None:
        p.error("--model DIR (see --write-model)")
    meta = run_metadata("benchmarks.gpu_serving", argv)
    print(metadata_markdown(meta), flush=True)
    config = json.loads((args.model / "config.json").read_text())
    kv_bytes_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 2
    gb = args.fit * (args.input_len + args.output_len) * kv_bytes_per_token / 2**30
    every = ["--model-path", str(args.model.resolve()), "--load-format", "dummy", "--kv-cache-memory-gb",
             f"{gb:.4f}", "--dtype", "bfloat16", *args.server_args.split()]
    run = argparse.Namespace(seed=args.seed, input_len=args.input_len, requests=args.requests,
                             output_len=args.output_len, server_args=every, max_total_tokens=0, api="completions")
    logs = Path(tempfile.mkdtemp(prefix="gpu-serving-logs-"))
    tag = args.tag or next((w for w in gpu_name().split() if any(c.isdigit() for c in w)), "gpu").lower()
    setup = {"gpu": gpu_name(), "machine": machine(), "requests": args.requests, "input_len": args.input_len,
             "output_len": args.output_len, "kv_budget": args.kv_budget, "kv_cache_memory_gb": round(gb, 4),
             "fit": args.fit, "model": "Llama-3.1-8B shape, random weights (--load-format dummy)",
             "server_args": every[2:], "date": time.strftime("%Y-%m-%d")}
    rows: list[GpuRow] = []
    failed: dict[str, str] = {}  # a row whose server did not start or serve: why (the next rows still run)
    for name in args.rows:
        flags = ROWS[name].format(budget=args.kv_budget, requests=args.requests).split()
        print(f"== {name}: {' '.join(flags)}", flush=True)
        log = logs / f"{name}.log"
        try:
            result = run_config(name, flags, run, log)
        except Exception as e:  # noqa: BLE001 - reported in the result files
            failed[name] = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
            print(f"{name}: failed: {e}", flush=True)
        else:
            rows.append(GpuRow(result, step_ms(log), result.total_tokens, result.pool_bytes,
                               result.pool_bytes / max(result.max_running, 1)))
            print(markdown(rows[-1:]), flush=True)
        write(args.out / f"gpu-serving-{tag}", meta, setup, rows, failed)
    print(markdown(rows))
    return 1 if failed else 0


def write(stem: Path, meta: dict, setup: dict, rows: list[GpuRow], failed: dict[str, str]) -> None:
    """`<stem>.{json,md,png}`: the rows so far, and those that failed."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(
        {"meta": meta, "setup": setup, "failed": failed,
         "rows": [{**asdict(r.result), **{k: v for k, v in asdict(r).items() if k != "result"}} for r in rows]},
        indent=2))
    title = (f"{setup['gpu']}: {setup['requests']} requests of {setup['input_len']} prompt + {setup['output_len']} "
             f"output tokens (ignore_eos), all at once; {setup['model']}; KV pool {setup['kv_cache_memory_gb']:.2f} "
             f"GiB (bf16: {setup['fit']} whole requests); budgets {setup['kv_budget']}")
    why = "".join(f"\n- {name}: did not run: {reason}" for name, reason in failed.items())
    stem.with_suffix(".md").write_text(f"{metadata_markdown(meta)}\n{title}\n\n{markdown(rows)}{why}\n")
    if rows:
        plot([r.result for r in rows], stem.with_suffix(".png"), title)


if __name__ == "__main__":
    sys.exit(main())
