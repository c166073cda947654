"""Run the 2K templated pass-key prompts (3 depths) through one compressing server, one at a time,
cache flushed between; the compaction trace goes to <logdir>/trace.jsonl."""
import json, sys, time
from pathlib import Path
sys.path.insert(0, __import__("os").path.abspath(__import__("os").path.join(__import__("os").path.dirname(__file__), "..", "..")))  # the repository root
from transformers import AutoTokenizer
from benchmarks.quality import ManagedServer
from benchmarks.quality_samples import is_correct, passkey_samples

mode, logdir = sys.argv[1], Path(sys.argv[2])
extra = sys.argv[3:]
styles = ["templated"]
logdir.mkdir(parents=True, exist_ok=True)
tok = AutoTokenizer.from_pretrained(str(__import__("sgl_kvc.model", fromlist=["ensure_smollm2"]).ensure_smollm2()))
samples = [s for st in styles for s in passkey_samples(tok, {2048: 1}, [0.1, 0.5, 0.9], 0, st)]
flags = ["--policy", "snapkv", "--prompt-policy", "kvzip", "--kv-budget", "256", "--dtype", "float32",
         "--kv-head-budget", mode, "--kv-pass-work", "0", *extra]
srv = ManagedServer("kvzip-" + mode, flags, logdir, 600, max_restarts=0, env={"SGLKVC_TRACE": str(logdir / "trace.jsonl")})
out = []
try:
    for s in samples:
        srv.flush()
        o = srv.complete(s, mode, None, 600)
        out.append({"id": s.id, "rid": o.rid if hasattr(o, "rid") else None, "text": o.text, "error": o.error,
                    "ok": o.text is not None and is_correct(s, o.text), "seconds": o.seconds})
        print(out[-1], flush=True)
finally:
    srv.close()
json.dump(out, open(logdir / "answers.json", "w"))
