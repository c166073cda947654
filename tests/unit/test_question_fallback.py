"""A cut between chunks reads its prompt's question first (`--kv-chunk-window question`) only where
some of the prompt is left to read after the row and the row has room for it: a retracted request
read again in chunks past its prompt, or a full row, falls back to the chunk's own window
(`prefill.cut_question_slots` returns 0) instead of planning a forward of nothing, which raised and
aborted the request."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sgl_kvc.adapter.moments.prefill import cut_question_slots
from sgl_kvc.config import KvcConfig
from sgl_kvc.core.request_state import Budget, ReqKvState
from sgl_kvc.policies import get_policy

WINDOW, ROW = 8, 256


def _slots(prompt: int, read: int, row: int = ROW) -> int:
    config = KvcConfig(policy="snapkv", kv_budget=32, kv_window=WINDOW, kv_chunk_window="question")
    host = SimpleNamespace(config=config, store=SimpleNamespace(req_to_token=torch.zeros(2, row, dtype=torch.int32)))
    req = SimpleNamespace(rid="r", origin_input_ids=list(range(prompt)), output_ids=[], multimodal_inputs=None,
                          input_embeds=None, sampling_params=SimpleNamespace(custom_params=None))
    state = ReqKvState(policy=get_policy("snapkv"), budget=Budget(32))
    return cut_question_slots(host, req, state, read)


def test_a_question_is_read_first_where_some_of_the_prompt_is_left() -> None:
    # what admission reserved for the forward (`question_slots`), however little of it is left
    assert _slots(200, 100) >= WINDOW and _slots(200, 197) == _slots(200, 100)


def test_nothing_left_to_read_or_no_room_falls_back_to_the_chunks_window() -> None:
    assert _slots(200, 200) == 0  # the whole prompt read
    assert _slots(200, 230) == 0  # a retracted request read again past its prompt (its output)
    assert _slots(300, 100, row=100) == 0  # its row has no room for one token more
