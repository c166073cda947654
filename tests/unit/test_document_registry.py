"""Shared documents without a server: the `kv_compression.document` field, a document's key, and
its node in sgl-kvc's prefix cache (SGLang's RadixCache with a registry): matched in place of the
request's tokens, locked and evicted like any node (LRU and LFU), and dropped from the registry when
evicted; which requests wait for another's publication, and for how long; and a document's first
chunk in SGLang's own `PrefillAdder`."""

from __future__ import annotations

import random
from array import array
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from sgl_kvc.adapter import kvc_req
from sgl_kvc.adapter import documents
from sgl_kvc.adapter.documents import (
    Document, DocumentKey, DocumentPlan, Extension, ExtensionRule, Kind, Role, RootDocument, Turn, node_key,
    request_key,
)
from sgl_kvc.adapter.documents.radix_cache import KvcRadixCache
from sgl_kvc.adapter.safety import invariants
from sgl_kvc.config import DEFAULT_TURN_WINDOW, KvcConfig
from sgl_kvc.request_settings import CUSTOM_PARAMS_KEY, DocumentSpec, RequestSettingError, parse_kv_compression
from fakes import SegmentFreeRecorder

KVZIP = KvcConfig(policy="snapkv", prompt_policy="kvzip")


def _declaring(req: SimpleNamespace, key: DocumentKey | None, role: Role = Role.WHOLE) -> SimpleNamespace:
    """`req`, declaring the document `key` (as `documents.declare` records it)."""
    kvc_req.of(req).plan = DocumentPlan(role=role, own=key, key=key, mode=role)
    return req


@pytest.mark.parametrize("document, field, words", [
    ({"ratio": 0.3}, "document.tokens", "is required"),
    ({"tokens": 0}, "document.tokens", "from 1 to"),
    ({"tokens": 10, "ratio": 1.0}, "document.ratio", "between 0 and 1"),
    ({"tokens": 10, "ratio": True}, "document.ratio", "a boolean"),
    ({"tokens": 10, "ratio": 0.3, "budget": 4}, "document.ratio", "not both"),
    ({"tokens": 10, "messages": 2}, "document.messages", "names chat messages"),
    ({"tokens": 10, "pages": 2}, "document.pages", "unknown field"),
    ([10], "document", "must be an object"),
])
def test_a_bad_document_names_its_field(document, field: str, words: str) -> None:
    with pytest.raises(RequestSettingError) as e:
        parse_kv_compression({"document": document}, field="kv_compression")
    assert e.value.param == f"kv_compression.{field}" and words in str(e.value)


def test_on_the_chat_route_a_document_is_named_by_messages() -> None:
    assert parse_kv_compression({"document": {}}, chat=True).document == DocumentSpec()
    assert parse_kv_compression({"document": {"messages": 2, "ratio": 0.2}}, chat=True).document.messages == 2
    with pytest.raises(RequestSettingError, match="not both"):
        parse_kv_compression({"document": {"messages": 2, "tokens": 9}}, chat=True)


def test_entries_from_a_ratio_or_a_budget() -> None:
    assert DocumentSpec(tokens=100).entries(floor=13) == 30  # the default ratio, 0.3
    assert DocumentSpec(tokens=100, ratio=0.05).entries(floor=13) == 13
    assert DocumentSpec(tokens=100, budget=40).entries(floor=13) == 40
    settings = parse_kv_compression({"document": {"tokens": 100, "budget": 40}})
    assert settings.to_custom_params() == {"document": {"tokens": 100, "budget": 40}}


def _req(prompt: list[int], extra_key: str | None = None, **kv) -> SimpleNamespace:
    custom = {CUSTOM_PARAMS_KEY: {"document": {"tokens": 100}, **kv}}
    return SimpleNamespace(origin_input_ids=prompt, extra_key=extra_key, cache_salt=None,
                           sampling_params=SimpleNamespace(custom_params=custom))


def test_a_documents_key_is_its_tokens_namespace_and_compression() -> None:
    doc = list(range(10, 110))
    a = request_key(_req(doc + [1, 2, 3]), KVZIP)
    assert (a.tokens, a.entries, a.policy) == (100, 30, "kvzip")
    assert request_key(_req(doc + [4, 5]), KVZIP) == a  # another question, the same document
    assert request_key(_req(doc + [4, 5], extra_key="lora-1"), KVZIP).digest != a.digest
    assert request_key(_req(doc[:-1] + [7, 4]), KVZIP).digest != a.digest
    assert request_key(_req(doc + [4], prompt_policy="keydiff"), KVZIP).digest != a.digest


@pytest.mark.parametrize("prompt, kv, words", [
    (list(range(100)), {}, "must end before the prompt does"),
    (list(range(120)), {"prompt_policy": "snapkv"}, "must need none"),
    (list(range(120)), {"selection": "shared"}, "per-head selection"),
    (list(range(120)), {"prompt_policy": "expected_attention"}, "must need none"),
])
def test_a_document_the_server_cannot_compress_is_refused(prompt, kv, words: str) -> None:
    with pytest.raises(RequestSettingError) as e:
        request_key(_req(prompt, **kv), KVZIP)
    assert words in str(e.value)


def _tree() -> tuple[KvcRadixCache, SegmentFreeRecorder]:
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    allocator = SegmentFreeRecorder()
    return KvcRadixCache(CacheInitParams(disable=False, req_to_token_pool=None,
                                         token_to_kv_pool_allocator=allocator, page_size=1)), allocator


def test_a_resident_document_is_matched_locked_and_evicted_like_a_node() -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    tree, allocator = _tree()
    key = DocumentKey(digest="ab" * 32, tokens=100, entries=30, policy="kvzip")
    slots = torch.arange(500, 530)
    node = tree.insert(InsertParams(key=node_key(key, 30), value=slots)).last_device_node
    doc = RootDocument(key=key, node=node, kept_positions=torch.randint(0, 100, (2, 1, 30)), slots=30)
    tree.documents.add(doc)
    invariants.check_documents(tree)
    assert tree.evictable_size() == 30 and tree.documents.snapshot()["resident"] == 1

    tokens = array("q", range(10, 115))
    req = _declaring(SimpleNamespace(), key)
    match = tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens, limit=104), req=req))
    assert match.device_prefix_len == 30 and match.last_device_node is node
    # SGLang's limit on the match (a compressing request's observation window: `len(key)` honours
    # it) inside the document: a compressed document cannot be read again in part, and its
    # request's budget applies beyond it: it starts from it, reading what is left
    for limit in (60, 100):
        assert tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens, limit=limit), req=req)).device_prefix_len == 30
        assert documents.plan_of(req).start is doc and documents.plan_of(req).key == key
    assert torch.equal(tree.path_device_indices(node), slots)
    # the same tokens without the declaration match nothing (the node's key is its own)
    assert tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens), req=SimpleNamespace())).device_prefix_len == 0
    # a prompt no longer than the document does not start from it
    short = RadixKey(array("q", range(10, 110)))
    assert tree.match_prefix(MatchPrefixParams(key=short, req=req)).device_prefix_len == 0

    lock = tree.lock(node)
    tree.evict(EvictParams(num_tokens=100))
    assert tree.documents.get(key) is doc_of(node) and allocator.freed == []  # locked: kept
    tree.unlock(lock)
    tree.evict(EvictParams(num_tokens=100))
    assert tree.documents.get(key) is None and allocator.freed == slots.tolist()
    assert tree.documents.stats.evictions == 1 and tree.evictable_size() == 0
    invariants.check_documents(tree)


def doc_of(node) -> Document:
    return getattr(node, documents.NODE_ATTR)


def test_a_registered_document_missing_from_the_tree_is_a_violation() -> None:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    tree, _ = _tree()
    key = DocumentKey(digest="cd" * 32, tokens=50, entries=20, policy="kvzip")
    node = tree.insert(InsertParams(key=node_key(key, 20), value=torch.arange(20))).last_device_node
    tree.documents.add(RootDocument(key=key, node=node, kept_positions=torch.zeros(1, 1, 20, dtype=torch.int64), slots=20))
    node.parent.children.clear()  # as if the tree lost it without telling the registry
    with pytest.raises(invariants.InvariantViolation, match="not in the tree"):
        invariants.check_documents(tree)


def test_a_document_on_a_server_without_sgl_kvcs_prefix_cache_is_a_400() -> None:
    aborted = []
    req = _req(list(range(10, 130)))
    req.finished = lambda: False
    req.set_finish_with_abort = lambda message, status_code: aborted.append((message, int(status_code)))
    documents.declare(req, KVZIP, tree_cache=SimpleNamespace())  # SGLang's own tree: no registry
    assert aborted and aborted[0][1] == 400 and "--disable-radix-cache" in aborted[0][0]
    tree, _ = _tree()
    aborted.clear()
    documents.declare(req, KVZIP, tree_cache=tree)
    assert not aborted and documents.plan_of(req).key.tokens == 100 and req.skip_radix_cache_insert


def test_a_request_compressing_its_document_between_chunks_stops_a_chunk_at_its_end() -> None:
    """Its chunks are cut to end at the document's end (D = 100), counted in prompt tokens read
    (its fill ids skip what a compaction dropped); its match in the tree stops one token short of
    D (so a chunk of its own ends there), unless the document is resident; a hit is not cut."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    prompt = list(range(10, 130))  # 120 tokens: a document of 100 and a question of 20
    tree, _ = _tree()
    req = _req(prompt)
    req.finished = lambda: False
    documents.declare(req, KVZIP, tree_cache=tree, split=True)
    req.output_ids, req.full_untruncated_fill_ids, req.prefix_len, req.extend_end = [], prompt, 0, 0
    assert documents.plan_of(req).splits and documents.plan_of(req).held_for_document == 30  # its budget beyond k, not D
    assert documents.chunk_cap(req) == 100
    # a first chunk of 64 compacted to 40 entries: SGLang resumes at 40, its fill ids skip 24
    req.prefix_len = req.extend_end = 40
    req.full_untruncated_fill_ids = prompt[24:]
    assert documents.chunk_cap(req) == 36 and documents.plan_of(req).ended_at(documents.chunk_end(req)) is None
    req.extend_end = 76  # its next chunk, cut at the document's end
    assert documents.plan_of(req).ended_at(documents.chunk_end(req)) == documents.plan_of(req).key

    # the tree holds the document's exact tokens (another request read them): matched up to D - 1
    tree.insert(InsertParams(key=RadixKey(array("q", prompt)), value=torch.arange(120)))
    match = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt)), req=req))
    assert match.device_prefix_len == 99
    whole = _declaring(SimpleNamespace(), documents.plan_of(req).key)  # reads it whole: no limit
    assert tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt)), req=whole)).device_prefix_len == 120

    key = documents.plan_of(req).key
    node = tree.insert(InsertParams(key=node_key(key, 30), value=torch.arange(200, 230))).last_device_node
    tree.documents.add(RootDocument(key=key, node=node, kept_positions=torch.zeros(1, 1, 30, dtype=torch.int64), slots=30))
    match = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt)), req=req))
    assert match.last_device_node is node  # resident: it starts from it
    documents.started_from(req, doc_of(node))
    assert not documents.plan_of(req).splits and documents.chunk_cap(req) is None and documents.plan_of(req).ended_at(documents.chunk_end(req)) is None
    assert documents.plan_of(req).held_for_document == 30 and documents.plan_of(req).fill_offset == 70


def test_concurrent_first_requests_wait_for_the_one_compressing_their_document() -> None:
    """Of the waiting requests declaring a document not resident, the first one admitted is
    registered as compressing it; the others wait while it runs (held back before a round, or
    passed over in the round that admitted it), and go once it published it, or once it finished
    or gave its row back without publishing. A request only queued holds no one back: it may not
    be admitted for a long time (before, the first in queue order held the others, admitted or
    not)."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    tree, _ = _tree()
    key = DocumentKey(digest="ef" * 32, tokens=100, entries=30, policy="kvzip")
    other = DocumentKey(digest="01" * 32, tokens=100, entries=30, policy="kvzip")

    def req(k: DocumentKey | None) -> SimpleNamespace:
        return _declaring(SimpleNamespace(output_ids=[], kv=SimpleNamespace(holds_kv=True), finished=lambda: False), k)

    a, b, c, plain = req(key), req(key), req(other), req(None)
    registry = tree.documents
    assert documents.held_back([plain, a, b, c], registry) == []  # a is only queued
    assert not documents.waits_in_round(b, [], registry)  # a was not admitted: b may be
    assert documents.waits_in_round(b, [plain, a], registry)  # a was: b waits for it
    assert not documents.waits_in_round(c, [plain, a], registry)
    documents.compressing([a, c], registry)  # admitted
    d = req(key)
    assert documents.held_back([b, d, c], registry) == [b, d]  # c is compressing its own
    a.kv.holds_kv = False  # a gave its row back without publishing: b and d may go
    assert documents.held_back([b, d], registry) == []
    assert documents.waits_in_round(d, [b], registry)  # b, admitted, compresses it
    documents.compressing([b], registry)
    registry.settle(key, b)  # b will not publish it after all
    assert documents.held_back([d], registry) == []
    documents.compressing([d], registry)
    node = tree.insert(InsertParams(key=node_key(key, 30), value=torch.arange(30))).last_device_node
    registry.add(RootDocument(key=key, node=node, kept_positions=torch.zeros(1, 1, 30, dtype=torch.int64), slots=30))
    assert documents.held_back([req(key), req(key)], registry) == []  # resident: every one starts from it
    assert not documents.waits_in_round(req(key), [req(key)], registry)
    assert key.digest not in registry.publishers


def test_no_request_waits_past_the_servers_bound() -> None:
    """A request waits for another's publication at most `--kv-document-wait` seconds in all,
    counted from when it first waited (behind one publisher or the next): then it waits no more
    for that document, whatever the publisher still reads, and reads it itself."""
    tree, _ = _tree()
    registry = tree.documents
    key = DocumentKey(digest="5e" * 32, tokens=100, entries=30, policy="kvzip")

    def req() -> SimpleNamespace:
        return _declaring(SimpleNamespace(output_ids=[], kv=SimpleNamespace(holds_kv=True), finished=lambda: False),
                          key)

    publisher, early, late = req(), req(), req()
    documents.compressing([publisher], registry)
    held = documents.held_back([early], registry)
    assert held == [early]
    t0 = kvc_req.of(early).wait_since
    assert documents.held_back([early, late], registry) == [early, late]
    assert kvc_req.of(early).wait_since == t0  # its wait is counted from its first
    kvc_req.of(late).wait_since = t0 + 4.0
    assert documents.overdue([early, late], 5.0, now=t0 + 4.9) == [False, False]
    late_flags = documents.overdue([early, late], 5.0, now=t0 + 5.0)
    assert late_flags == [True, False]
    assert documents.stop_waiting([early, late], late_flags, registry) == [late]
    assert registry.stats.waited_out == 1 and registry.snapshot()["waited_out"] == 1
    # it waits no more: neither before a round nor in one that admits another compressing it
    assert documents.held_back([early, late], registry) == [late]
    assert not documents.waits_in_round(early, [publisher], registry)
    assert documents.waits_in_round(late, [publisher], registry)


def test_no_client_extra_key_reaches_a_documents_node() -> None:
    """A client's node under the document namespace's very string (`extra_key` is any client's,
    the digest computable): the document's node is inserted beside it, not into it (before, the
    publication's insert split it and found a prefix: slots owned twice), and each matches only
    its own."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    tree, _ = _tree()
    key = DocumentKey(digest="9a" * 32, tokens=100, entries=30, policy="kvzip")
    planted = RadixKey(array("q", [0] * 8), extra_key=documents.NAMESPACE + key.digest)
    tree.insert(InsertParams(key=planted, value=torch.arange(900, 908)))
    result = tree.insert(InsertParams(key=node_key(key, 30), value=torch.arange(500, 530)))
    assert result.prefix_len == 0 and len(result.last_device_node.value) == 30
    assert tree.evictable_size() == 38
    client = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", [0] * 40), extra_key=planted.extra_key)))
    assert client.device_prefix_len == 8
    assert tree.match_prefix(MatchPrefixParams(key=node_key(key, 30))).device_prefix_len == 30
    assert node_key(key, 30).extra_key != planted.extra_key and planted.extra_key != node_key(key, 30).extra_key


def test_a_request_asking_for_prompt_logprobs_never_starts_from_a_document() -> None:
    """Prompt log-probabilities (SGLang's `logprob_start_len` within the prompt) on a resident
    document: the request matches its tokens, not the node (SGLang would count them from the
    node's k slots; its assert took the server down), and waits for no publisher."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    tree, _ = _tree()
    prompt = list(range(10, 130))
    key = DocumentKey(digest="7b" * 32, tokens=100, entries=30, policy="kvzip")
    node = tree.insert(InsertParams(key=node_key(key, 30), value=torch.arange(30))).last_device_node
    tree.documents.add(RootDocument(key=key, node=node, kept_positions=torch.zeros(1, 1, 30, dtype=torch.int64), slots=30))

    def req(return_logprob: bool, start: int) -> SimpleNamespace:
        return _declaring(SimpleNamespace(origin_input_ids=prompt, return_logprob=return_logprob,
                                          logprob_start_len=start), key)

    for start in (0, 99, 100, 119):  # before, at and after the document's end
        limited = RadixKey(array("q", prompt), limit=start)  # SGLang's cap for them
        match = tree.match_prefix(MatchPrefixParams(key=limited, req=req(True, start)))
        assert match.last_device_node is not node and match.device_prefix_len == 0, start
    for r in (req(True, 120), req(True, -1), req(False, 0)):  # output log-probabilities only
        assert tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt)), req=r)).last_device_node is node
    waiting = SimpleNamespace(**vars(req(True, 0)), output_ids=[])
    del tree.documents.by_key[key.digest]  # not resident: another request compresses it
    tree.documents.publishers[key.digest] = SimpleNamespace(finished=lambda: False, kv=SimpleNamespace(holds_kv=True))
    assert documents.held_back([waiting], tree.documents) == []


def test_publishers_that_ended_without_publishing_are_forgotten() -> None:
    """The registry holds a request compressing a document only while it is in flight: one that
    finished, failed or was retracted before publishing is dropped at the next prefill round, even
    if no request declares its (unique) document again."""
    registry = documents.DocumentRegistry()

    def publisher(i: int) -> tuple[DocumentKey, SimpleNamespace]:
        key = DocumentKey(digest=f"{i:064x}", tokens=100, entries=30, policy="kvzip")
        req = _declaring(SimpleNamespace(output_ids=[], kv=SimpleNamespace(holds_kv=True), finished=lambda: False), key)
        return key, req

    reqs = [publisher(i)[1] for i in range(100)]
    documents.compressing(reqs, registry)
    assert len(registry.publishers) == 100
    for i, r in enumerate(reqs[:99]):  # finished (aborted or not) or retracted: its row given back
        if i % 2:
            r.finished = lambda: True
        r.kv.holds_kv = False
    documents.compressing([], registry)  # the next prefill round
    assert list(registry.publishers.values()) == [reqs[99]]


def test_a_document_hit_is_a_use_for_lfu_eviction() -> None:
    """`--radix-eviction-policy lfu` (SGLang's `hit_count`): a document many requests started from
    outlives one published later that none did; a request matched again (it waits in the queue,
    matched in every round) counts once. Before, a hit set only the LRU's access time, every
    document kept the count of its publication (1), and LFU evicted the older, used one."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    allocator = SegmentFreeRecorder()
    tree = KvcRadixCache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator,
                                         page_size=1, eviction_policy="lfu"))

    def publish(digest: str, slots: torch.Tensor) -> DocumentKey:
        key = DocumentKey(digest=digest * 32, tokens=100, entries=30, policy="kvzip")
        node = tree.insert(InsertParams(key=node_key(key, 30), value=slots)).last_device_node
        tree.documents.add(RootDocument(key=key, node=node, kept_positions=torch.zeros(1, 1, 30, dtype=torch.int64),
                                    slots=30))
        return key

    used = publish("a1", torch.arange(100, 130))
    prompt = RadixKey(array("q", range(10, 115)))
    for _ in range(2):
        req = _declaring(SimpleNamespace(), used)
        for _ in range(3):  # matched in three rounds before it is admitted: one use
            assert tree.match_prefix(MatchPrefixParams(key=prompt, req=req)).device_prefix_len == 30
    assert tree.documents.get(used).node.hit_count == 3  # its publication and two requests
    fresh = publish("b2", torch.arange(200, 230))  # newer, never used
    tree.evict(EvictParams(num_tokens=30))
    assert allocator.freed == list(range(200, 230))
    assert tree.documents.get(fresh) is None and tree.documents.get(used) is not None


class _RealAdder:
    """SGLang's own `PrefillAdder` over its token allocator, a KV pool and sgl-kvc's tree, on the
    CPU, with sgl-kvc's admission hooks applied as the plugin applies them."""

    def __init__(self, monkeypatch, config: KvcConfig, chunk: int) -> None:
        from sglang.srt.managers.schedule_policy import PrefillAdder
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        from sgl_kvc.adapter.scheduling import admission

        self.config = config
        pool = MHATokenToKVPool(4000, page_size=1, dtype=torch.float32, head_num=1, head_dim=4, v_head_dim=4,
                                layer_num=1, device="cpu", enable_memory_saver=False, start_layer=0, end_layer=0,
                                enable_alt_stream=False, enable_kv_cache_copy=False)
        self.allocator = TokenToKVPoolAllocator(4000, dtype=torch.float32, device="cpu", kvcache=pool, need_sort=False)
        self.tree = KvcRadixCache(CacheInitParams(disable=False, req_to_token_pool=None,
                                                  token_to_kv_pool_allocator=self.allocator, page_size=1))
        budget = admission.around_check_prefill_budget(config)
        original = PrefillAdder._check_prefill_budget
        monkeypatch.setattr(PrefillAdder, "_check_prefill_budget",
                            lambda adder, req, **kw: budget(original, adder, req, **kw))
        self._add = admission.around_add_one_req(config)
        self.adder = PrefillAdder(1, self.tree, self.allocator, SimpleNamespace(reqs=[], batch_size=lambda: 0),
                                  0.5, 8192, chunk)

    def req(self, rid: str, prompt: list[int], document: int | None, split: bool):
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        from sgl_kvc.adapter.scheduling import admission

        kv = {"prompt_policy": "kvzip"}
        if document is not None:
            kv["document"] = {"tokens": document, "ratio": 0.3}
        req = Req(rid=rid, origin_input_text="", origin_input_ids=array("q", prompt), vocab_size=4000,
                  sampling_params=SamplingParams(max_new_tokens=4, custom_params={CUSTOM_PARAMS_KEY: kv}))
        req.finished = lambda: False
        scheduler = SimpleNamespace(chunked_prefill_size=self.adder.rem_chunk_tokens if split else None,
                                    tree_cache=self.tree)
        documents.declare(req, self.config, self.tree, split=split)
        admission.remember(req, self.config, scheduler)  # as `_add_request_to_queue` does
        req.init_next_round_input(self.tree)
        return req

    def add(self, req, align: int | None = None):
        from sglang.srt.managers.schedule_policy import PrefillAdder

        return self._add(PrefillAdder.add_one_req, self.adder, req, has_chunked_req=False,
                         truncation_align_size=align)


@pytest.fixture
def sglang_config():
    from sglang.srt.runtime_context import get_context

    override = get_context().override_server_args(device="cpu")
    override.install()
    yield
    override.restore()


def test_a_waiter_is_held_only_behind_an_admitted_publisher(monkeypatch, sglang_config) -> None:
    """SGLang's prefill round, with its own classes. The first request of a document in arrival
    order (`big`, its whole prompt of 3500 tokens read at once: no room for it now) holds no one
    back before the round: SGLang orders the round by its own policy after sgl-kvc's hold (client
    priorities, longest prefix; here `small` and `again` come first), and may never admit it.
    Before, it held every later request of its document whether it was admitted or not. In the
    round, the first request of the document SGLang admits compresses it; the others of the
    document wait for it, and the round goes on with the requests behind them."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    real = _RealAdder(monkeypatch, KVZIP, chunk=1024)
    doc = list(range(10, 110))
    big = real.req("big", doc + list(range(500, 3900)), 100, split=False)
    small = real.req("small", doc + [7, 8, 9], 100, split=False)
    again = real.req("again", doc + [4, 5, 6], 100, split=False)
    plain = real.req("plain", list(range(300, 340)), None, split=False)
    registry = real.tree.documents
    assert documents.held_back([big, small, again, plain], registry) == []  # none of them is admitted yet
    # the round, in SGLang's order
    assert real.add(small) == AddReqResult.CONTINUE and real.adder.can_run_list == [small]
    assert real.add(again) == AddReqResult.CONTINUE and real.adder.can_run_list == [small]  # waits for small
    assert real.add(plain) == AddReqResult.CONTINUE and real.adder.can_run_list == [small, plain]
    assert real.add(big) == AddReqResult.CONTINUE and real.adder.can_run_list == [small, plain]  # waits too
    for r in real.adder.can_run_list:  # its row, as SGLang's `prepare_for_extend` gives it
        r.kv.req_pool_idx = 1
    documents.compressing(real.adder.can_run_list, registry)
    assert documents.held_back([big, again], registry) == [big, again]  # small is in flight
    alone = _RealAdder(monkeypatch, KVZIP, chunk=1024)
    assert alone.add(alone.req("big", doc + list(range(500, 3900)), 100, split=False)) == AddReqResult.NO_TOKEN


def test_a_chunk_capped_at_a_documents_end_is_never_aligned_to_nothing(monkeypatch, sglang_config) -> None:
    """SGLang aligns a cut chunk down to `truncation_align_size` (deterministic inference on
    FlashInfer: 4096). A request compressing its document between chunks cuts its first chunk at
    the document's end (100 tokens here): aligned, that chunk was empty in every round, the request
    never admitted, and every request behind it waited forever. It is admitted, its chunk ending
    at the document's end; a request without a document is aligned as SGLang aligns it."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    real = _RealAdder(monkeypatch, KVZIP, chunk=8192)
    doc = list(range(10, 110))
    req = real.req("doc", doc + list(range(600, 900)), 100, split=True)
    assert documents.chunk_cap(req) == 100
    assert real.add(req, align=4096) == AddReqResult.CONTINUE
    assert real.adder.can_run_list == [req] and real.adder.new_chunked_req is req and req.extend_end == 100

    other = _RealAdder(monkeypatch, KvcConfig(policy="snapkv", prompt_policy="kvzip"), chunk=1024)
    long = other.req("long", list(range(10, 3010)), None, split=True)
    assert other.add(long, align=4096) == AddReqResult.OTHER and other.adder.can_run_list == []


def test_where_a_document_is_cut_is_decided_by_its_key() -> None:
    """What a document keeps depends on its key alone: on a server that cuts prompts between
    chunks of C = 256, a document of 600 tokens is cut at 256 and 512 to `between` entries (the
    chunk target of its k), then at 600 to k, and nowhere else; its chunks end there, and its
    match in the tree stops before the first cut, wherever SGLang's rounds would end them and
    whatever the request's own budget. A document of one chunk at most is cut at its end only, and
    a request there that reads its prompt whole (prompt log-probabilities) never publishes one."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    config = KvcConfig(policy="snapkv", prompt_policy="kvzip", kv_chunk_keep=1.5)
    prompt = list(range(10, 710))
    tree, _ = _tree()

    def req(document: int, split: bool = True, **kv) -> SimpleNamespace:
        r = _req(prompt, **kv)
        r.sampling_params.custom_params[CUSTOM_PARAMS_KEY]["document"] = {"tokens": document, "ratio": 0.1}
        r.finished, r.output_ids, r.full_untruncated_fill_ids, r.prefix_len, r.extend_end = \
            (lambda: False), [], prompt, 0, 0
        documents.declare(r, config, tree, split=split, chunk=256)
        return r

    long = req(600)
    key = documents.plan_of(long).key
    assert (key.entries, key.every, key.between) == (60, 256, 90)
    assert documents.plan_of(req(600, budget=8)).key == key  # the request's own budget is no part of it
    assert request_key(long, config).digest != key.digest  # cut at 256 and 512: not the document read at once
    assert documents.chunk_cap(long) == 256 and documents.plan_of(long).match_limit == 255
    long.prefix_len = 100  # its first 100 tokens were matched in the tree
    assert documents.chunk_cap(long) == 156  # its first chunk still ends at 256
    assert [documents.plan_of(long).cut_at(end) for end in (200, 256, 300, 512, 599, 600, 601)] == [0, 90, 0, 90, 0, 60, None]
    long.prefix_len = long.extend_end = 90  # cut at 256 to 90 entries: its fill ids skip 166
    long.full_untruncated_fill_ids = prompt[166:]
    assert documents.chunk_cap(long) == 256 and documents.plan_of(long).cut_inside(documents.chunk_end(long)) == 90
    tree.insert(InsertParams(key=RadixKey(array("q", prompt)), value=torch.arange(700)))
    fresh = req(600)
    assert tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt)), req=fresh)).device_prefix_len == 255

    short = req(200)
    assert documents.plan_of(short).key.every == 0 and documents.plan_of(short).match_limit == 199
    assert [documents.plan_of(short).cut_at(end) for end in (100, 200)] == [0, 20]
    whole = req(200, split=False)  # reads its prompt whole: never registered as compressing it
    assert not documents.plan_of(whole).publishes_whole and not documents.plan_of(short).publishes_whole  # short: between chunks
    documents.compressing([whole], tree.documents)
    assert tree.documents.publishers == {}


def test_extension_entries_from_a_ratio_or_what_is_left_of_a_budget() -> None:
    """A ratio is of the chain's tokens, and an extension keeps all of its own while the chain then
    holds at most `window` entries beyond it; a budget is of the chain, the turn kept whole if it fits."""
    ratio = ExtensionRule(ratio=0.3, budget=None, floor=13, limit=None, window=40)
    # a chain over 100 tokens keeping 30: 20 more fit (50 <= ceil(0.3 * 120) + 40), 60 do not (90 > 48 + 40)
    assert ratio.entries(30, 100, 20) == 20 and ratio.entries(30, 100, 58) == 58
    assert ratio.entries(30, 100, 60) is None and ratio.rebuild(30, 100, 60) == 48
    assert ratio.rebuild(30, 100, 20) is None  # extended: no rebuild
    never = ExtensionRule(ratio=0.3, budget=None, floor=13, limit=None, window=0)
    assert never.entries(30, 100, 8) is None and never.rebuild(30, 100, 8) == 33  # every turn ranked with its chain
    assert never.rebuild(14, 20, 3) == 13  # never below the floor
    assert ExtensionRule(ratio=0.3, budget=None, floor=13, limit=None).window == DEFAULT_TURN_WINDOW
    budget = ExtensionRule(ratio=None, budget=60, floor=13, limit=None)
    assert budget.entries(30, 100, 100) == 30 and budget.entries(50, 100, 100) is None  # at its budget: not extended
    assert budget.entries(55, 100, 4) == 4 and budget.entries(55, 100, 8) is None  # a short turn whole, if it fits
    assert ExtensionRule(ratio=0.3, budget=None, floor=13, limit=64).entries(30, 100, 65) is None  # over one chunk


@pytest.mark.parametrize("window", [0, 7, 40, 256])
def test_a_ratio_chain_never_holds_more_than_its_window_beyond_the_ratio(window: int) -> None:
    """Any sequence of turns: the chain's entries stay within `window` of what compressing every
    token it covers anew keeps, never more than its tokens, and every turn either extends (all its
    tokens kept) or compresses the chain again to that ratio."""
    rule = ExtensionRule(ratio=0.3, budget=None, floor=13, limit=None, window=window)
    rng = random.Random(window)
    tokens, entries = 400, 120
    for _ in range(200):
        turn = rng.randint(1, 120)
        own = rule.entries(entries, tokens, turn)
        if own is not None:
            assert own == turn and rule.rebuild(entries, tokens, turn) is None
            entries += own
        else:
            entries = rule.rebuild(entries, tokens, turn)
            assert entries == rule.target(tokens + turn)
        tokens += turn
        assert entries <= min(tokens, rule.target(tokens) + window)


def _declaring_own(prompt: list[int], tokens: int, extra_key: str | None = None, settings: str = "") -> SimpleNamespace:
    """A request declaring its prompt's first `tokens` as its document, on a server that extends
    (`settings`: its decode settings' digest, which a reply it starts from must share)."""

    req = _req(prompt, extra_key)
    req.sampling_params.custom_params[CUSTOM_PARAMS_KEY]["document"] = {"tokens": tokens}
    _declaring(req, request_key(req, KVZIP))
    kvc_req.of(req).rule = ExtensionRule(None, None, 13, None, settings=settings)
    return req


def test_a_document_that_extends_a_resident_one_is_matched_through_it_and_evicted_leaf_first() -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    tree, allocator = _tree()
    prompt = list(range(10, 200))
    root_key = request_key(_declaring_own(prompt, 100), KVZIP)
    slots = torch.arange(500, 530)
    root = tree.insert(InsertParams(key=node_key(root_key, 30), value=slots)).last_device_node
    tree.documents.add(RootDocument(key=root_key, node=root, kept_positions=torch.randint(0, 100, (2, 1, 30)), slots=30))

    def match(req) -> object:
        return tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", req.origin_input_ids)), req=req))

    turn = _declaring_own(prompt[:150], 140)
    m = match(turn)
    key = documents.plan_of(turn).key
    assert m.last_device_node is root and m.device_prefix_len == 30  # starts from the resident one
    assert (key.parent, key.tokens, key.entries, key.parent_entries) == (root_key.digest, 140, 30 + 40, 30)  # kept whole: within the window
    assert key.content == documents.plan_of(_declaring_own(prompt[:150], 140)).key.content
    # another namespace, or another document's first 100 tokens, never matches it
    assert match(_declaring_own(prompt[:150], 140, extra_key="lora")).device_prefix_len == 0
    assert match(_declaring_own([7] + prompt[1:150], 140)).device_prefix_len == 0

    # its extension published as the root's child (`turns._insert` does so)
    own = torch.arange(600, 640)
    path = array("q", root.key.token_ids) + array("q", [int(key.digest[:15], 16)] * 40)
    child = tree.insert(InsertParams(key=RadixKey(path, extra_key=root.key.extra_key),
                                     value=torch.cat([slots, own]))).last_device_node
    assert child.parent is root
    doc = Extension(key=key, node=child, kept_positions=torch.randint(100, 140, (2, 1, 40)), slots=40,
                    parent=doc_of(root))
    tree.documents.add(doc)
    invariants.check_documents(tree)
    assert doc.tables()[0].shape == (2, 1, 70) and doc.offset == 140 - 70
    again = _declaring_own(prompt[:160], 140)
    m = match(again)
    assert m.last_device_node is child and m.device_prefix_len == 70 and documents.plan_of(again).key == key
    assert torch.equal(tree.path_device_indices(child), torch.cat([slots, own]))
    longer = _declaring_own(prompt, 180)  # the next turn extends the longest: the child
    assert match(longer).last_device_node is child and documents.plan_of(longer).key.parent == key.digest
    assert tree.documents.snapshot()["entries"] == 30 + 40 and tree.documents.snapshot()["tokens"] == 140

    lock = tree.lock(child)  # locks the root too
    tree.evict(EvictParams(num_tokens=100))
    assert allocator.freed == []
    tree.unlock(lock)
    tree.evict(EvictParams(num_tokens=40))  # the leaf first
    assert tree.documents.get(key) is None and tree.documents.get(root_key) is doc_of(root)
    assert allocator.freed == own.tolist()
    tree.evict(EvictParams(num_tokens=100))
    assert tree.documents.snapshot()["resident"] == 0 and sorted(allocator.freed) == [*range(500, 530), *range(600, 640)]
    invariants.check_documents(tree)


def test_an_extension_read_between_chunks_ends_a_chunk_and_is_due_there_alone() -> None:
    """Where documents are compressed between chunks, a request extending a resident document
    reads its extension in a chunk of its own (its question after it, from the published chain:
    `extensions.adopt`), and publishes at that chunk or not at all; where prompts are read whole,
    no chunk is cut, and it publishes once its row holds its extension, its question read too."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    tree, _ = _tree()
    prompt = list(range(10, 200))
    root_key = request_key(_declaring_own(prompt, 100), KVZIP)
    root = tree.insert(InsertParams(key=node_key(root_key, 30), value=torch.arange(500, 530))).last_device_node
    tree.documents.add(RootDocument(key=root_key, node=root, kept_positions=torch.randint(0, 100, (2, 1, 30)), slots=30))
    for mode in (Role.SPLIT, Role.WHOLE):
        req = _declaring_own(prompt[:150], 140)
        _declaring(req, documents.plan_of(req).key, role=mode)
        tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", req.origin_input_ids)), req=req))
        assert documents.plan_of(req).role is Role.EXTEND and documents.plan_of(req).adopts == (mode is Role.SPLIT)
        # its row starts with the root's 30 slots, standing for 100 tokens (SGLang's fields as a match leaves them)
        req.output_ids, req.prefix_len, req.extend_end = [], 30, 30
        req.full_untruncated_fill_ids = req.origin_input_ids[70:]
        req.finished = lambda: False
        split = mode is Role.SPLIT
        assert documents.chunk_cap(req) == (40 if split else None)
        req.extend_end = 70  # its extension read: the row holds 70 slots for 140 tokens
        assert documents.extension_due(req, 70) is not None
        assert (documents.plan_of(req).ended_at(documents.chunk_end(req)) is not None) == split
        req.extend_end = 80  # its question read too
        assert (documents.extension_due(req, 80) is None) == split and documents.plan_of(req).ended_at(documents.chunk_end(req)) is None


def test_an_extension_its_start_covers_is_due_at_its_first_chunk_and_one_read_in_two_is_never_cut() -> None:
    """Where documents are compressed between chunks: (a) a finished turn that ends exactly where
    the next turn's document does (its client declared the conversation but the answer's last
    token) leaves that request none of its extension to read, so no chunk of it ends there; its
    row holds the extension exact when its first chunk (its question) is read, and it publishes
    there, once (before, never: and it stayed registered as the extension's publisher, others with
    that document waiting for it). (b) An extension SGLang reads in two chunks (its round had room
    for part of it) is never cut between them, as a document is cut only where its key says."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sgl_kvc.adapter.documents.keys import turn_key
    from sgl_kvc.adapter.documents.registry import insert_child

    tree, _ = _tree()
    prompt = list(range(10, 200))
    root_key = request_key(_declaring_own(prompt, 100), KVZIP)
    root = tree.insert(InsertParams(key=node_key(root_key, 30), value=torch.arange(500, 530))).last_device_node
    tree.documents.add(RootDocument(key=root_key, node=root, kept_positions=torch.randint(0, 100, (2, 1, 30)), slots=30))
    tkey = turn_key(root_key, prompt[:140])
    turn = Turn(key=tkey, node=insert_child(tree, doc_of(root), tkey, torch.arange(600, 640)), slots=40,
                parent=doc_of(root))
    tree.documents.add(turn)

    def split(tokens: list[int]) -> SimpleNamespace:
        req = _declaring_own(tokens, 140)
        _declaring(req, documents.plan_of(req).key, role=Role.SPLIT)
        tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", req.origin_input_ids)), req=req))
        req.finished = lambda: False
        return req

    # (a) its start, the root and the turn: 70 slots standing for all 140 tokens of its document
    req = split(prompt[:150])
    assert documents.plan_of(req).start is turn and documents.plan_of(req).adopts and documents.plan_of(req).extends is doc_of(root)
    req.output_ids, req.prefix_len, req.extend_end = [], 70, 70
    req.full_untruncated_fill_ids = req.origin_input_ids[70:]
    assert documents.chunk_cap(req) is None  # nothing of its extension left to read
    req.extend_end = 80  # its first chunk: its question
    assert documents.extension_due(req, 80) is doc_of(root)
    req.prefix_len, req.extend_end = 80, 85  # a later chunk: not again
    assert documents.extension_due(req, 85) is None

    # (b) another extension of the root: 40 tokens to read, of which its round read 20
    other = split(prompt[:100] + list(range(300, 350)))
    assert documents.plan_of(other).start is doc_of(root)
    other.output_ids, other.prefix_len, other.extend_end = [], 30, 30
    other.full_untruncated_fill_ids = other.origin_input_ids[70:]
    assert documents.chunk_cap(other) == 40
    other.extend_end = 50
    assert documents.plan_of(other).cut_inside(documents.chunk_end(other)) == 0  # not cut here (before: cut to its own budget, the extension lost)
    other.prefix_len = 50
    assert documents.chunk_cap(other) == 20 and documents.next_cut(other) is None  # it adopts there, not cut
    other.extend_end = 70
    assert documents.plan_of(other).cut_inside(documents.chunk_end(other)) is None and documents.plan_of(other).ended_at(documents.chunk_end(other)) is not None


def test_a_chain_at_its_budget_is_compressed_again_to_it() -> None:

    budget = ExtensionRule(ratio=None, budget=60, floor=13, limit=None)
    assert budget.rebuild(30, 200, 100) is None  # extended: 30 of its own fit
    assert budget.rebuild(50, 200, 100) == 60 and budget.rebuild(60, 200, 5) == 60  # at its budget: compressed again
    assert ExtensionRule(ratio=None, budget=8, floor=13, limit=None).rebuild(13, 200, 40) == 13  # never below the floor
    # a ratio past its window: compressed again to the ratio of the chain's 1,100 tokens
    assert ExtensionRule(ratio=0.3, budget=None, floor=13, limit=None).rebuild(500, 1000, 100) == 330
    assert ExtensionRule(ratio=None, budget=60, floor=13, limit=64).rebuild(60, 200, 65) is None  # over one chunk


def test_a_finished_turn_stays_in_the_tree_with_its_own_slots() -> None:
    """A finished request that started from its document gives its row back: SGLang's release
    (`claim_kv_row`, then `free_kv_row` of what the request owns) keeps the slots of its question
    and answer as a turn under the document's node, frees nothing else of them, and the next
    turn, whose document begins with those tokens, starts from the document and the turn."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, ReqKvInfo
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sgl_kvc.adapter.documents.radix_cache import without

    allocator = SegmentFreeRecorder()
    rows = SimpleNamespace(req_to_token=torch.zeros(4, 256, dtype=torch.int32))
    tree = KvcRadixCache(CacheInitParams(disable=False, req_to_token_pool=rows, token_to_kv_pool_allocator=allocator,
                                         page_size=1))
    prompt = list(range(10, 160))  # a document of 100 tokens, a question of 50
    key = request_key(_declaring_own(prompt, 100), KVZIP)
    doc_slots = torch.arange(500, 530)
    node = tree.insert(InsertParams(key=node_key(key, 30), value=doc_slots)).last_device_node
    tree.documents.add(RootDocument(key=key, node=node, kept_positions=torch.randint(0, 100, (2, 1, 30)), slots=30))

    def finished(output: list[int], row: int, reason=None) -> SimpleNamespace:
        """A request that started from the document (30 slots for 100 tokens) and read the rest exact."""
        req = _declaring_own(prompt, 100)
        documents.started_from(req, doc_of(node))
        read = len(prompt) + len(output) - 1 - 70
        rows.req_to_token[row, :30] = doc_slots.int()
        rows.req_to_token[row, 30:read] = torch.arange(1000 * (row + 1), 1000 * (row + 1) + read - 30, dtype=torch.int32)
        req.output_ids, req.finished_reason = output, reason or FINISH_LENGTH(len(output))
        req.finished = lambda: True
        req.kv = ReqKvInfo(req_pool_idx=row, cache_protected_len=30, kv_committed_len=read, kv_allocated_len=read)
        req.owned_kv_len = lambda: req.kv.kv_committed_len  # SGLang's: all of it (no stripped thinking)
        return req

    def release(req) -> list[int]:
        allocator.freed = []
        assert tree.claim_kv_row(req) is False
        tree.free_kv_row(req.kv, [(req.kv.cache_protected_len, req.kv.kv_committed_len)])
        return allocator.freed

    output = [3, 4, 5, 6, 7]
    first = finished(output, 1)
    own = rows.req_to_token[1, 30:84].clone()
    assert release(first) == []  # the question and answer (but the last token) stay
    turn = [d for d in tree.documents.by_key.values() if d.exact]
    assert len(turn) == 1 and turn[0].node.parent is node and torch.equal(turn[0].node.value, own.long())
    assert (turn[0].key.tokens, turn[0].slots, turn[0].offset) == (154, 54, 70)
    snap = tree.documents.snapshot()
    assert (snap["resident"], snap["entries"], snap["turns_resident"], snap["turn_tokens"]) == (1, 30, 1, 54)
    invariants.check_documents(tree)
    # the same answer again: nothing more kept; aborted, or compacted since its start: none kept
    assert release(finished(output, 2)) == rows.req_to_token[2, 30:84].tolist()
    assert release(finished([3, 4, 9], 3, FINISH_ABORT())) == rows.req_to_token[3, 30:82].tolist()
    compacted = finished([3, 4, 9], 3)
    compacted.kv.kv_committed_len -= 10
    assert len(release(compacted)) == 42 and tree.documents.snapshot()["turns"] == 1
    # --strip-thinking-cache: SGLang owns only the prompt's slots of a reasoning request and frees
    # the rest itself; nothing of its row is kept as a turn, so no slot is owned twice
    stripped = finished([3, 4, 9], 3)
    stripped.owned_kv_len = lambda: len(prompt) - 70
    freed = release(stripped)
    assert freed == rows.req_to_token[3, 30:82].tolist() and tree.documents.snapshot()["turns"] == 1
    # a request that read its document whole (its publisher where prompts are read whole, one
    # asking for prompt log-probabilities, `Role.ABSTAIN`), or that extends it beside it exact:
    # its question and answer were computed against the exact document, not the entries a turn's
    # key names; nothing of its row is kept, all of it is freed
    for role in (Role.WHOLE, Role.ABSTAIN, Role.EXTEND):
        whole = _declaring(_declaring_own(prompt, 100), key, role)
        if role is Role.EXTEND:  # started from the document, declaring one past it
            kvc_req.of(whole).plan = DocumentPlan(role=role, own=key, key=replace(key, digest="e" * 64), start=doc_of(node),
                                                  parent=doc_of(node), mode=Role.SPLIT)
        held = 30 if role is Role.EXTEND else 0
        end = len(prompt) + 2 - (70 if held else 0)  # three output tokens, the last never read
        rows.req_to_token[3, held:end] = torch.arange(3000, 3000 + end - held, dtype=torch.int32)
        whole.output_ids, whole.finished_reason = [3, 4, 9], FINISH_LENGTH(3)
        whole.finished = lambda: True
        whole.kv = ReqKvInfo(req_pool_idx=3, cache_protected_len=held, kv_committed_len=end, kv_allocated_len=end)
        whole.owned_kv_len = lambda end=end: end
        assert len(release(whole)) == end - held and tree.documents.snapshot()["turns"] == 1, role

    def match(tokens: list[int], document: int, limit: int | None = None):
        req = _declaring_own(tokens, document)
        return tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens), limit=limit), req=req)), req

    said = prompt + output
    m, req = match(said + [1, 2] + list(range(300, 320)), len(said) + 2)  # the template's tail, a question
    assert m.last_device_node is turn[0].node and m.device_prefix_len == 84
    assert documents.plan_of(req).start is doc_of(m.last_device_node)  # the plan names the node it matched
    assert documents.plan_of(req).key.parent == key.digest and documents.plan_of(req).extends is doc_of(node)
    m, _ = match(said[:-2] + [99, 7, 1, 2] + list(range(300, 320)), len(said) + 2)  # another answer
    assert m.last_device_node is node and m.device_prefix_len == 30
    # SGLang's limit on the match (the observation window it recomputes) inside the turn: the turn's
    # exact tokens are read again, from its document (a compressed document cannot be read in part)
    tokens = said + [1, 2] + list(range(300, 320))
    m, req = match(tokens, len(said) + 2, limit=len(said) - 5)
    assert m.last_device_node is node and m.device_prefix_len == 30 and documents.plan_of(req).start is doc_of(node)
    m, _ = match(tokens, len(said) + 2, limit=len(said))  # just past the turn's last token: it
    assert m.last_device_node is turn[0].node  # (the turn covers all but the answer's last token)

    allocator.freed = []
    tree.evict(EvictParams(num_tokens=54))  # a leaf, as any
    assert sorted(allocator.freed) == sorted(own.tolist()) and tree.documents.stats.turns_evicted == 1
    assert tree.documents.snapshot()["resident"] == 1
    invariants.check_documents(tree)
    assert without([(30, 84)], [(30, 84)]) == [] and without([(0, 10), (20, 90)], [(30, 84)]) == [(0, 10), (20, 30), (84, 90)]


def test_a_compacted_reply_stays_in_the_tree_as_a_reply_and_a_turn() -> None:
    """A finished request whose row its own passes compacted (R-KV while it decoded) gives its
    row back: its kept entries stay as a document of their own over what they cover (a reply,
    under the root), what it decoded since as a turn after it, nothing of the row is freed, and
    the next turn starts from the turn and compresses the reply again. A packed row publishes
    only where its units are where a document of its slots has them; the registry's `recompress`
    never keeps more than the reply and its extension hold."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, ReqKvInfo
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sgl_kvc.adapter.documents import packed_units
    from sgl_kvc.core.request_state import Budget, ReqKvState

    allocator = SegmentFreeRecorder()
    rows = SimpleNamespace(req_to_token=torch.zeros(4, 256, dtype=torch.int32))
    tree = KvcRadixCache(CacheInitParams(disable=False, req_to_token_pool=rows, token_to_kv_pool_allocator=allocator,
                                         page_size=1))
    prompt, output = list(range(10, 160)), list(range(400, 420))  # a document of 100 tokens, a question of 50

    def finished(row: int, k: int, units: torch.Tensor | None = None, lens: torch.Tensor | None = None,
                 answer: list[int] = output):
        """A request that compacted its row to k kept slots at logical 155, then read 14 exact."""
        req = _declaring_own(prompt, 100)
        req.output_ids, req.finished_reason, req.finished = answer, FINISH_LENGTH(20), lambda: True
        req.skip_radix_cache_insert = True
        n = k + 14
        rows.req_to_token[row, :n] = torch.arange(1000 * row, 1000 * row + n, dtype=torch.int32)
        req.kv = ReqKvInfo(req_pool_idx=row, cache_protected_len=0, kv_committed_len=n, kv_allocated_len=n)
        req.owned_kv_len = lambda: req.kv.kv_committed_len
        state = ReqKvState(policy=SimpleNamespace(name="rkv"), budget=Budget(16), offset=155 - k, passes=2)
        state.kept_positions = torch.sort(torch.randperm(155)[: 2 * (units.shape[-1] if units is not None else k)]
                                          .reshape(2, 1, -1)).values
        if units is not None:
            state.pack(units, lens, k, state.kept_positions)
        kvc_req.of(req).state = state
        return req

    def release(req) -> list[int]:
        allocator.freed = []
        assert tree.claim_kv_row(req) is False
        tree.free_kv_row(req.kv, [(0, req.kv.kv_committed_len)])
        return allocator.freed

    req = finished(1, 40)
    assert release(req) == []
    reply = [d for d in tree.documents.by_key.values() if d.key.kind is Kind.REPLY]
    assert len(reply) == 1 and reply[0].node.parent is tree.root_node and reply[0].parent is None
    assert (reply[0].key.tokens, reply[0].slots, reply[0].offset, reply[0].key.entries) == (155, 40, 115, 40)
    assert torch.equal(reply[0].kept_positions, kvc_req.of(req).state.kept_positions.int())
    (turn,) = [d for d in tree.documents.by_key.values() if d.exact]
    assert turn.parent is reply[0] and turn.key.tokens == 169 and turn.slots == 14
    assert torch.equal(turn.node.value, torch.arange(1040, 1054))
    invariants.check_documents(tree)
    assert release(finished(2, 40)) == list(range(2000, 2054))  # the same reply again: freed

    said = prompt + output
    follow = _declaring_own(said + [1, 2] + list(range(300, 320)), len(said) + 2)
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", follow.origin_input_ids)), req=follow))
    assert m.last_device_node is turn.node and m.device_prefix_len == 54
    key = documents.plan_of(follow).key
    assert key.kind is Kind.REBUILD and key.parent == reply[0].key.digest
    assert key.entries == 52  # 0.3 of its 172 tokens (the default ratio), fewer than the 40 + 17 it holds

    # packed: canonical units publish, others do not (their row is freed whole)
    lens = torch.tensor([[3], [5]])
    slots = torch.arange(3000, 3004)
    _, units = packed_units(slots, lens, 5)
    assert release(finished(3, 4, units.int(), lens, answer=[7] + output[1:])) == []
    packed = tree.documents.get(next(d.key for d in tree.documents.by_key.values() if d.key.kind is Kind.REPLY and d.unit_lens is not None))
    assert torch.equal(packed.tables()[1], units.int())
    invariants.check_documents(tree)
    shuffled = units.clone()
    shuffled[0, 0, :2] = shuffled[0, 0, :2].flip(0)
    assert len(release(finished(3, 4, shuffled.int(), lens, answer=[8] + output[1:]))) == 4 + 14

    rule = ExtensionRule(ratio=0.3, budget=None, floor=13, limit=None)
    assert rule.recompress(40, 200, 17) == 57 and rule.recompress(400, 200, 17) == 60
    assert ExtensionRule(None, 60, 13, 64).recompress(400, 500, 65) is None  # over one chunk
