"""`GET /v1/kvc/stats`: pool, prefix-cache, compression and request counters of the live server.

The numbers come from the scheduler process(es), through SGLang's internal-state request (the
adapter adds an `sgl_kvc` entry to each scheduler's answer), never from the HTTP process. With
`--dp-size N` every data-parallel rank answers: the top level is their sum, `per_rank` each one.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse

STATS_KEY = "sgl_kvc"  # same key as sgl_kvc.adapter.hooks.STATS_KEY (kept import-free of it)
RANK_KEY = "dp_rank"  # each rank's snapshot names its data-parallel rank (adapter/hooks.py)

router = APIRouter()


def merge_stats(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Sum counters over data-parallel ranks; strings come from the first rank, peaks add up
    (they are per-rank peaks, so the sum is an upper bound of the global one)."""
    if len(per_rank) == 1:
        return per_rank[0]

    def merge(values: list[Any]) -> Any:
        first = values[0]
        if isinstance(first, dict):
            return {k: merge([v[k] for v in values]) for k in first}
        if isinstance(first, (int, float)) and not isinstance(first, bool):
            return sum(values)
        return first

    return merge(per_rank)


def stats_answer(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The `/v1/kvc/stats` answer from every data-parallel rank's snapshot: the sum over ranks
    at the top level (as one server answers), `dp_size`, and each rank's own snapshot under
    `per_rank`, ordered by rank (ranks answer in arrival order)."""
    ordered = sorted(per_rank, key=lambda s: s.get(RANK_KEY, 0))
    total = merge_stats([{k: v for k, v in s.items() if k != RANK_KEY} for s in ordered])
    return {**total, "dp_size": len(ordered), "per_rank": ordered}


@router.get("/v1/kvc/stats")
async def kvc_stats() -> JSONResponse:
    from sglang.srt.entrypoints.http_server import get_global_state

    states = await get_global_state().tokenizer_manager.get_internal_state()
    per_rank = [s[STATS_KEY] for s in states if STATS_KEY in s]
    if not per_rank:
        from sgl_kvc.server.errors import openai_error

        return openai_error(
            503, "sgl-kvc is not active in the scheduler", type_="service_unavailable"
        )
    answer = stats_answer(per_rank)
    if isinstance(answer.get("documents"), dict):
        from sgl_kvc.adapter.documents.chat_documents import rewritten

        # counted where chat requests are rendered, in this process
        answer["documents"]["history_rewritten"] = rewritten(get_global_state().tokenizer_manager)
    return JSONResponse(answer)


def mount(app: FastAPI) -> None:
    """Add sgl-kvc's routes and OpenAI-style error handling to SGLang's app (before it starts)."""
    from sgl_kvc.server import errors
    from sgl_kvc.server.body_guard import RequestBodyGuard

    app.include_router(router)
    errors.install(app)
    # Added last, so outermost: a rejected body never reaches SGLang's handlers.
    app.add_middleware(RequestBodyGuard)
