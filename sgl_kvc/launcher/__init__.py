"""The launcher behind `python -m sgl_kvc.launch` (the entry module, `sgl_kvc/launch.py`), the
top layer of sgl-kvc: it may import anything, and nothing below it imports it. One concern a
module:

- `flags`: the user's SGLang flags as SGLang's own parser reads them (`sglang_flags`).
- `machine`: what the machine has (CUDA and its compute capability, FlashInfer, native bfloat16).
- `sglang_argv`: the per-device defaults and SGLang's argument list (`build_sglang_argv`).
- `refusals`: the set-ups sgl-kvc cannot serve (`unsupported`, `gpu_unsupported`) and those it
  warns about.
- `head_budget`: the `--kv-head-budget auto` decision (`resolve_head_budget`).
- `cpu_processes`: a CPU server's thread binding and its forked workers.
- `cli`: the command line read and checked (`parse_args`).
- `serve`: `main`, which starts the server.
"""

from sgl_kvc.compat import standins

# Before anything imports SGLang: every launcher module is imported through this package, and a
# spawned child re-runs it (it imports `sgl_kvc.launch`, the `__main__` it was started from).
standins.install()
