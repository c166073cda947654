"""Which of the adapter's files one turn of a conversation runs through, measured on a live server.

    python -m benchmarks.turn_files          # benchmarks/results/turn-files.{json,md}

The README's chat-over-an-upload example on `python -m sgl_kvc.launch --policy rkv` (KVzip document
at ratio 0.3, resident documents extended): turn 1 and its answer, then turn 2 (`[document, q1, a1,
q2]`), which starts from turn 1's document and turn and publishes its own extension. While turn 2
is served, and only then, the scheduler's main thread runs under a profiler (`sys.setprofile`,
switched on and off by SIGUSR1 and SIGUSR2 from a `sitecustomize` this run puts on the server's
path) that records every function of `sgl_kvc/adapter/` it calls. What a prefill or decode step
runs whatever the request (attention, memory, moments, telemetry) is listed apart from the
documents package, the code a reader follows for a turn (docs/architecture.md, "Following one
turn"). The HTTP process's part (the chat route counts the document's tokens,
`adapter/documents/chat_documents.py`) is not traced.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import psutil

from benchmarks.common import metadata_markdown, run_metadata
from loadtest.server import ServerProcess

# Installed in every process the server starts; only the one that owns the scheduler's hooks
# answers the signals (the others never reach the adapter).
SITECUSTOMIZE = r'''
import json, os, signal, sys
_out = os.environ.get("SGLKVC_TURN_TRACE")
if _out:
    _seen = set()
    _root = os.sep + os.path.join("sgl_kvc", "adapter") + os.sep

    def _profile(frame, event, arg):
        if event == "call":
            path = frame.f_code.co_filename
            if _root in path:
                _seen.add((path.split(_root, 1)[1], frame.f_code.co_qualname))

    def _on(signum, frame):
        _seen.clear()
        sys.setprofile(_profile)

    def _off(signum, frame):
        sys.setprofile(None)
        with open(f"{_out}.{os.getpid()}", "w") as f:
            json.dump(sorted(_seen), f)

    signal.signal(signal.SIGUSR1, _on)
    signal.signal(signal.SIGUSR2, _off)
'''

DOCUMENT = "adapter/documents/"


def _document_text(words: int) -> str:
    facts = {20: "The code of the red door is 4817.", 100: "The code of the blue door is 2290."}
    parts = []
    for i in range(words):
        parts.append(facts.get(i, f"line {i} of the inventory lists crate {i * 7 % 113} on shelf {i % 9}."))
    return " ".join(parts)


def _chat(url: str, messages: list[dict], tokens: int) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="-", timeout=600)
    out = client.chat.completions.create(
        model="m", messages=messages, max_tokens=tokens, temperature=0,
        extra_body={"kv_compression": {"prompt_policy": "kvzip", "document": {"ratio": 0.3}}},
    )
    return out.choices[0].message.content or ""


def _scheduler_pids(server: ServerProcess) -> list[int]:
    return [p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)]


def trace_turn(model: str, words: int, answer_tokens: int, log: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "sitecustomize.py").write_text(SITECUSTOMIZE)
        out = Path(tmp) / "trace"
        env = {**os.environ, "SGLKVC_TURN_TRACE": str(out),
               "PYTHONPATH": os.pathsep.join(p for p in (tmp, os.environ.get("PYTHONPATH")) if p)}
        cmd = [sys.executable, "-m", "sgl_kvc.launch", "--model-path", model, "--policy", "rkv",
               "--dtype", "float32"]
        with ServerProcess.launch(cmd, env=env, log_path=log) as server:
            messages = [{"role": "user", "content": _document_text(words)},
                        {"role": "user", "content": "What is the code of the red door? Answer with the number only."}]
            messages.insert(1, {"role": "assistant", "content": "I have read it."})
            answer = _chat(server.url, messages, answer_tokens)
            messages += [{"role": "assistant", "content": answer},
                         {"role": "user", "content": "What is the code of the blue door? Answer with the number only."}]
            before = server.stats()["documents"]
            pids = _scheduler_pids(server)
            for pid in pids:
                os.kill(pid, signal.SIGUSR1)
            time.sleep(1.0)  # the handler runs between two of the scheduler's bytecodes
            _chat(server.url, messages, answer_tokens)
            server.wait_idle()
            for pid in pids:
                os.kill(pid, signal.SIGUSR2)
            deadline = time.monotonic() + 30
            while not any(out.parent.glob("trace.*")) and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(0.5)
            after = server.stats()["documents"]
            seen: set[tuple[str, str]] = set()
            for path in out.parent.glob("trace.*"):
                seen |= {tuple(x) for x in json.loads(path.read_text())}
    by_file: dict[str, list[str]] = defaultdict(list)
    for path, name in sorted(seen):
        by_file[f"adapter/{path}"].append(name)
    documents = {f: names for f, names in by_file.items() if f.startswith(DOCUMENT)}
    return {
        "documents_files": documents,
        "other_adapter_files": {f: names for f, names in by_file.items() if not f.startswith(DOCUMENT)},
        "documents_stats_delta": {k: after[k] - before[k] for k in after
                                  if isinstance(after[k], int) and isinstance(before.get(k), int)},
    }


def markdown(result: dict, meta: dict) -> str:
    docs, other = result["documents_files"], result["other_adapter_files"]
    lines = ["# One conversation turn's files", "", metadata_markdown(meta), "",
             f"Turn 2 ran through **{len(docs)}** files of `sgl_kvc/adapter/documents/` "
             f"(and {len(other)} other adapter files every step runs):", "",
             "| file | functions |", "| --- | --- |"]
    lines += [f"| `{f}` | {', '.join(f'`{n}`' for n in names)} |" for f, names in docs.items()]
    lines += ["", "Every step's code: " + ", ".join(f"`{f}`" for f in other), "",
              "Documents counters during the turn: " + ", ".join(
                  f"{k} +{v}" for k, v in result["documents_stats_delta"].items() if v), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from sgl_kvc.model import ensure_smollm2

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--words", type=int, default=150, help="the document's length in filler lines (about 15 tokens each)")
    p.add_argument("--answer-tokens", type=int, default=8)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = run_metadata("benchmarks.turn_files", argv)
    result = trace_turn(str(ensure_smollm2()), args.words, args.answer_tokens,
                        Path(tempfile.mkdtemp(prefix="turn-files-")) / "server.log")
    (args.out / "turn-files.json").write_text(json.dumps({"meta": meta, **result}, indent=1) + "\n")
    (args.out / "turn-files.md").write_text(markdown(result, meta))
    print(markdown(result, meta))


if __name__ == "__main__":
    main()
