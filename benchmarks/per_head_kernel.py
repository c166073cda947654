"""Decode attention over per-head tables on a GPU: the Triton kernel against the torch version,
side by side in one run, plus the uniform-budget torch kernel (`decode_attention`, every head the
same slots) at the same number of kept entries, and the Triton kernel over an FP8 pool.

    python -m benchmarks.per_head_kernel --tag h100

Shapes are a Llama-3-8B layer (32 query heads, 8 KV heads, head dim 128, bf16): B requests,
each (request, KV head) keeping a ragged number of units around N (variable budgets, uniform
in [N/2, 3N/2]) gathered from anywhere in a flat unit pool. Reports the median time of a decode
step of one layer (CUDA events), and the K/V bytes it reads per second: launched from Python as
a server without decode CUDA graphs runs it, and for the Triton kernel also replayed from a CUDA
graph (`triton_graph_*`: the GPU's own time), against the device-to-device copy's bandwidth
measured in the same run.

The serving-shaped case (`serving_*` rows, `benchmarks/decode_step.py`) times a whole decode step
of a compressing server through the code it calls: the step's plan and, in each of 32 layers,
the attention and the observation write, for B requests between budget 256 and budget + buffer
384, with the fused plan (one block, the Triton kernel) against the padded blocks the CPU uses,
with and without requests that keep statistics (H2O beside R-KV). It reports milliseconds and
GPU kernels (launches) per step. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import metadata_markdown, run_metadata
from benchmarks.decode_step import StepShape, serving_step
from sgl_kvc.kernels.decode_attention import decode_attention
from sgl_kvc.kernels.fp8 import Fp8Rows, quantize_rows
from sgl_kvc.kernels.per_head_attention import HeadTables, per_head_decode
from sgl_kvc.kernels.triton_per_head import BLOCK_N, FP8_BLOCK_N, FP8_DOT, FP8_STAGES_HOPPER, SPLIT_N, triton_per_head_decode

RESULTS = Path(__file__).parent / "results"
H_Q, H_KV, D = 32, 8, 128


def _time(fn, reps: int) -> float:
    """Median milliseconds of `fn()` over `reps` runs (after warm-up), CUDA events."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def _time_graph(fn, reps: int) -> float:
    """Median milliseconds of one replay of `fn` captured in a CUDA graph: the kernels' own time,
    without the host's launch overhead (which `_time` includes, as a server without decode
    graphs pays it)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _time(graph.replay, reps)


def _inputs(b: int, n: int, seed: int = 0) -> dict:
    """One layer's decode inputs: query, bf16 K/V unit pools and ragged per-head tables."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    lens = torch.randint(n // 2, n * 3 // 2 + 1, (b, H_KV), device=dev, generator=g)
    width = int(lens.max())
    slots_total = b * width + 1
    units = slots_total * H_KV  # the flat unit pool ([slots, H_KV] units of one layer)
    k_units = torch.randn(units, D, device=dev, dtype=torch.bfloat16, generator=g)
    v_units = torch.randn(units, D, device=dev, dtype=torch.bfloat16, generator=g)
    perm = torch.randperm(units - 1, device=dev, generator=g)[: b * H_KV * width] + 1
    tables = HeadTables(perm.reshape(b, H_KV, width) * (torch.arange(width, device=dev) < lens[..., None]), lens)
    q = torch.randn(b, H_Q, D, device=dev, dtype=torch.bfloat16, generator=g)
    return {"g": g, "lens": lens, "slots_total": slots_total, "k_units": k_units, "v_units": v_units,
            "tables": tables, "q": q}


def case(b: int, n: int, reps: int, seed: int = 0) -> dict:
    x = _inputs(b, n, seed)
    g, lens, slots_total, q, tables = x["g"], x["lens"], x["slots_total"], x["q"], x["tables"]
    k_units, v_units, dev = x["k_units"], x["v_units"], "cuda"

    # uniform budget at the same total: every head keeps the mean count, one slot per token
    n_uniform = int(lens.float().mean().round())
    k_slots = k_units.view(-1, H_KV, D)
    v_slots = v_units.view(-1, H_KV, D)
    slots = torch.randperm(slots_total - 1, device=dev, generator=g)[: b * n_uniform].reshape(b, n_uniform) + 1
    pad = torch.zeros(b, n_uniform, dtype=torch.bool, device=dev)

    kv_bytes = int(lens.sum()) * 2 * D * 2  # K and V, bf16
    out = {"batch": b, "mean_kept": n_uniform, "kv_mb": kv_bytes / 1e6}
    for name, fn in {
        "triton": lambda: triton_per_head_decode(q, k_units, v_units, tables),
        "triton_probs": lambda: triton_per_head_decode(q, k_units, v_units, tables, return_probs=True),
        "torch": lambda: per_head_decode(q, k_units, v_units, tables),
        "uniform_torch": lambda: decode_attention(q, k_slots, v_slots, slots, pad, D**-0.5),
    }.items():
        ms = _time(fn, reps)
        out[f"{name}_ms"] = round(ms, 4)
        out[f"{name}_gbps"] = round(kv_bytes / ms / 1e6, 1)
    ms = _time_graph(lambda: triton_per_head_decode(q, k_units, v_units, tables), reps)
    out["triton_graph_ms"] = round(ms, 4)
    out["triton_graph_gbps"] = round(kv_bytes / ms / 1e6, 1)
    ref = per_head_decode(q, k_units, v_units, tables).float()
    got = triton_per_head_decode(q, k_units, v_units, tables).float()
    out["max_abs_diff"] = float((got - ref).abs().max())
    # the same step from an FP8 pool (e4m3 codes and a bf16 scale per unit, sgl-kvc's FP8 pool),
    # its codes widened to bfloat16 (the default, `FP8_DOT`) or to float16 before the products
    k_fp8, v_fp8 = _fp8_pool(k_units), _fp8_pool(v_units)
    fp8_bytes = int(lens.sum()) * 2 * (D + 2)  # codes and scale of K and V
    for dot, name in (("bfloat16", "fp8"), ("float16", "fp8_f16dot")):
        ms = _time_graph(lambda: triton_per_head_decode(q, k_fp8, v_fp8, tables, fp8_dot=dot), reps)
        out[f"{name}_graph_ms"] = round(ms, 4)
        out[f"{name}_graph_gbps"] = round(fp8_bytes / ms / 1e6, 1)
        out[f"{name}_vs_bf16"] = round(ms / out["triton_graph_ms"], 3)
        fp8_out = triton_per_head_decode(q, k_fp8, v_fp8, tables, fp8_dot=dot).float()
        out[f"{name}_rel_err"] = float((fp8_out - got).norm() / got.norm())  # against the bf16 pool's output
    return out


SWEEP = {"block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 4)}
FP8_DOTS = ("float16", "bfloat16")  # what the FP8 pool's codes widen to (`triton_per_head.FP8_DOT`)


def sweep(b: int, n: int, reps: int, seed: int = 0) -> list[dict]:
    """The decode kernel's launch settings, for the bf16 and the FP8 pool: CUDA-graph replay
    medians of every combination of `SWEEP`, and which one the kernel uses by default."""
    x = _inputs(b, n, seed)
    q, tables = x["q"], x["tables"]
    fp8 = (_fp8_pool(x["k_units"]), _fp8_pool(x["v_units"]))
    pools = {"bf16": (x["k_units"], x["v_units"], None)}
    pools.update({f"fp8_e4m3/{dot}": (*fp8, dot) for dot in FP8_DOTS})
    rows = []
    for pool, (k, v, dot) in pools.items():
        default = (BLOCK_N, 4, 3) if dot is None else (FP8_BLOCK_N, 4, FP8_STAGES_HOPPER)  # Triton's 4 warps, 3 stages
        for bn in SWEEP["block_n"]:
            for nw in SWEEP["num_warps"]:
                for ns in SWEEP["num_stages"]:
                    ms = _time_graph(lambda: triton_per_head_decode(q, k, v, tables, block_n=bn, num_warps=nw,
                                                                    num_stages=ns, fp8_dot=dot), reps)
                    rows.append({"batch": b, "mean_kept": n, "pool": pool, "block_n": bn, "num_warps": nw,
                                 "num_stages": ns, "graph_ms": round(ms, 4),
                                 "default": (bn, nw, ns) == default and dot in (None, FP8_DOT)})
    return rows


def _fp8_pool(units: torch.Tensor) -> Fp8Rows:
    """A bf16 unit pool [U, d] stored as sgl-kvc's FP8 pool: e4m3 codes and a bf16 scale per unit."""
    codes, scales = quantize_rows(units, "fp8_e4m3", "bfloat16")
    return Fp8Rows(codes.view(torch.uint8), scales, "fp8_e4m3", "bfloat16", torch.bfloat16)


def kernels_per_call(fn) -> int:
    """GPU kernels one call of `fn` launches (the profiler's CUDA kernel events)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower())


def serving(batch: int, reps: int) -> list[dict]:
    """The serving-shaped step (see the module doc), fused and padded, side by side."""
    rows = []
    for policies in (("rkv",), ("rkv", "h2o")):
        for fused in (True, False):
            _, step, _ = serving_step(batch, StepShape(), policies, "cuda", fused=fused)
            ms = _time(step, reps)
            rows.append({"batch": batch, "policies": "+".join(policies), "plan": "fused" if fused else "padded",
                         "step_ms": round(ms, 3), "kernels_per_step": kernels_per_call(step)})
    return rows


def long_request(batch: int, long_len: int, reps: int) -> list[dict]:
    """The serving-shaped step (fused) of `batch` requests, with and without one of them
    `long_len` entries long: its time and the GPU memory one step allocates above what it holds
    (`torch.cuda.max_memory_allocated`), for R-KV alone and R-KV beside H2O."""
    rows = []
    for policies in (("rkv",), ("rkv", "h2o")):
        for n in (0, long_len):
            torch.cuda.empty_cache()
            _, step, _ = serving_step(batch, StepShape(), policies, "cuda", fused=True,
                                      lengths={batch // 2: n} if n else None)
            step()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            transient = torch.cuda.max_memory_allocated() - base
            rows.append({"batch": batch, "policies": "+".join(policies), "long_request": n or "-",
                         "transient_mib": round(transient / 2**20, 1), "step_ms": round(_time(step, reps), 3),
                         "kernels_per_step": kernels_per_call(step)})
            del step
    return rows


def host_us(b: int, n: int, calls: int = 1000, rounds: int = 7) -> float:
    """Median over `rounds` of the wall time per launched decode step, in microseconds, for
    b requests keeping exactly n units per head: small steps, where the GPU waits on the host,
    so this is the host's cost (argument checks, allocations, the kernel launches)."""
    x = _inputs(b, 2 * n)  # every head holds at least n units: the first n of each, below
    tables = HeadTables(x["tables"].units[..., :n].contiguous(), torch.full_like(x["tables"].lengths, n))
    step = lambda: triton_per_head_decode(x["q"], x["k_units"], x["v_units"], tables)  # noqa: E731
    for _ in range(10):
        step()
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return round(statistics.median(times), 1)


def copy_ceiling_gbps(gib: int = 2) -> float:
    """Device-to-device copy of `gib` GiB, bytes read plus written per second: the bandwidth a
    kernel that reads its data once can approach."""
    src = torch.randn(gib << 28, device="cuda")  # 4-byte floats
    dst = torch.empty_like(src)
    ms = _time(lambda: dst.copy_(src), 10)
    return round(2 * src.numel() * 4 / ms / 1e6, 1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tag", default="gpu")
    ap.add_argument("--batches", default="8,32,128")
    ap.add_argument("--kept", default="256,1024,4096")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--serving-batches", default="8,64,256")
    ap.add_argument("--long-request", type=int, default=32768,
                    help="entries of the long request among 256 short ones (0: skip those rows)")
    ap.add_argument("--sweep", action="store_true",
                    help="time the kernel's launch settings instead (per-head-kernel-sweep-<tag>.*)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.per_head_kernel needs a CUDA GPU")
    meta = run_metadata("benchmarks.per_head_kernel", argv)
    print(metadata_markdown(meta), flush=True)
    if args.sweep:
        return _write_sweep(args, meta)
    ceiling = copy_ceiling_gbps()
    # the host's cost of a launched step: a table of one split (the decode kernel normalizes it) and
    # of two (a second kernel merges them)
    host = {f"8x{n}": host_us(8, n) for n in (SPLIT_N // 2, SPLIT_N * 2)}
    rows = [case(int(b), int(n), args.reps) for b in args.batches.split(",") for n in args.kept.split(",")]
    served = [r for b in args.serving_batches.split(",") for r in serving(int(b), args.reps)]
    longs = long_request(256, args.long_request, args.reps) if args.long_request else []
    result = {"meta": meta, "shape": {"h_q": H_Q, "h_kv": H_KV, "d": D, "dtype": "bfloat16"},
              "copy_ceiling_gbps": ceiling, "host_us_per_launched_step": host, "rows": rows,
              "serving_rows": served, "long_request_rows": longs}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"per-head-kernel-{args.tag}.json").write_text(json.dumps(result, indent=1) + "\n")
    cols = ["batch", "mean_kept", "kv_mb", "triton_ms", "triton_gbps", "triton_graph_ms", "triton_graph_gbps",
            "fp8_graph_ms", "fp8_graph_gbps", "fp8_vs_bf16", "fp8_rel_err", "fp8_f16dot_graph_ms",
            "fp8_f16dot_vs_bf16", "triton_probs_ms", "torch_ms", "uniform_torch_ms", "max_abs_diff"]
    lines = [metadata_markdown(meta), f"Device-to-device copy (read + write): {ceiling} GB/s.", "",
             "Host time per launched step (requests x units per head, median of 7 x 1000 calls): "
             + ", ".join(f"{k}: {v} us" for k, v in host.items()) + ".", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    serving_cols = ["batch", "policies", "plan", "step_ms", "kernels_per_step"]
    lines += ["", "A serving-shaped decode step (32 layers, budget 256 + buffer 128; plan, attention and "
              "observation of every layer; launched from Python):", "",
              "| " + " | ".join(serving_cols) + " |", "|" + "---|" * len(serving_cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in serving_cols) + " |" for r in served]
    if longs:
        long_cols = ["batch", "policies", "long_request", "transient_mib", "step_ms", "kernels_per_step"]
        lines += ["", "The same step (fused) with one request of 256-384 entries replaced by a long one: GPU memory "
                  "one step allocates above what it holds, and its time:", "",
                  "| " + " | ".join(long_cols) + " |", "|" + "---|" * len(long_cols)]
        lines += ["| " + " | ".join(str(r[c]) for c in long_cols) + " |" for r in longs]
    (RESULTS / f"per-head-kernel-{args.tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _write_sweep(args: argparse.Namespace, meta: dict) -> None:
    rows = [r for b in args.batches.split(",") for n in args.kept.split(",") for r in sweep(int(b), int(n), args.reps)]
    RESULTS.mkdir(exist_ok=True)
    name = f"per-head-kernel-sweep-{args.tag}"
    (RESULTS / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [metadata_markdown(meta), "CUDA-graph replay, ms; * the kernel's default for the pool.", "",
             "| batch | mean_kept | pool | default | best | best (block_n, warps, stages) |", "|---|---|---|---|---|---|"]
    for key in dict.fromkeys((r["batch"], r["mean_kept"], r["pool"]) for r in rows):
        group = [r for r in rows if (r["batch"], r["mean_kept"], r["pool"]) == key]
        best = min(group, key=lambda r: r["graph_ms"])
        default = next((r["graph_ms"] for r in group if r["default"]), "-")
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {default} | {best['graph_ms']} | "
                     f"{best['block_n']}, {best['num_warps']}, {best['num_stages']} |")
    lines += ["", "| batch | mean_kept | pool | block_n | num_warps | num_stages | graph_ms |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['mean_kept']} | {r['pool']} | {r['block_n']} | {r['num_warps']} | "
              f"{r['num_stages']} | {r['graph_ms']}{' *' if r['default'] else ''} |" for r in rows]
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
