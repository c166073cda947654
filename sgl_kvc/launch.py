"""`python -m sgl_kvc.launch`: SGLang's server launcher with the sgl-kvc plugin loaded.

Every SGLang server flag works and means what it means in SGLang; the flags of `KvcConfig`
are added. Per device defaults are filled in only where the user did not give the flag:
on CPU the torch-native attention and sampling backends, no grammar backend and a modest
`--max-total-tokens`; on CUDA FlashInfer, or SGLang's Triton backend where FlashInfer is not
installed or the KV pool is sgl-kvc's own (FP8, variable budgets). Without `--model-path` the built-in real model,
SmolLM2-135M-Instruct, is served (converted from its packaged GGUF file on first use);
`--model-path demo` serves the tiny random-weight model the fast tests use. Set-ups sgl-kvc
cannot serve correctly are refused with one line (`launcher.refusals.unsupported`).

The entry module only: the launcher's code is the `sgl_kvc.launcher` package (its docstring
names each module's concern), whose import installs sgl-kvc's import stand-ins before anything
imports SGLang.
"""

from __future__ import annotations

from sgl_kvc.launcher.serve import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
