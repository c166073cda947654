"""sgl-kvc: KV-cache compression (eviction, FP8 storage) for SGLang, as a plugin.

Kept import-light on purpose: `sgl_kvc.compat.standins` is imported by a `.pth` hook in every
Python process of the environment, so nothing heavy (torch, sglang) may be imported here.
"""

__version__ = "0.1.0"
