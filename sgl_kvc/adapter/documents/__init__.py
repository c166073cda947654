"""Compressed documents shared through the prefix cache (docs/architecture.md, "Shared documents").

A request says that its prompt's first D tokens are a document to keep compressed
(`kv_compression.document`). The first such request compresses it, by its question-free prompt
policy (KVzip repeats the document alone), to k entries per (layer, KV head), and publishes them to
the radix tree as one node (`document_pass.py`): cut between chunks where the server compresses
there, else from a copy of the entries of its prompt read whole. Every later request that begins
with the same D tokens (and the same namespace and settings, the document's *key*, `keys.py`)
starts from that node instead of reading the tokens: its row starts with the node's k slots, and
it prefills only its own suffix, at logical positions D, D+1, ... (`links.RowLayout`). A
conversation's next turn starts from the longest document its own begins with, publishes only its
extension and reads its question from it (`matching.py`, `extensions.py`); a finished turn's
question and answer, and a row compacted as it decoded, stay in the tree at its release
(`radix_cache.keep`, `turns.py`). What
each request does is one plan (`plan.py`), made when it enters the queue and at each match, read
by every later step.

The modules, one concern each, in the order a turn meets them: `plan` (what a request does with
its document, and where its chunks are cut), `keys` (what identifies a node and decides what it
holds, and how much an extension keeps), `matching` (where a waiting request starts, and whether
it waits for another that compresses its document), `links` (the resident nodes, one type per
kind, the flat chain a node ends, and a row's layout), `registry` (the resident nodes, their
indexes and their radix nodes), `document_pass` (compressing a document and publishing it, voted
across ranks), `extensions` (a conversation's extension, and how its request reads its question
from it), `turns` (a finished turn and reply), `radix_cache`
(sgl-kvc's prefix cache: matching, release), and `chat_documents` (documents named by messages,
in the HTTP process).

This module is the package's API for the rest of the adapter.
"""

from __future__ import annotations

from sgl_kvc.adapter.documents.keys import (
    NAMESPACE, NODE_ATTR, DocumentKey, DocumentNamespace, ExtensionRule, Kind, content_digest, node_key,
    reserved_namespace, tokens_content,
)
from sgl_kvc.adapter.documents.links import (
    Compressed, Document, Extension, Reply, RootDocument, RowLayout, Turn, compact_bytes, fill_skip,
    packed_units, prompt_read,
)
from sgl_kvc.adapter.documents.matching import (
    compressing, held_back, overdue, stop_waiting, waits_in_round,
)
from sgl_kvc.adapter.documents.plan import (
    chunk_cap, chunk_end, declare, declared_part, extension_due, extension_lost, matched, may_reply,
    may_start_from, next_cut, plan_of, publishes, request_key, settings_digest, started_from, unmatched,
)
from sgl_kvc.adapter.documents.registry import DocumentRegistry, DocumentStats, registry_of
from sgl_kvc.adapter.documents.roles import DocumentPlan, Role

__all__ = [
    "NAMESPACE", "NODE_ATTR", "Compressed", "Document", "DocumentKey", "DocumentNamespace", "DocumentPlan",
    "DocumentRegistry", "DocumentStats", "Extension", "ExtensionRule", "Kind", "Reply", "Role", "RootDocument",
    "RowLayout", "Turn", "chunk_cap", "chunk_end", "compact_bytes", "compressing", "content_digest",
    "declare", "declared_part", "extension_due", "extension_lost", "fill_skip", "held_back", "matched", "may_reply", "may_start_from", "next_cut", "node_key", "overdue", "packed_units",
    "plan_of", "prompt_read", "publishes", "registry_of", "request_key", "reserved_namespace",
    "settings_digest", "started_from", "stop_waiting", "tokens_content", "unmatched", "waits_in_round",
]
