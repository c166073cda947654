"""A request that starts from a shared document, in process: SGLang's own `Req` begun by the
compressor (`request_life.begin`) on stand-ins for the pools, and a document's metadata held
within the bytes the KV memory reserves for it in sgl-kvc's prefix cache (SGLang's RadixCache)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fakes import FakeAllocator, LayeredKvPool
from sgl_kvc.adapter import documents
from sgl_kvc.adapter.documents import Compressed, DocumentKey, DocumentRegistry, RootDocument
from sgl_kvc.adapter.moments import compressor as compressor_module
from sgl_kvc.adapter.moments import request_life
from sgl_kvc.adapter.moments.prefill import prefill_target
from sgl_kvc.adapter.scheduling.admission import _with_document, sizes_of
from sgl_kvc.config import KvcConfig
from sgl_kvc.core.reconstruction import CarriedScores
from sgl_kvc.request_settings import CUSTOM_PARAMS_KEY
from sgl_kvc.adapter.kvc_req import resolved
from fakes import SegmentFreeRecorder

LAYERS, H_KV, D = 2, 2, 16
DOC, ENTRIES, SUFFIX = 120, 36, 12  # ENTRIES = ceil(0.3 x DOC)


def _sglang_req(prompt: list[int], settings: dict, max_new: int = 100):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(rid="r", origin_input_text="", origin_input_ids=prompt, vocab_size=2048,
               sampling_params=SamplingParams(max_new_tokens=max_new, custom_params={CUSTOM_PARAMS_KEY: settings}))


def _compressor(monkeypatch, config: KvcConfig):
    monkeypatch.setattr(compressor_module.ScoreReducer, "for_sglang_tp_group", classmethod(lambda cls: None))
    monkeypatch.setattr(compressor_module, "tp_rank", lambda: 0)
    pool = LayeredKvPool(256, LAYERS, H_KV, D, torch.Generator().manual_seed(0))
    r2t = torch.zeros(4, 256, dtype=torch.int32)
    runner = SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=r2t),
                             attn_backend=SimpleNamespace(kvc_store=None, kvc_attends=True), server_args=None)
    return compressor_module.Compressor(config, runner), FakeAllocator(256, pool)


def _document(key: DocumentKey, slots: torch.Tensor) -> RootDocument:
    g = torch.Generator().manual_seed(1)
    kept = torch.stack([torch.randperm(DOC, generator=g)[: key.entries].sort().values
                        for _ in range(LAYERS * H_KV)]).reshape(LAYERS, H_KV, key.entries)
    return RootDocument(key=key, node=SimpleNamespace(value=slots), kept_positions=kept, slots=key.entries)


@pytest.mark.parametrize("hit", [True, False], ids=["hit", "read-whole"])
def test_a_budget_ratio_applies_beyond_the_document(monkeypatch, hit: bool) -> None:
    """`--kv-budget-ratio 0.25` on a request whose prompt is a document of 120 tokens (kept at
    36 entries per head) and a question of 12. Started from the document, its budget is the
    document's 36 entries + its ratio of the tokens after the document (never below the window
    + 1): its pass after prefill keeps 36 + 5 of its 48 entries, and after 100 generated tokens
    36 + 28. Reading the document whole (its first request, which keeps its own copy), its
    120 + its ratio of the rest. Before, the ratio was of every token processed, the document's
    120 included: the hit's pass after prefill cut its 48 entries to 33, below the document's
    36, and the first request cut its own copy of the document to 33. Admission reserved more
    than either holds (its document's part + its ratio of the whole prompt and output)."""
    config = KvcConfig(policy="snapkv", prompt_policy="keydiff", kv_budget_ratio=0.25, kv_window=4)
    comp, allocator = _compressor(monkeypatch, config)
    settings = {"document": {"tokens": DOC, "ratio": 0.3}}
    req = _sglang_req(list(range(10, 10 + DOC + SUFFIX)), settings)
    tree = SimpleNamespace(documents=DocumentRegistry(), disable=False)
    documents.declare(req, config, tree)
    key = documents.plan_of(req).key
    assert key is not None and (key.tokens, key.entries) == (DOC, ENTRIES) and req.to_finish is None
    if hit:
        documents.started_from(req, _document(key, allocator.alloc(ENTRIES)))
    req.kv.req_pool_idx = 0
    request_life.begin(comp, req, tree)
    state = comp.state(req)
    floor = config.policy_params().recent_kept + 1
    held = ENTRIES + SUFFIX if hit else DOC + SUFFIX  # its row after prefill
    n_after = held + 100
    own = lambda tokens: max(floor, -(-tokens // 4))  # noqa: E731 - the ratio 0.25 of `tokens`, rounded up
    part = ENTRIES if hit else DOC
    assert state.effective_budget(held) == part + own(SUFFIX)
    # its pass after prefill cuts its own tokens, never into the document's part
    assert prefill_target(comp, state, held, state.effective_budget(held)) == part + own(SUFFIX) > part
    assert state.effective_budget(n_after) == part + own(SUFFIX + 100)
    assert state.effective_budget(n_after) > part + floor
    # what admission reserved for it covers what it holds at most
    reserved = _with_document(sizes_of(config, resolved(req, config), DOC + SUFFIX, 100, None), part, config)
    assert reserved.budget >= state.effective_budget(DOC + SUFFIX + 100)


def test_a_fixed_budget_still_applies_beyond_the_document(monkeypatch) -> None:
    config = KvcConfig(policy="snapkv", prompt_policy="keydiff", kv_budget=8, kv_window=4)
    comp, allocator = _compressor(monkeypatch, config)
    req = _sglang_req(list(range(10, 10 + DOC + SUFFIX)), {"document": {"tokens": DOC, "ratio": 0.3}})
    tree = SimpleNamespace(documents=DocumentRegistry(), disable=False)
    documents.declare(req, config, tree)
    doc = _document(documents.plan_of(req).key, allocator.alloc(ENTRIES))
    documents.started_from(req, doc)
    req.kv.req_pool_idx = 0
    request_life.begin(comp, req, tree)
    state = comp.state(req)
    assert state.effective_budget(ENTRIES + SUFFIX) == state.effective_budget(500) == ENTRIES + 8
    # its statistic (were its decode policy to keep one) starts at the document's end
    assert state.stats_since == DOC and state.offset == DOC - ENTRIES


# --- a document's metadata, within the KV memory's reservation ------------------------------------

def test_a_documents_metadata_is_int32_and_charged_per_pool_token() -> None:
    """A document keeps an int32 position per kept entry (a packed one, each head's entries only,
    and its lengths) and, compressed by KVzip, a float32 score: a uniform KVzip document of k slots
    holds exactly k x the bytes the KV memory reserves per pool token for documents (8 per layer
    and KV head: 720 B for SmolLM2, 3.1% of its 23,040 B of bf16 K and V per token), another
    policy's half, so documents filling the pool fit their reservation. The pool and every buffer
    still fit the memory. Before, positions were int64 and a packed document's positions and units
    were padded to its widest head (3x its slots on SmolLM2)."""
    from sgl_kvc.adapter.memory.kv_memory import Reservation, fit_pool

    smollm2 = dict(window=8, num_layers=30, q_heads=9, kv_heads=3, head_dim=64, q_bytes=2)
    cell = 30 * 3 * 64 * 2 * 2
    plain, reserved = Reservation.for_model(**smollm2), Reservation.for_model(**smollm2, documents=True)
    packed = Reservation.for_model(**smollm2, unit_tables=True, documents=True)
    assert (plain.per_document_token, reserved.per_document_token, packed.per_document_token) == (0, 720, 720)
    key = DocumentKey(digest="cd" * 32, tokens=1000, entries=300, policy="kvzip")
    positions = torch.randint(0, 1000, (30, 3, 300))  # what a pass gives: int64
    scores = CarriedScores(1000, list(torch.rand(30, 3, 300).unbind(0)))
    doc = Compressed.compact(key, None, positions, 300, carried=scores)
    assert doc.kept_positions.dtype == torch.int32 and torch.equal(doc.kept_positions.long(), positions)
    assert doc.metadata_bytes == 300 * reserved.per_document_token == documents.compact_bytes(positions.numel(), 90, False, True)
    unscored = Compressed.compact(key, None, positions, 300)
    assert unscored.metadata_bytes == doc.metadata_bytes // 2 == documents.compact_bytes(positions.numel(), 90, False)
    memory = 1 << 30
    fit = fit_pool(memory, cell, tokens=memory // cell, requests=64, r=reserved)
    assert fit.document_bytes == fit.tokens * 720 and fit.tokens * cell + fit.reserved_bytes <= memory
    assert fit.tokens < fit_pool(memory, cell, tokens=memory // cell, requests=64, r=plain).tokens


def test_a_packed_documents_tables_follow_from_its_positions_lengths_and_slots() -> None:
    """A packed document (variable head budgets) keeps each head's positions, unpadded, and its
    lengths: at most 4 bytes per (slot, layer, KV head) and one slot's share more. A request that
    starts from it gets the tables the document's packing made (`unit_moves`: its kept entries
    in (layer, head, column) order fill the units of its slots in turn), the same positions, and
    its lengths."""
    from sgl_kvc.core.moves import packed_slots, unit_moves
    from sgl_kvc.policies.per_head import HeadSelection

    g = torch.Generator().manual_seed(3)
    layers, heads, n = 3, 2, 40
    lengths = torch.randint(1, n, (layers, heads), generator=g)
    lengths[1, 0] = n  # one head keeps everything: K = 40, far more than G
    width = int(lengths.max())
    indices = torch.stack([torch.randperm(n, generator=g)[:width].sort().values
                           for _ in range(layers * heads)]).reshape(layers, heads, width)
    selection = HeadSelection(indices=indices, lengths=lengths, n=n)
    units = torch.randint(0, 1 << 16, (layers, heads, n), generator=g)  # the request's tables before
    dest = torch.randperm(500, generator=g)[: packed_slots(selection)]  # the document's slots
    moves = unit_moves(selection, units, dest)
    valid = selection.valid()
    positions = torch.randint(0, 200, (layers, heads, width), generator=g) * valid
    key = DocumentKey(digest="ef" * 32, tokens=200, entries=20, policy="kvzip")
    doc = Compressed.compact(key, SimpleNamespace(value=dest), positions, int(dest.numel()), lengths)
    assert doc.metadata_bytes == 4 * selection.total + 4 * layers * heads
    assert doc.metadata_bytes <= 4 * layers * heads * (doc.slots + 1) < 4 * layers * heads * width
    kept, table, lens = doc.tables()
    assert torch.equal(table.long(), moves.table) and torch.equal(kept.long(), positions)
    assert torch.equal(lens.long(), lengths)


def _tree_with_documents(count: int, slots: int = 30):
    """SGLang's RadixCache (sgl-kvc's) holding `count` uniform documents of `slots` slots each
    (2 layers x 2 KV heads: 16 bytes of metadata per slot), published one after the other."""
    import time

    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from sgl_kvc.adapter.documents import node_key
    from sgl_kvc.adapter.documents.radix_cache import KvcRadixCache

    allocator = SegmentFreeRecorder()
    tree = KvcRadixCache(CacheInitParams(disable=False, req_to_token_pool=None,
                                         token_to_kv_pool_allocator=allocator, page_size=1))
    docs = []
    for i in range(count):
        key = DocumentKey(digest=f"{i:02x}" * 32, tokens=100, entries=slots, policy="kvzip")
        node = tree.insert(InsertParams(key=node_key(key, slots), value=torch.arange(slots) + 100 * i)).last_device_node
        doc = Compressed.compact(key, node, torch.randint(0, 100, (LAYERS, H_KV, slots)), slots)
        tree.documents.add(doc)
        docs.append(doc)
        time.sleep(0.001)  # distinct access times: the LRU order is the publication order
    return tree, allocator, docs


def test_documents_are_evicted_to_keep_their_metadata_within_its_reservation() -> None:
    """A budget of 3 documents' metadata: a 4th is published after the least recently used
    unlocked document is evicted (its slots freed as SGLang's eviction frees a leaf's, its node
    gone from the tree and the registry); a locked document (a request starts from it) is never
    evicted for it; and a document that could not fit even with every unlocked one gone evicts
    nothing and is not published. Before, the metadata was reserved nowhere and grew with the
    documents tenants declared."""
    from sgl_kvc.adapter.safety import invariants

    tree, allocator, docs = _tree_with_documents(3)
    one = docs[0].metadata_bytes
    assert one == 4 * LAYERS * H_KV * 30
    tree.documents.metadata_budget = 3 * one
    assert tree.make_document_room(0) and allocator.freed == []
    lock = tree.lock(docs[0].node)  # the oldest is in use
    assert tree.make_document_room(one)
    assert allocator.freed == docs[1].node.value.tolist()  # the least recently used unlocked one
    assert tree.documents.get(docs[1].key) is None and tree.documents.get(docs[0].key) is docs[0]
    assert tree.documents.metadata_bytes + one <= 3 * one
    assert tree.documents.stats.evicted_for_metadata == 1 and tree.documents.stats.evictions == 1
    assert tree.evictable_size() == 30  # docs[2]; docs[0] is protected
    invariants.check_documents(tree)
    # docs[0] locked and docs[2]: room for at most 2 documents' metadata more, never 3
    assert not tree.make_document_room(3 * one)
    assert tree.documents.get(docs[2].key) is docs[2] and len(allocator.freed) == 30  # nothing evicted for it
    tree.unlock(lock)
    assert tree.make_document_room(3 * one) and tree.documents.snapshot()["resident"] == 0
    invariants.check_documents(tree)


def test_documents_metadata_over_its_reservation_is_a_violation() -> None:
    from sgl_kvc.adapter.safety import invariants

    tree, _, docs = _tree_with_documents(2)
    tree.documents.metadata_budget = docs[0].metadata_bytes
    with pytest.raises(invariants.InvariantViolation, match="reserved"):
        invariants.check_documents(tree)


def test_a_kvzip_documents_scores_are_what_a_request_starting_from_it_carries() -> None:
    """A KVzip document keeps its pass's scores of the entries it kept (uniform: [L, H_kv, k];
    packed: each head's entries only, in its tables' columns); a request that starts from it
    carries them (`Document.carried`), so its own pass repeats only its context after the
    document's end, as its publisher's does after its cut."""
    from sgl_kvc.core.moves import packed_slots, unit_moves
    from sgl_kvc.policies.per_head import HeadSelection

    key = DocumentKey(digest="ab" * 32, tokens=90, entries=12, policy="kvzip")
    positions = torch.randint(0, 90, (3, 2, 12))
    layers = [torch.rand(2, 12) for _ in range(3)]
    carried = Compressed.compact(key, None, positions, 12, carried=CarriedScores(86, layers)).carried()
    assert carried.end == 86 and carried.lengths is None
    assert all(torch.equal(a, b) for a, b in zip(carried.layers, layers))

    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 20, (3, 2), generator=g)
    width = int(lengths.max())
    indices = torch.stack([torch.randperm(20, generator=g)[:width].sort().values
                           for _ in range(6)]).reshape(3, 2, width)
    selection = HeadSelection(indices=indices, lengths=lengths, n=20)
    dest = torch.randperm(100, generator=g)[: packed_slots(selection)]
    unit_moves(selection, torch.randint(0, 1 << 10, (3, 2, 20), generator=g), dest)
    valid = selection.valid()
    wide = [torch.rand(2, width, generator=g) for _ in range(3)]
    doc = Compressed.compact(key, SimpleNamespace(value=dest), torch.randint(0, 90, (3, 2, width)) * valid,
                           int(dest.numel()), lengths, CarriedScores(86, wide, list(lengths.unbind(0))))
    assert doc.metadata_bytes == 8 * selection.total + 4 * 6
    carried = doc.carried()
    for layer in range(3):
        assert torch.equal(carried.lengths[layer], lengths[layer])
        for h in range(2):
            n = int(lengths[layer, h])
            assert torch.equal(carried.layers[layer][h, :n], wide[layer][h, :n])
