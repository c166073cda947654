"""The chunk moment's trigger (`adapter/scheduling/chunk_pressure.py`) on stand-ins for SGLang's scheduler:
a prompt is compressed before its next chunk exactly when the room SGLang's next prefill round
has (free + evictable - what the running requests, and those admitted beside the chunk, reserve)
cannot hold what that chunk takes: the chunk and the fresh slots of the pass after it
(`adapter/admission.chunk_need`, from `sgl_kvc/footprint.py`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sgl_kvc.adapter.scheduling.chunk_pressure import needs_compression, next_chunk_room
from sgl_kvc.config import KvcConfig
from sgl_kvc.request_settings import CUSTOM_PARAMS_KEY

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


def _chunked(prompt: int, max_new: int = 16) -> SimpleNamespace:
    """A prompt compressed between chunks of CHUNK, with what admission fixed for it."""
    from sgl_kvc.adapter import kvc_req
    from sgl_kvc.footprint import Sizes

    req = _req(prompt, max_new=max_new)
    req.sampling_params.custom_params = None
    kvc_req.of(req).sizes = Sizes(budget=KEEP, buffer=32, keep=KEEP, chunk=CHUNK)
    return req


@pytest.mark.parametrize("free, processed, prompt, compacted, due", [
    (1000, 512, 4096, False, False),  # a whole chunk and the copies of the pass after it fit
    (CHUNK + KEEP - 1, 512, 4096, False, True),  # one slot short of the next chunk and the copies
    (CHUNK + KEEP, 512, 4096, False, False),  # exactly enough
    (CHUNK, 512, 4096, True, False),  # compacted before: what it holds is its own, no copies
    (CHUNK - 1, 512, 4096, True, True),
    (96 + KEEP, 4000, 4096, False, False),  # the last 96 tokens, the copies of the pass after prefill
    (90 + KEEP, 4000, 4096, False, True),  # ... but not in 90
    (0, 4096, 4096, False, False),  # nothing left to read
])
def test_compressed_only_when_what_the_next_chunk_takes_does_not_fit(
    free: int, processed: int, prompt: int, compacted: bool, due: bool
) -> None:
    from sgl_kvc.adapter.scheduling.admission import chunk_need

    config = KvcConfig(policy="snapkv", kv_budget=KEEP, kv_buffer=32)
    req = _chunked(prompt, max_new=0)
    held = KEEP if compacted else processed
    need = chunk_need(req, config, held, processed, compacted)
    assert needs_compression(_scheduler(free, 0, []), req, need) is due


def test_running_requests_reservations_count() -> None:
    """A decoding request's reserved output takes room the chunk would have had."""
    busy = [_req(10, max_new=200, ignore_eos=True)]
    need = CHUNK + KEEP
    assert not needs_compression(_scheduler(400, 0, []), _req(4096), need)
    assert needs_compression(_scheduler(400, 0, busy), _req(4096), need)


def test_requests_admitted_beside_the_chunk_count() -> None:
    """The extend batch that just ran: its other requests are not running yet, but their
    reservations take the next round's room too; the chunked request's own does not."""
    chunked = _req(4096)
    new = _req(10, max_new=200, ignore_eos=True)
    new.finished = lambda: False
    chunked.finished = lambda: False
    batch = SimpleNamespace(reqs=[chunked, new], chunked_req=chunked)
    assert next_chunk_room(_scheduler(400, 0, []), batch) == 400 - 200
    assert next_chunk_room(_scheduler(400, 0, [new]), batch) == 400 - 200  # counted once


def test_a_pass_between_chunks_may_keep_a_multiple_of_the_budget() -> None:
    """`--kv-chunk-keep`: what a pass between chunks keeps (the pass after the last chunk cuts to
    the budget), and what admission counts a request compressed between chunks to hold."""
    from sgl_kvc.adapter.scheduling.admission import sizes_of
    from sgl_kvc.request_settings import RequestCompression

    config = KvcConfig(policy="snapkv", kv_budget=256, kv_buffer=128, kv_chunk_keep=2.0)
    assert config.chunk_target(256) == 512 and KvcConfig(policy="snapkv").chunk_target(256) == 256
    sizes = sizes_of(config, RequestCompression().resolve(config), 4000, 16, 1024)
    assert (sizes.budget, sizes.keep, sizes.chunk) == (256, 512, 1024)
    for bad in (0.5, True, "2"):
        with pytest.raises(ValueError, match="--kv-chunk-keep"):
            KvcConfig(policy="snapkv", kv_chunk_keep=bad)


def test_the_tokenized_input_is_read_and_never_written() -> None:
    """SGLang's `TokenizedGenerateReqInput` (a msgspec Struct, no room for another attribute),
    read before its `Req` exists (`chunk_compressible`, the long-prompt hook): its settings are
    read from it and nothing of sgl-kvc's is attached (`kvc_req.peek`). Attaching raised inside
    SGLang's scheduler and took every server down."""
    import inspect
    from array import array

    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sgl_kvc.adapter import kvc_req
    from sgl_kvc.adapter.scheduling.requests import chunk_compressible

    fields = {name: None for name, p in inspect.signature(TokenizedGenerateReqInput).parameters.items()
              if p.default is inspect.Parameter.empty}
    fields.update(input_ids=array("q", range(5000)), return_logprob=False, logprob_start_len=-1,
                  top_logprobs_num=0, stream=False,
                  sampling_params=SamplingParams(max_new_tokens=8, custom_params={CUSTOM_PARAMS_KEY: {"budget": 64}}))
    tokenized = TokenizedGenerateReqInput(**fields)
    assert chunk_compressible(tokenized, KvcConfig(policy="snapkv"))
    assert kvc_req.peek(tokenized) is None
