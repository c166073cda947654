"""What a compressing request holds at most (`sgl_kvc/footprint.py`), under each set of moments:
the one function admission, the running requests' reservations and the chunk moment all use."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sgl_kvc.config import KvcConfig
from sgl_kvc.footprint import Moments, Now, Sizes, compaction_copies, most_held

B, BUF = 128, 128
SIZES = Sizes(budget=B, buffer=BUF, keep=B)
ALL = Moments(prefill=True, between_chunks=True, generation=True)


def held(moments: Moments, prompt: int, out: int, sizes: Sizes = SIZES, cached: int = 0) -> int:
    """What admission reserves: most held beyond the cached prefix."""
    now = Now(held=cached, tree=cached, prompt_left=prompt - cached, out_left=out)
    return most_held(moments, sizes, now) - cached


@pytest.mark.parametrize(("compress_on", "moments"), [
    ("prefill,chunk,decode,preempt", Moments(True, True, True)),
    ("prefill", Moments(True, False, False)),
    ("decode", Moments(False, False, True)),
    ("preempt", Moments(False, False, True)),
    ("prefill,chunk-always", Moments(True, True, False)),
    ("chunk,decode", Moments(False, True, True)),
])
def test_moments_of_a_server(compress_on: str, moments: Moments) -> None:
    assert Moments.of(KvcConfig(policy="rkv", compress_on=tuple(compress_on.split(",")))) == moments


def test_with_decode_compression_a_short_prompt_holds_budget_plus_buffer() -> None:
    # 60 prompt tokens stay the tree's until the first decode pass, at budget + buffer, which
    # then owns more than it keeps: no copies.
    assert held(ALL, 60, 400) == B + BUF + 1
    assert held(ALL, 60, 50) == 110  # never reaches the trigger


def test_without_a_generation_moment_a_request_holds_budget_plus_max_tokens() -> None:
    prefill_only = Moments(prefill=True, between_chunks=False, generation=False)
    assert held(prefill_only, 60, 400) == 60 + 400  # under the budget: never compressed
    assert held(prefill_only, 1000, 400) == max(1000 + B, B + 400)  # the pass after prefill copies B
    assert held(prefill_only, 1000, 2000) == B + 2000
    nothing = Moments(prefill=False, between_chunks=False, generation=False)
    assert held(nothing, 1000, 400) == 1400


def test_the_pass_after_prefill_copies_what_it_keeps_out_of_the_tree() -> None:
    """SGLang publishes the whole prompt to the radix tree after prefill: the first compaction
    needs `budget` fresh slots while the request still locks the prompt."""
    assert held(ALL, 1000, 10) == 1000 + B
    assert held(ALL, 1000, 10, cached=600) == 400 + B  # a cached prefix is held, not newly taken
    assert compaction_copies(1000, 1000, B) == B and compaction_copies(300, 0, B) == 0
    assert compaction_copies(200, 150, B) == B - 50


def test_without_the_radix_cache_a_compaction_copies_nothing() -> None:
    """With --disable-radix-cache SGLang publishes nothing: a request owns what it reads."""
    unpublished = Sizes(budget=B, buffer=BUF, keep=B, published=False)
    assert held(ALL, 1000, 10, unpublished) == 1000
    assert held(Moments(prefill=True, between_chunks=False, generation=False), 1000, 400, unpublished) == 1000


def test_decode_only_counts_the_copies_of_its_first_pass() -> None:
    """No pass after prefill: the first decode pass, at the prompt's length or budget + buffer,
    copies what it keeps of the prompt the tree holds."""
    decode_only = Moments(prefill=False, between_chunks=False, generation=True)
    assert held(decode_only, 1000, 10) == 1000 + B
    assert held(decode_only, 200, 400) == max(B + BUF + 1, B + 200)
    assert held(decode_only, 60, 400) == B + BUF + 1


@pytest.mark.parametrize("chunk", [256, 64])
def test_a_prompt_compressed_between_chunks_holds_a_chunk_beyond_what_it_keeps(chunk: int) -> None:
    sizes = Sizes(budget=64, buffer=32, keep=64, chunk=chunk)
    h = held(ALL, 16_000, 100, sizes)
    # its first pass between chunks: at most keep + chunk read, all the tree's, + keep copies
    assert h == 64 + chunk + 64
    assert held(ALL, 16_000, 100, sizes, cached=1000) == chunk + 64  # after a cached prefix
    # a prompt of one chunk is read whole, then compressed after prefill
    assert held(ALL, chunk, 10, sizes) == chunk + 64


def test_a_pass_between_chunks_may_keep_more_than_the_budget() -> None:
    """`--kv-chunk-keep 2`: the prompt holds a chunk beyond twice the budget between chunks."""
    sizes = Sizes(budget=64, buffer=32, keep=128, chunk=256)
    assert held(ALL, 16_000, 100, sizes) == 128 + 256 + 128
    assert held(ALL, 300, 10, sizes) == max(300 + 128, 64 + 300)  # a pass may come before its last chunk


def test_a_running_request_counts_what_it_may_still_take() -> None:
    sizes = SIZES
    # compressed after prefill, decoding: up to budget + buffer + 1
    assert most_held(ALL, sizes, Now(held=B + 10, tree=0, out_left=300, prefill_due=False)) == B + BUF + 1
    # its pass after prefill is still due (staged, or put off): the copies are still to come
    due = Now(held=1000, tree=1000, out_left=300, prefill_due=True)
    assert most_held(ALL, sizes, due) - 1000 == B
    no_decode = Moments(prefill=True, between_chunks=False, generation=False)
    assert most_held(no_decode, sizes, Now(held=B + 10, tree=0, out_left=300, prefill_due=False)) == B + 10 + 300


def test_the_running_reservation_adds_a_pending_compactions_copies_to_sglangs_estimate() -> None:
    from sgl_kvc.adapter import kvc_req
    from sgl_kvc.adapter.scheduling.admission import around_running_offset

    config = KvcConfig(policy="snapkv", kv_budget=B, kv_buffer=BUF)
    hook = around_running_offset(config)

    def req(held: int, tree: int, out: int, compressed: bool) -> SimpleNamespace:
        r = SimpleNamespace(
            origin_input_ids=[1] * 1000, output_ids=[1] * out, prefix_len=0,
            kv=SimpleNamespace(kv_committed_len=held, cache_protected_len=tree),
            sampling_params=SimpleNamespace(max_new_tokens=400, custom_params=None),
        )
        kvc_req.of(r).state = SimpleNamespace(compressed=compressed)
        return r

    def sglang(ratio: float):  # SGLang's estimate of the tokens a running request still writes
        return lambda adder, r: (r.sampling_params.max_new_tokens - len(r.output_ids)) * ratio

    # the pass after prefill is still due (staged, or put off): its B copies are reserved whatever
    # SGLang expects of the output; once compacted it grows back to budget + buffer at most
    pending = req(1001, 1000, 1, compressed=False)
    assert hook(sglang(0.1), None, pending) == hook(sglang(1.0), None, pending) == B + 1000 - 1001
    compacted = req(B + 10, 0, 100, compressed=True)
    assert hook(sglang(0.1), None, compacted) == pytest.approx(300 * 0.1)
    assert hook(sglang(1.0), None, compacted) == B + BUF + 1 - (B + 10)


def test_the_ratio_budget_is_read_at_the_length_a_request_may_reach() -> None:
    from sgl_kvc.adapter.scheduling.admission import sizes_of
    from sgl_kvc.request_settings import RequestCompression

    config = KvcConfig(policy="rkv", kv_budget_ratio=0.25, kv_buffer=128, kv_window=8)
    settings = RequestCompression().resolve(config)
    assert sizes_of(config, settings, 990, 10, None).budget == 250
    assert sizes_of(config, settings, 990, 3010, None).budget == 1000
    own = RequestCompression(budget=64).resolve(config)
    assert sizes_of(config, own, 990, 3010, None).budget == 64
    tiny = KvcConfig(policy="rkv", kv_budget_ratio=0.001, kv_buffer=128, kv_window=8)
    assert sizes_of(tiny, RequestCompression().resolve(tiny), 990, 10, None).budget == 8 + 1  # the window's floor


class _Req(SimpleNamespace):
    def finished(self) -> bool:
        return self.abort is not None

    def set_finish_with_abort(self, error_msg: str, status_code: int = 400) -> None:
        self.abort = (status_code, error_msg)


@pytest.mark.parametrize(("compress_on", "max_tokens", "truncate", "expected"), [
    ("prefill,decode,preempt", 5000, False, 5000),  # held at budget + buffer: only the context bounds it
    ("prefill", 500, False, 500),  # budget + 500 fits the pool of 1024
    ("prefill", 5000, False, None),  # budget + 5000 does not: a 400 that says so
    ("prefill", 5000, True, 1024 - B - 1),  # --allow-auto-truncate: cut to what fits, finish "length"
])
def test_a_request_that_cannot_fit_even_compressed_is_refused_or_cut_as_sglang_does(
    monkeypatch, compress_on: str, max_tokens: int, truncate: bool, expected: int | None
) -> None:
    from sgl_kvc.adapter.scheduling import admission

    monkeypatch.setattr(admission, "_allow_auto_truncate", lambda: truncate)
    config = KvcConfig(policy="snapkv", kv_budget=B, kv_buffer=BUF, compress_on=tuple(compress_on.split(",")))
    scheduler = SimpleNamespace(max_new_tokens_limit=None, model_config=SimpleNamespace(context_len=16384),
                                chunked_prefill_size=256, max_total_num_tokens=1024,
                                tree_cache=SimpleNamespace(disable=False))
    req = _Req(rid="r", origin_input_ids=[1] * 300, output_ids=[], abort=None,
               sampling_params=SimpleNamespace(max_new_tokens=max_tokens, min_new_tokens=0, custom_params=None))
    admission.around_max_new_tokens(config, lambda s: pytest.fail("no reconstruction"))(
        lambda *a: pytest.fail("SGLang's own cut"), scheduler, req)
    if expected is None:
        status, message = req.abort
        assert status == 400 and "cannot hold this request even compressed" in message
        assert "max_tokens of at most 895 fits" in message  # 1024 - budget - 1
    else:
        assert req.abort is None and req.sampling_params.max_new_tokens == expected


def test_a_reconstruction_forward_is_held_at_each_prompt_moment_whose_pass_reads_one() -> None:
    """KVzip's forward (`forward_slots`: one --kvzip-chunk of context + its instruction) holds its
    slots beside the request's own right after a chunk or the prompt is read, and frees them
    before the pass compacts: the peak is the larger of the forward and the copies."""
    r = 300
    with_r = Sizes(budget=B, buffer=BUF, keep=B, reconstruction=r)
    assert held(ALL, 1000, 10, with_r) == 1000 + r  # > 1000 + B, the copies
    assert held(ALL, 1000, 10, Sizes(budget=B, buffer=BUF, keep=B, reconstruction=50)) == 1000 + B
    assert held(ALL, 100, 10, with_r) == 100 + r  # a prompt under budget is still scored
    chunked = Sizes(budget=64, buffer=32, keep=64, chunk=256, reconstruction=r)
    assert held(ALL, 16_000, 100, chunked) == 64 + 256 + r  # the first pass between chunks
    # the prompt moments are over for a running request: nothing (admission drops it there)
    decoding = Now(held=B + 10, tree=0, out_left=300, prefill_due=False)
    assert most_held(ALL, with_r, decoding) == B + BUF + 1
    no_prefill = Moments(prefill=False, between_chunks=False, generation=True)
    assert held(no_prefill, 1000, 10, with_r) == 1000 + B  # no prompt moment: no forward (a decode pass copies)


def test_a_questions_forward_is_held_at_cuts_between_chunks_only() -> None:
    """The forward of a prompt's question (`question_slots`: --kv-window tokens) holds its slots
    beside the request's own at a cut between chunks, freed before the cut copies: the peak
    there is the larger of the two. The pass after prefill has read the question: none there."""
    q = 8
    assert held(ALL, 1000, 10, Sizes(budget=B, buffer=BUF, keep=B, question=q)) == 1000 + B
    assert held(ALL, 1000, 10, Sizes(budget=B, buffer=BUF, keep=B, question=2 * B)) == 1000 + B
    chunked = Sizes(budget=64, buffer=32, keep=64, chunk=256, question=q)
    assert held(ALL, 16_000, 100, chunked) == 64 + 256 + 64  # the first cut: its chunk, then its copies
    wide = Sizes(budget=64, buffer=32, keep=64, chunk=256, question=100)
    assert held(ALL, 16_000, 100, wide) == 64 + 256 + 100  # ... or a question longer than the copies
    assert Sizes(budget=64, buffer=32, keep=64, reconstruction=300, question=q).cut_forward == 300


def test_admission_counts_a_kvzip_requests_forward_and_the_400_names_kvzip_chunk(monkeypatch) -> None:
    from sgl_kvc.adapter.kvzip.limits import RESERVE_HEAD
    from sgl_kvc.adapter.scheduling import admission
    from sgl_kvc.request_settings import CUSTOM_PARAMS_KEY

    monkeypatch.setattr(admission, "_allow_auto_truncate", lambda: False)
    config = KvcConfig(policy="snapkv", kv_budget=B, kv_buffer=BUF, kvzip_chunk=2048)

    def req(prompt_policy: str) -> _Req:
        return _Req(rid="r", origin_input_ids=[1] * 900, output_ids=[], abort=None, prefix_len=0,
                    sampling_params=SimpleNamespace(max_new_tokens=10, min_new_tokens=0,
                                                    custom_params={CUSTOM_PARAMS_KEY: {"prompt_policy": prompt_policy}}))

    assert admission.admission_demand(req("kvzip"), config) == 900 + 900 + RESERVE_HEAD
    assert admission.admission_demand(req("snapkv"), config) == 900 + B
    scheduler = SimpleNamespace(max_new_tokens_limit=None, model_config=SimpleNamespace(context_len=16384),
                                chunked_prefill_size=256, max_total_num_tokens=1500,
                                tree_cache=SimpleNamespace(disable=False), tp_worker=SimpleNamespace(model_runner=None))
    # the model's positions leave the reconstruction room (`Reconstructor.refusal`, tested apart)
    refusal = SimpleNamespace(message=None)
    reconstructor = SimpleNamespace(refusal=lambda s, ids: refusal.message)
    hook = admission.around_max_new_tokens(config, lambda scheduler: reconstructor)
    kvzip = req("kvzip")
    hook(lambda *a: pytest.fail("SGLang's own cut"), scheduler, kvzip)
    status, message = kvzip.abort
    assert status == 400 and "--kvzip-chunk" in message
    snapkv = req("snapkv")
    hook(lambda *a: pytest.fail("SGLang's own cut"), scheduler, snapkv)
    assert snapkv.abort is None
    # where they do not, the refusal is the 400 (before any pool arithmetic)
    refusal.message = "prompt_policy 'kvzip' repeats the prompt's context after it"
    short = req("kvzip")
    hook(lambda *a: pytest.fail("SGLang's own cut"), scheduler, short)
    assert short.abort == (400, refusal.message)
