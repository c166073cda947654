"""OpenVINO GenAI on the CPU-decode benchmark's prompts; run with the python of its own venv.

    /path/to/ov-venv/bin/python research/openvino_runner.py IN.json OUT.json

OpenVINO GenAI (`pip install openvino-genai`) serves a model exported with `optimum-cli export
openvino`; it lives in a separate venv and this script imports nothing from sgl-kvc. IN.json
(written by `benchmarks.cpu_decode`): the exported model folder, the prompts (text), the output
length and the runs, each {"name", "users", "eviction": null or {"start", "recent", "max"}}. A run
sends its first `users` prompts at once to one continuous-batching pipeline (greedy,
`ignore_eos`); with eviction, OpenVINO's own cache eviction (`CacheEvictionConfig`, NORM_SUM
aggregation, its default) keeps at most `max` tokens per sequence. OUT.json: per run, output
tokens, seconds and tokens/s, after one warm-up generation.
"""

from __future__ import annotations

import json
import sys
import time


def run(spec: dict, model: str, prompts: list[str], output_len: int) -> dict:
    import openvino_genai as ov

    scheduler = ov.SchedulerConfig()
    scheduler.cache_size = 2  # GB of KV cache
    scheduler.max_num_seqs = max(spec["users"], 1)
    ev = spec.get("eviction")
    if ev:
        scheduler.use_cache_eviction = True
        scheduler.cache_eviction_config = ov.CacheEvictionConfig(
            ev["start"], ev["recent"], ev["max"], ov.AggregationMode.NORM_SUM
        )
    pipe = ov.LLMPipeline(model, "CPU", scheduler_config=scheduler)
    config = ov.GenerationConfig()
    config.max_new_tokens = output_len
    config.ignore_eos = True
    config.do_sample = False
    pipe.generate(prompts[:1], config)  # warm-up: compilation
    batch = prompts[: spec["users"]]
    t0 = time.perf_counter()
    out = pipe.generate(batch, config)
    seconds = time.perf_counter() - t0
    texts = list(out.texts)
    tokens = output_len * len(texts)  # ignore_eos: every sequence writes output_len tokens
    return {**spec, "output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "sample": texts[0][:200]}


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    results = []
    for r in spec["runs"]:
        try:
            results.append(run(r, spec["model"], spec["prompts"], spec["output_len"]))
        except Exception as e:  # noqa: BLE001 - recorded, the other runs go on
            results.append({**r, "error": f"{type(e).__name__}: {e!s:.300}"})
        print(json.dumps(results[-1]), flush=True)
    import openvino_genai

    with open(sys.argv[2], "w") as f:
        json.dump({"version": openvino_genai.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
