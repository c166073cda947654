"""CPU decode speed of `make serve` against OpenVINO GenAI, same model, same prompts, same CPU.

    python -m benchmarks.cpu_decode --openvino-python /work/ov-venv/bin/python \\
        --openvino-model /work/ov-smollm2-fp32

SmolLM2-135M-Instruct, greedy chat completions of `--output-len` tokens (`ignore_eos`) for 1 and
16 users at once (seeded prompts of about `--prompt-words` words: a passage to retell). sgl-kvc:
one fresh `python -m sgl_kvc.launch` per configuration (`make serve`'s `--policy rkv` and plain
SGLang, each in bfloat16 and in float32); OpenVINO GenAI (its own venv,
`research/openvino_runner.py`; the model exported with `optimum-cli export openvino
--weight-format fp32`) with and without its cache eviction at a comparable size. Configurations
run one after another, each alone on the machine; tokens/s = users x output tokens / wall time,
prompt included. Writes `<out>/cpu-decode.{json,md}`.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from benchmarks.common import REPO, machine, metadata_markdown, run_metadata
from benchmarks.quality_fillers import sentence
from sgl_kvc.server_process import ServerProcess

# Explicit dtypes, so that a row means the same whatever the launcher's default on this CPU.
SGLKVC = {
    "sgl-kvc rkv (bf16)": "--policy rkv --dtype bfloat16",
    "sgl-kvc rkv (float32)": "--policy rkv --dtype float32",
    "plain SGLang (--policy none, bf16)": "--policy none --dtype bfloat16",
    "plain SGLang (--policy none, float32)": "--policy none --dtype float32",
}
USERS = (1, 16)
# `--exactness`: what answering as plain SGLang costs (`--kv-decode-attention`): sgl-kvc's kernel
# reading the requests that hold nothing compressed as SGLang reads them (the default), against
# the kernel's float32 softmax for every request; plain SGLang beside them. bfloat16, where the two
# differ (in float32 both are the batched kernel).
EXACTNESS = {
    "sgl-kvc rkv, intact requests as SGLang (batched)": "--policy rkv --dtype bfloat16 --kv-decode-attention batched",
    "sgl-kvc rkv, float32 softmax for all (batched-float32)":
        "--policy rkv --dtype bfloat16 --kv-decode-attention batched-float32",
    "plain SGLang (--policy none)": "--policy none --dtype bfloat16",
}


def prompts(n: int, words: int, seed: int) -> list[str]:
    out = []
    for i in range(n):
        rng = random.Random(f"cpu-decode-{seed}-{i}")
        text = ""
        while len(text.split()) < words:
            text += sentence(rng) + " "
        out.append(f"{text.strip()}\n\nRetell the text above in your own words, in great detail.")
    return out


def sglkvc_run(flags: str, texts: list[str], output_len: int, logs: Path, name: str) -> list[dict]:
    cmd = [sys.executable, "-m", "sgl_kvc.launch", *shlex.split(flags)]
    results = []
    log = logs / (re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") + ".log")
    with ServerProcess.launch(cmd, log_path=log) as server:

        def one(text: str) -> int:
            body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": output_len,
                    "temperature": 0.0, "ignore_eos": True}
            r = requests.post(server.url + "/v1/chat/completions", json=body, timeout=3600)
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

        one(texts[0])  # warm-up
        for users in USERS:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(users) as pool:
                tokens = sum(pool.map(one, texts[:users]))
            seconds = time.perf_counter() - t0
            results.append({"name": name, "flags": flags, "users": users, "output_tokens": tokens,
                            "seconds": seconds, "tokens_per_s": tokens / seconds})
            print(json.dumps(results[-1]), flush=True)
    return results


def openvino_runs(args: argparse.Namespace, texts: list[str], logs: Path) -> tuple[list[dict], str | None]:
    budget = {"start": 32, "recent": 128, "max": 256}  # sinks + recent window, at most R-KV's 128 + 128
    runs = [{"name": f"OpenVINO GenAI{' + eviction' if ev else ''}", "users": u, "eviction": ev}
            for ev in (None, budget) for u in USERS]  # fmt: skip
    spec = {"model": args.openvino_model, "prompts": texts, "output_len": args.output_len, "runs": runs}
    src, dst = logs / "openvino-in.json", logs / "openvino-out.json"
    src.write_text(json.dumps(spec))
    runner = REPO / "research" / "openvino_runner.py"
    proc = subprocess.run([args.openvino_python, str(runner), str(src), str(dst)], capture_output=True, text=True)
    if proc.returncode != 0 or not dst.exists():
        return [], proc.stderr[-500:]
    out = json.loads(dst.read_text())
    return out["results"], out["version"]


def markdown(data: dict) -> str:
    rows = data["results"]
    by = {(r["name"], r["users"]): r for r in rows}
    names = list(dict.fromkeys(r["name"] for r in rows))
    out = [
        f"SmolLM2-135M-Instruct, {data['setup']['output_len']} greedy output tokens (ignore_eos) per user, "
        f"prompts of about {data['setup']['prompt_tokens']} tokens, every configuration alone on the machine; "
        f"OpenVINO GenAI {data['setup'].get('openvino_version') or 'not run'} (model exported in float32; "
        f"eviction: CacheEvictionConfig(start 32, recent 128, max 256), NORM_SUM). Output tokens/s over "
        f"the whole run (prompt included).\n",
        "| configuration | " + " | ".join(f"{u} user{'s' if u > 1 else ''} (tok/s)" for u in USERS) + " |",
        "| --- |" + " ---: |" * len(USERS),
    ]
    for n in names:
        cells = []
        for u in USERS:
            r = by.get((n, u))
            cells.append("failed" if r is None or "error" in r else f"{r['tokens_per_s']:.1f}")
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    if data.get("openvino_error"):
        out.append(f"\nOpenVINO: {data['openvino_error']}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--prompt-words", type=int, default=90, help="about 128 tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--openvino-python", default="")
    p.add_argument("--openvino-model", default="")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--exactness", type=int, default=0, metavar="ROUNDS",
                   help="instead: the `EXACTNESS` configurations, ROUNDS times interleaved (cpu-decode-exactness.*)")
    args = p.parse_args(argv)
    meta = run_metadata("benchmarks.cpu_decode", argv)
    texts = prompts(max(USERS), args.prompt_words, args.seed)
    logs = Path(tempfile.mkdtemp(prefix="cpu-decode-"))
    if args.exactness:
        return exactness(args, meta, texts, logs)
    results: list[dict] = []
    for name, flags in SGLKVC.items():
        results += sglkvc_run(flags, texts, args.output_len, logs, name)
    ov_error = ov_version = None
    if args.openvino_python and args.openvino_model:
        ov, info = openvino_runs(args, texts, logs)
        results += ov
        ov_version, ov_error = (info, None) if ov else (None, info)
    from transformers import AutoTokenizer

    from sgl_kvc.model import ensure_smollm2

    tok = AutoTokenizer.from_pretrained(ensure_smollm2())
    data = {
        "meta": meta,
        "setup": {"machine": machine(), "output_len": args.output_len, "seed": args.seed,
                  "prompt_tokens": round(sum(len(tok.encode(t)) for t in texts) / len(texts)),
                  "openvino_version": ov_version},
        "results": results,
        "openvino_error": ov_error,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu-decode.json").write_text(json.dumps(data, indent=1) + "\n")
    text = f"{metadata_markdown(meta)}\n{markdown(data)}"
    (args.out / "cpu-decode.md").write_text(text)
    print(text, flush=True)
    return data


def exactness(args: argparse.Namespace, meta: dict, texts: list[str], logs: Path) -> dict:
    """The `EXACTNESS` configurations, `args.exactness` rounds interleaved (round 1 of each, then
    round 2, ...): the machine's drift between rounds enters no comparison within a round."""
    results: list[dict] = []
    for round_ in range(args.exactness):
        for name, flags in EXACTNESS.items():
            for row in sglkvc_run(flags, texts, args.output_len, logs, f"{name} #{round_ + 1}"):
                results.append({**row, "name": name, "round": round_ + 1})
    data = {"meta": meta, "setup": {"machine": machine(), "output_len": args.output_len, "seed": args.seed,
                                    "rounds": args.exactness}, "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu-decode-exactness.json").write_text(json.dumps(data, indent=1) + "\n")
    lines = [
        f"SmolLM2-135M-Instruct in bfloat16, {args.output_len} greedy output tokens (ignore_eos) per user, "
        f"{args.exactness} rounds interleaved, every configuration alone on the machine. Output tokens/s over the "
        "whole run, each round's, then the median.\n",
        "| configuration | users | " + " | ".join(f"round {r + 1}" for r in range(args.exactness)) + " | median |",
        "| --- | ---: |" + " ---: |" * (args.exactness + 1),
    ]
    for name in EXACTNESS:
        for users in USERS:
            runs = [r["tokens_per_s"] for r in results if r["name"] == name and r["users"] == users]
            cells = " | ".join(f"{x:.1f}" for x in runs)
            lines.append(f"| {name} | {users} | {cells} | {statistics.median(runs):.1f} |")
    text = f"{metadata_markdown(meta)}\n" + "\n".join(lines) + "\n"
    (args.out / "cpu-decode-exactness.md").write_text(text)
    print(text, flush=True)
    return data


if __name__ == "__main__":
    main()
