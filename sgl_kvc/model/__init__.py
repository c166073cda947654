"""Built-in models: SmolLM2-135M-Instruct (the default, real weights) and the tiny random-weight
demo model (`--model-path demo`, for fast tests)."""

from sgl_kvc.model.cache import default_cache_dir
from sgl_kvc.model.demo import DEMO_MODEL_NAME, DemoModelSpec, ensure_demo_model
from sgl_kvc.model.smollm import SMOLLM2_MODEL_NAME, ensure_smollm2, smollm2_gguf_path

__all__ = [
    "DEMO_MODEL_NAME",
    "SMOLLM2_MODEL_NAME",
    "DemoModelSpec",
    "default_cache_dir",
    "ensure_demo_model",
    "ensure_smollm2",
    "smollm2_gguf_path",
]
