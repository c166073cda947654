"""How wide a packed request's widest (layer, KV head) grows, and what a packed request holds for it.

    python -m benchmarks.head_widths                    # benchmarks/results/head-widths.{json,md}
    python -m benchmarks.head_widths --baseline COMMIT  # the same requests on that commit's server too

On the unit pool a request whose heads keep different numbers is packed: what it keeps of each head
is listed entry by entry (`core/request_state.PackedEntries`), and a decode step builds tables of
every head as wide as the request's widest (`block_tables`). One compressing server
(`--policy rkv --kv-head-budget policy`, the default server's head budget, on the built-in model,
SmolLM2-135M-Instruct), its compaction trace on (`SGLKVC_TRACE`), and with `--baseline` the same
flags on sgl-kvc at another commit, up beside it (`benchmarks.common.commit_launcher`); pass-key
prompts in every filler style at each length, compressed at their prefill by each prompt policy at
each budget (entries per head), then decoding `--decode` tokens; one request at a time, sent to each
server in turn. Recorded per request:

* from the trace, its prefill compaction's widest (layer, KV head) over the mean of its L x H_kv
  heads (`widest / mean`), and the entries of tables padded to each layer's widest head over the
  entries kept (`per layer`);
* from `/v1/kvc/stats`, polled while it decodes, the most its state held (`request_state_bytes`:
  tables, statistics, passes under way), per entry its compaction kept: a measurement, beside the
  KV that entry holds (K and V of one head in the model's dtype) and what a pool entry reserves
  for a packed entry and its decode steps' tables (`PACKED_ENTRY_BYTES`, this checkout's).
A decode step's tables are not in the request's state: `per layer` is what they hold per entry.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import requests

from benchmarks.common import REPO, commit_launcher, metadata_markdown, run_metadata
from benchmarks.quality_fillers import STYLES
from benchmarks.quality_samples import Sample, passkey_samples
from loadtest.server import ServerProcess
from sgl_kvc.core.request_state import PACKED_ENTRY_BYTES

FLAGS = ["--policy", "rkv", "--kv-head-budget", "policy", "--kv-pass-work", "0", "--max-total-tokens", "65536"]


@dataclass(frozen=True)
class Row:
    server: str
    policy: str
    budget: int
    style: str
    length: int
    entries: int  # kept by its prefill compaction
    widest_over_mean: float
    per_layer: float  # entries padded to each layer's widest head, over the entries kept
    state_bytes: int  # the most `request_state_bytes` while it decoded

    @property
    def bytes_per_entry(self) -> float:
        return self.state_bytes / max(1, self.entries)


def widths_of(event: dict) -> tuple[int, float, float] | None:
    """(entries, widest / mean, per-layer padding) of a per-head compaction event."""
    heads = [[len(h) for h in layer] for layer in event["kept_positions"]]
    flat = [w for layer in heads for w in layer]
    kept = sum(flat)
    if event["selection"] != "per-head" or kept == 0:
        return None
    return kept, max(flat) * len(flat) / kept, sum(max(layer) * len(layer) for layer in heads) / kept


def most_state_bytes(server: ServerProcess, sample: Sample, kvc: dict, decode: int, timeout_s: float) -> int:
    """Send `sample` to `server` (greedy, `decode` tokens), polling its stats until it answers:
    the most its request state held."""
    body = {"model": "m", "prompt": sample.prompt_ids, "max_tokens": decode, "temperature": 0.0,
            "ignore_eos": True, "kv_compression": kvc}
    answer: dict[str, Any] = {}

    def send() -> None:
        try:
            r = requests.post(server.url + "/v1/completions", json=body, timeout=timeout_s)
            answer["status"], answer["text"] = r.status_code, r.text[:300]
        except Exception as e:  # noqa: BLE001 - reported below
            answer["status"], answer["text"] = None, repr(e)

    worker = threading.Thread(target=send)
    worker.start()
    most = 0
    while worker.is_alive():
        with contextlib.suppress(Exception):
            most = max(most, int(server.stats()["pool"]["request_state_bytes"]))
        time.sleep(0.02)
    worker.join()
    if answer.get("status") != 200:
        raise RuntimeError(f"{sample.id} {kvc}: {answer}")
    return most


def summary(rows: list[Row]) -> dict[str, dict[str, float]]:
    out = {}
    for key in sorted({(r.policy, r.budget, r.server) for r in rows}):
        mine = [r for r in rows if (r.policy, r.budget, r.server) == key]
        out[f"{key[0]} @ {key[1]}, {key[2]}"] = {
            "requests": len(mine),
            "widest_over_mean_median": statistics.median(r.widest_over_mean for r in mine),
            "widest_over_mean_max": max(r.widest_over_mean for r in mine),
            "per_layer_median": statistics.median(r.per_layer for r in mine),
            "per_layer_max": max(r.per_layer for r in mine),
            "bytes_per_entry_median": statistics.median(r.bytes_per_entry for r in mine),
            "bytes_per_entry_max": max(r.bytes_per_entry for r in mine),
        }
    return out


def markdown(result: dict) -> str:
    shape = result["model"]
    cell = 2 * shape["head_dim"] * 2
    lines = [
        "# How wide a packed request's widest head grows, and what it holds for it", "",
        metadata_markdown(result["meta"]), "",
        f"Model: {shape['layers']} layers x {shape['kv_heads']} KV heads, head dim {shape['head_dim']}: an entry's K "
        f"and V are {cell} bytes in bfloat16; a pool entry reserves {PACKED_ENTRY_BYTES} bytes for a packed entry and "
        "its decode steps' tables here. A decode step's tables are not in the request's state: "
        "`padded per layer` is their int64 columns per entry kept. "
        f"Server flags: `{' '.join(result['flags'])}`; {result['decode']} tokens decoded a request.", "",
        "| prompt policy @ budget, server | requests | widest / mean (median, max) | padded per layer (median, max) "
        "| state bytes / kept entry (median, max) |",
        "|---|---|---|---|---|",
    ]
    for name, s in result["summary"].items():
        lines.append(f"| {name} | {s['requests']} | {s['widest_over_mean_median']:.1f}, {s['widest_over_mean_max']:.1f} "
                     f"| {s['per_layer_median']:.2f}, {s['per_layer_max']:.2f} "
                     f"| {s['bytes_per_entry_median']:.0f}, {s['bytes_per_entry_max']:.0f} |")
    return "\n".join(lines) + "\n"


def model_shape(model_dir: Path) -> dict[str, int]:
    cfg = json.loads((model_dir / "config.json").read_text())
    return {"layers": cfg["num_hidden_layers"], "kv_heads": cfg["num_key_value_heads"],
            "head_dim": cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", nargs="+", default=["kvzip", "snapkv"])
    p.add_argument("--budgets", nargs="+", type=int, default=[64, 256])
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048])
    p.add_argument("--styles", nargs="+", default=list(STYLES), choices=list(STYLES))
    p.add_argument("--decode", type=int, default=48, help="tokens each request decodes")
    p.add_argument("--baseline", help="a commit whose server answers the same requests, up beside this one")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from sgl_kvc.model import ensure_smollm2

    model_dir = ensure_smollm2()
    tok = AutoTokenizer.from_pretrained(model_dir)
    logs = Path(tempfile.mkdtemp(prefix="head-widths-"))
    rows: list[Row] = []
    with contextlib.ExitStack() as stack:
        launchers = [("this", [sys.executable, "-m", "sgl_kvc.launch"], {})]
        if args.baseline:
            cmd, env, short = stack.enter_context(commit_launcher(args.baseline))
            launchers.append((short, cmd, env))
        servers = []
        for name, cmd, env in launchers:
            trace = logs / f"trace-{name}.jsonl"
            server = stack.enter_context(ServerProcess.launch(
                [*cmd, *FLAGS], env={**env, "SGLKVC_TRACE": str(trace)}, log_path=logs / f"{name}.log"))
            servers.append((name, server, trace))
        turn = 0
        for style in args.styles:
            for sample in passkey_samples(tok, {n: 1 for n in args.lengths}, [0.5], seed=0, style=style):
                for policy in args.policies:
                    for budget in args.budgets:
                        turn += 1
                        for name, server, trace in servers[turn % len(servers):] + servers[: turn % len(servers)]:
                            seen = sum(1 for _ in trace.open()) if trace.exists() else 0
                            kvc = {"prompt_policy": policy, "budget": budget}
                            most = most_state_bytes(server, sample, kvc, args.decode, args.timeout)
                            events = [json.loads(line) for line in trace.open()][seen:]
                            prefill = [w for e in events if e["moment"] == "prefill" and (w := widths_of(e))]
                            if prefill:
                                rows.append(Row(name, policy, budget, style, sample.meta["length"], *prefill[0], most))
                            server.post("/flush_cache", json={})
    result = {"meta": run_metadata("benchmarks.head_widths", argv), "model": model_shape(model_dir),
              "flags": FLAGS, "decode": args.decode, "summary": summary(rows), "rows": [asdict(r) for r in rows]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "head-widths.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "head-widths.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
