"""Decode steps from SGLang's CUDA graphs (`--kv-decode-graphs on`).

SGLang captures one decode graph per batch size when its model runner starts, and replays the
graph of a batch's (padded) size before every decode forward whose batch it can run. sgl-kvc's
part of a decode forward reads only buffers (`core/graph_step.py`), so the graph replays it;
two things must hold around SGLang's capture and replay, which these hooks give:

| target (sglang 0.5.23)                 | kind   | what for |
| -------------------------------------- | ------ | -------- |
| ModelRunner.init_cuda_graphs           | before | the compressor, its store on the attention backend and the store's graph buffers exist before SGLang captures (the observation ring for every row, the packed rows' layout) |
| DecodeCudaGraphRunner.can_run_graph    | around | a step the store planned eagerly (a request whose policy keeps statistics, a row whose packed table the layout could not hold) runs SGLang's eager forward |

On a CPU SGLang captures nothing and every step runs the same graph step eagerly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from sgl_kvc.adapter.runtime import compressor_of
from sgl_kvc.adapter.sglang_api import Hook
from sgl_kvc.config import KvcConfig
from sgl_kvc.core.graph_step import GraphStep

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
_GRAPH_RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"


def hook_table(config: KvcConfig) -> list[Hook]:
    if not config.decode_graphs:
        return []
    return [
        Hook(f"{_RUNNER}.init_cuda_graphs", _before_capture(config), "BEFORE", (),
             "the store and its graph buffers before SGLang captures"),
        Hook(f"{_GRAPH_RUNNER}.can_run_graph", _around_can_run(config), "AROUND", ("forward_batch",),
             "a step planned eagerly runs eagerly"),
    ]


def _before_capture(config: KvcConfig) -> Callable[..., None]:
    def hook(model_runner: ModelRunner, *args: Any, **kwargs: Any) -> None:
        if not model_runner.is_draft_worker:
            compressor_of(model_runner, config)  # enables the store's graph steps (`Compressor`)

    return hook


def _around_can_run(config: KvcConfig) -> Callable[..., Any]:
    def hook(original: Callable[..., Any], runner: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> bool:
        if not original(runner, forward_batch, *args, **kwargs):
            return False
        compressor = compressor_of(runner.model_runner, config)
        if compressor is None:
            return True
        replays = isinstance(compressor.store.decode_step, GraphStep)
        compressor.store.graphs.replays += replays
        return replays

    return hook
