"""Scheduler hooks, through SGLang's `HookRegistry` (applied by `load_plugins()`)."""

from __future__ import annotations

from typing import Any

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sgl_kvc.adapter.runtime import KvcRuntime, collect_stats
from sgl_kvc.config import KvcConfig

_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_INTERNAL_STATE = (
    "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController"
)
STATS_KEY = "sgl_kvc"


def register(config: KvcConfig) -> None:
    def after_next_batch(plan: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        KvcRuntime.of(scheduler, config).observe_plan(plan)
        return plan

    def after_internal_state(result: Any, controller: Any, *args: Any, **kwargs: Any) -> Any:
        scheduler = controller.scheduler
        result.internal_state[STATS_KEY] = collect_stats(scheduler, KvcRuntime.of(scheduler, config))
        return result

    HookRegistry.register(f"{_SCHEDULER}.get_next_batch_to_run", after_next_batch, HookType.AFTER)
    HookRegistry.register(
        f"{_INTERNAL_STATE}.get_internal_state", after_internal_state, HookType.AFTER
    )
