"""Compute kernels of sgl-kvc (installed as `sgl_kvc.kernels`): plain torch references first,
Triton / FlashInfer versions where a GPU is present. Nothing here imports SGLang."""
