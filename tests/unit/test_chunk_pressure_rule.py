"""The chunk moment's trigger (`adapter/chunk_pressure.py`) on stand-ins for SGLang's scheduler:
a prompt is compressed before its next chunk exactly when the room SGLang's next prefill round
has (free + evictable - what the running requests reserve) cannot hold that chunk."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sgl_kvc.adapter.chunk_pressure import needs_compression, next_chunk_room

CHUNK = 256


def _req(prompt: int, max_new: int = 0, out: int = 0, ignore_eos: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        origin_input_ids=[1] * prompt, output_ids=[1] * out,
        sampling_params=SimpleNamespace(max_new_tokens=max_new, ignore_eos=ignore_eos),
    )


def _scheduler(free: int, evictable: int, running: list[SimpleNamespace], ratio: float = 0.5) -> SimpleNamespace:
    return SimpleNamespace(
        token_to_kv_pool_allocator=SimpleNamespace(available_size=lambda: free),
        tree_cache=SimpleNamespace(evictable_size=lambda: evictable),
        running_batch=SimpleNamespace(reqs=running), chunked_prefill_size=CHUNK,
        new_token_ratio_tracker=SimpleNamespace(current=ratio),
    )


def test_the_room_is_free_plus_evictable_minus_the_running_reservations() -> None:
    running = [_req(10, max_new=100, out=20), _req(10, max_new=40, ignore_eos=True)]
    # SGLang's reservation: (100 - 20) x 0.5 for the first, 40 x 1.0 (ignore_eos) for the second
    assert next_chunk_room(_scheduler(300, 50, running)) == 300 + 50 - 40 - 40
    assert next_chunk_room(_scheduler(300, 50, [])) == 350


KEEP = 64  # slots the compaction may copy the kept entries into


@pytest.mark.parametrize("free, processed, prompt, due", [
    (1000, 512, 4096, False),  # a whole chunk fits
    (CHUNK + KEEP - 1, 512, 4096, True),  # one slot short of the next chunk and the kept entries
    (CHUNK + KEEP, 512, 4096, False),  # exactly enough
    (96 + KEEP, 4000, 4096, False),  # the last 96 tokens fit
    (90 + KEEP, 4000, 4096, True),  # ... but not in 90
    (0, 4096, 4096, False),  # nothing left to read
])
def test_compressed_only_when_the_next_chunk_does_not_fit(free: int, processed: int, prompt: int, due: bool) -> None:
    assert needs_compression(_scheduler(free, 0, []), _req(prompt), processed, KEEP) is due


def test_running_requests_reservations_count() -> None:
    """A decoding request's reserved output takes room the chunk would have had."""
    busy = [_req(10, max_new=200, ignore_eos=True)]
    assert not needs_compression(_scheduler(400, 0, []), _req(4096), 512, KEEP)
    assert needs_compression(_scheduler(400, 0, busy), _req(4096), 512, KEEP)


def test_a_pass_between_chunks_may_keep_a_multiple_of_the_budget() -> None:
    """`--kv-chunk-keep`: what a pass between chunks keeps (the pass after the last chunk cuts to
    the budget), and what admission counts a request compressed between chunks to hold."""
    from sgl_kvc.config import KvcConfig
    from sgl_kvc.request_settings import peak_tokens as request_peak_tokens

    config = KvcConfig(policy="snapkv", kv_budget=256, kv_buffer=128, kv_chunk_keep=2.0)
    assert config.chunk_target(256) == 512 and KvcConfig(policy="snapkv").chunk_target(256) == 256
    req = SimpleNamespace(origin_input_ids=[1] * 4000, custom_params=None,
                          sampling_params=SimpleNamespace(max_new_tokens=16, custom_params=None))
    assert request_peak_tokens(config, req) == 256 + 128 + 1
    assert request_peak_tokens(config, req, between_chunks=True) == 512 + 1
    for bad in (0.5, True, "2"):
        with pytest.raises(ValueError, match="--kv-chunk-keep"):
            KvcConfig(policy="snapkv", kv_chunk_keep=bad)


def test_admission_reserves_the_budget_a_request_decodes_with() -> None:
    """One budget resolution: what admission reserves for a request is the budget its passes cut
    to at its longest (`--kv-budget-ratio`: that fraction of prompt + most new tokens, never
    below the window), and a request's own budget wins over the ratio."""
    from sgl_kvc.config import KvcConfig
    from sgl_kvc.request_settings import peak_tokens, resolved

    def req(custom=None):
        return SimpleNamespace(origin_input_ids=[1] * 990,
                               sampling_params=SimpleNamespace(max_new_tokens=10, custom_params=custom))

    config = KvcConfig(policy="rkv", kv_budget_ratio=0.25, kv_buffer=128, kv_window=8)
    r = req()
    assert peak_tokens(config, r) == resolved(r, config).budget.at(1000) + 128 + 1 == 250 + 129
    tiny = KvcConfig(policy="rkv", kv_budget_ratio=0.001, kv_buffer=128, kv_window=8)
    assert peak_tokens(tiny, req()) == 8 + 1 + 128 + 1  # the window's floor, as a pass keeps
    own = req({"sgl_kvc": {"budget": 64}})
    assert peak_tokens(config, own) == 64 + 128 + 1 and resolved(own, config).budget.ratio is None
