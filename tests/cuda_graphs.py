"""Capturing a step in a CUDA graph, as SGLang's graph runner does (the GPU tests of `tests/core`)."""

from __future__ import annotations

from typing import Callable

import torch


def capture(forward: Callable[[], None]) -> "torch.cuda.CUDAGraph":
    """`forward` run once off the capturing stream (its kernels compile there), then captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    return graph
