"""The built-in demo model served when no `--model-path` is given."""

from sgl_kvc.model.demo import DEMO_MODEL_NAME, DemoModelSpec, ensure_demo_model

__all__ = ["DEMO_MODEL_NAME", "DemoModelSpec", "ensure_demo_model"]
