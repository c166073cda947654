"""Compute kernels of sgl-kvc (the package `sgl_kvc.kernels`, docs/architecture.md "Where things
are"): plain torch references first, Triton / FlashInfer versions where a GPU is present. Nothing
here imports SGLang."""
