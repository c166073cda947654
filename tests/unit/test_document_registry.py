"""Shared documents without a server: the `kv_compression.document` field, a document's key, and
its node in sgl-kvc's prefix cache (SGLang's RadixCache with a registry): matched in place of the
request's tokens, locked and evicted like any node, and dropped from the registry when evicted."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch

from sgl_kvc.adapter import documents, invariants
from sgl_kvc.adapter.documents import Document, DocumentKey, node_key, request_key
from sgl_kvc.adapter.radix_cache import KvcRadixCache
from sgl_kvc.config import KvcConfig
from sgl_kvc.request_settings import CUSTOM_PARAMS_KEY, DocumentSpec, RequestSettingError, parse_kv_compression

KVZIP = KvcConfig(policy="snapkv", prompt_policy="kvzip")


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


class _Allocator:
    device = "cpu"

    def __init__(self) -> None:
        self.freed: list[int] = []

    def free_segment(self, slots: torch.Tensor, start_pos: int = 0) -> None:
        self.freed += slots.tolist()


def _tree() -> tuple[KvcRadixCache, _Allocator]:
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    allocator = _Allocator()
    return KvcRadixCache(CacheInitParams(disable=False, req_to_token_pool=None,
                                         token_to_kv_pool_allocator=allocator, page_size=1)), allocator


def test_a_resident_document_is_matched_locked_and_evicted_like_a_node() -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    tree, allocator = _tree()
    key = DocumentKey(digest="ab" * 32, tokens=100, entries=30, policy="kvzip")
    slots = torch.arange(500, 530)
    node = tree.insert(InsertParams(key=node_key(key, 30), value=slots)).last_device_node
    tree.documents.add(Document(key=key, node=node, kept_positions=torch.randint(0, 100, (2, 1, 30)), slots=30))
    invariants.check_documents(tree)
    assert tree.evictable_size() == 30 and tree.documents.snapshot()["resident"] == 1

    tokens = array("q", range(10, 115))
    req = SimpleNamespace(**{documents.KEY_ATTR: key})
    match = tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens, limit=60), req=req))
    assert match.device_prefix_len == 30 and match.last_device_node is node
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
    tree.documents.add(Document(key=key, node=node, kept_positions=torch.zeros(1, 1, 20, dtype=torch.int64), slots=20))
    node.parent.children.clear()  # as if the tree lost it without telling the registry
    with pytest.raises(invariants.InvariantViolation, match="not in the tree"):
        invariants.check_documents(tree)


def test_a_document_on_a_server_without_sgl_kvcs_prefix_cache_is_a_400() -> None:
    aborted = []
    req = _req(list(range(10, 130)))
    req.finished = lambda: False
    req.set_finish_with_abort = lambda message, status_code: aborted.append((message, int(status_code)))
    documents.admit(req, KVZIP, tree_cache=SimpleNamespace())  # SGLang's own tree: no registry
    assert aborted and aborted[0][1] == 400 and "--disable-radix-cache" in aborted[0][0]
    tree, _ = _tree()
    aborted.clear()
    documents.admit(req, KVZIP, tree_cache=tree)
    assert not aborted and documents.declared(req).tokens == 100 and req.skip_radix_cache_insert


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
    documents.admit(req, KVZIP, tree_cache=tree, split=True)
    req.output_ids, req.full_untruncated_fill_ids, req.prefix_len, req.extend_end = [], prompt, 0, 0
    assert documents.splits(req) and documents.held_for_document(req) == 30  # its budget beyond k, not D
    assert documents.chunk_cap(req) == 100
    # a first chunk of 64 compacted to 40 entries: SGLang resumes at 40, its fill ids skip 24
    req.prefix_len = req.extend_end = 40
    req.full_untruncated_fill_ids = prompt[24:]
    assert documents.chunk_cap(req) == 36 and documents.ends_here(req) is None
    req.extend_end = 76  # its next chunk, cut at the document's end
    assert documents.ends_here(req) == documents.declared(req)

    # the tree holds the document's exact tokens (another request read them): matched up to D - 1
    tree.insert(InsertParams(key=RadixKey(array("q", prompt)), value=torch.arange(120)))
    match = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt)), req=req))
    assert match.device_prefix_len == 99
    whole = SimpleNamespace(**{documents.KEY_ATTR: documents.declared(req)})  # reads it whole: no limit
    assert tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt)), req=whole)).device_prefix_len == 120

    key = documents.declared(req)
    node = tree.insert(InsertParams(key=node_key(key, 30), value=torch.arange(200, 230))).last_device_node
    tree.documents.add(Document(key=key, node=node, kept_positions=torch.zeros(1, 1, 30, dtype=torch.int64), slots=30))
    match = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt)), req=req))
    assert match.last_device_node is node  # resident: it starts from it
    documents.started_from(req, doc_of(node))
    assert not documents.splits(req) and documents.chunk_cap(req) is None and documents.ends_here(req) is None
    assert documents.held_for_document(req) == 30 and documents.fill_shift(req) == 70


def test_concurrent_first_requests_wait_for_the_one_compressing_their_document() -> None:
    """Of the waiting requests declaring a document not resident, the first is admitted and
    registered as compressing it; the others are held back while it runs, and go once it
    published it, or once it finished or gave its row back without publishing."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    tree, _ = _tree()
    key = DocumentKey(digest="ef" * 32, tokens=100, entries=30, policy="kvzip")
    other = DocumentKey(digest="01" * 32, tokens=100, entries=30, policy="kvzip")

    def req(k: DocumentKey | None) -> SimpleNamespace:
        return SimpleNamespace(output_ids=[], kv=SimpleNamespace(holds_kv=True), finished=lambda: False,
                               **{documents.KEY_ATTR: k, documents.HIT_ATTR: None})

    a, b, c, plain = req(key), req(key), req(other), req(None)
    registry = tree.documents
    assert documents.held_back([plain, a, b, c], registry) == [b]
    documents.compressing([a, c], registry)  # admitted
    d = req(key)
    assert documents.held_back([b, d, c], registry) == [b, d]  # c is compressing its own
    a.kv.holds_kv = False  # a gave its row back without publishing: b goes and compresses it
    assert documents.held_back([b, d], registry) == [d]
    documents.compressing([b], registry)
    registry.settle(key, b)  # b will not publish it after all
    assert documents.held_back([d], registry) == []
    documents.compressing([d], registry)
    node = tree.insert(InsertParams(key=node_key(key, 30), value=torch.arange(30))).last_device_node
    registry.add(Document(key=key, node=node, kept_positions=torch.zeros(1, 1, 30, dtype=torch.int64), slots=30))
    assert documents.held_back([req(key), req(key)], registry) == []  # resident: every one starts from it
    assert key.digest not in registry.compressing


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
    tree.documents.add(Document(key=key, node=node, kept_positions=torch.zeros(1, 1, 30, dtype=torch.int64), slots=30))

    def req(return_logprob: bool, start: int) -> SimpleNamespace:
        return SimpleNamespace(origin_input_ids=prompt, return_logprob=return_logprob, logprob_start_len=start,
                               **{documents.KEY_ATTR: key})

    for start in (0, 99, 100, 119):  # before, at and after the document's end
        limited = RadixKey(array("q", prompt), limit=start)  # SGLang's cap for them
        match = tree.match_prefix(MatchPrefixParams(key=limited, req=req(True, start)))
        assert match.last_device_node is not node and match.device_prefix_len == 0, start
    for r in (req(True, 120), req(True, -1), req(False, 0)):  # output log-probabilities only
        assert tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt)), req=r)).last_device_node is node
    waiting = SimpleNamespace(**vars(req(True, 0)), output_ids=[])
    del tree.documents.by_key[key.digest]  # not resident: another request compresses it
    tree.documents.compressing[key.digest] = SimpleNamespace(finished=lambda: False, kv=SimpleNamespace(holds_kv=True))
    assert documents.held_back([waiting], tree.documents) == []


def test_publishers_that_ended_without_publishing_are_forgotten() -> None:
    """The registry holds a request compressing a document only while it is in flight: one that
    finished, failed or was retracted before publishing is dropped at the next prefill round, even
    if no request declares its (unique) document again."""
    registry = documents.DocumentRegistry()

    def publisher(i: int) -> tuple[DocumentKey, SimpleNamespace]:
        key = DocumentKey(digest=f"{i:064x}", tokens=100, entries=30, policy="kvzip")
        req = SimpleNamespace(output_ids=[], kv=SimpleNamespace(holds_kv=True), finished=lambda: False,
                              **{documents.KEY_ATTR: key, documents.HIT_ATTR: None})
        return key, req

    reqs = [publisher(i)[1] for i in range(100)]
    documents.compressing(reqs, registry)
    assert len(registry.compressing) == 100
    for i, r in enumerate(reqs[:99]):  # finished (aborted or not) or retracted: its row given back
        if i % 2:
            r.finished = lambda: True
        r.kv.holds_kv = False
    documents.compressing([], registry)  # the next prefill round
    assert list(registry.compressing.values()) == [reqs[99]]
