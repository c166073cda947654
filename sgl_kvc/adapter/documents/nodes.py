"""A document's node in SGLang's radix tree: under the root, in a namespace of its own
(`insert_document`), or under the document it follows: a child of its node, in the chain's
namespace, its own placeholder tokens a number of its digest (siblings differ at their first
token, `insert_child`)."""

from __future__ import annotations

from array import array
from typing import Any

import torch
from torch import Tensor

from sgl_kvc.adapter.documents.keys import DocumentKey, node_key
from sgl_kvc.adapter.documents.links import Document


def node_path(node: Any) -> tuple[array, Tensor]:
    """The radix key tokens and slots from the root down to `node`."""
    nodes = []
    while node.parent is not None:
        nodes.append(node)
        node = node.parent
    nodes.reverse()
    tokens = array("q")
    for n in nodes:
        tokens.extend(n.key.token_ids)
    return tokens, torch.cat([n.value for n in nodes])


def insert_child(tree: Any, parent: Document, key: DocumentKey, slots: Tensor) -> Any:
    """Insert `slots` as the node of the document `key` under `parent`'s node; its node. The path
    matches down to the parent's node and no child of it begins with this one's first token, so
    the insert adds exactly one node, these slots (raises where such a child exists)."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    namespace = parent.node.key.extra_key
    mine = RadixKey(array("q", [int(key.digest[:15], 16)] * int(slots.numel())), extra_key=namespace)
    if mine.child_key(tree.page_size) in parent.node.children:
        raise RuntimeError(f"a document after {parent.key.digest[:12]} under the same first key exists")
    tokens, values = node_path(parent.node)
    tokens.extend(mine.token_ids)
    result = tree.insert(InsertParams(key=RadixKey(tokens, extra_key=namespace),
                                      value=torch.cat([values.to(slots.device), slots])))
    return result.last_device_node


def insert_document(tree: Any, key: DocumentKey, slots: Tensor) -> Any:
    """Insert `slots` as the node of the document `key`, under the root (`node_key`); its node."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    result = tree.insert(InsertParams(key=node_key(key, int(slots.numel())), value=slots))
    if result.prefix_len:  # cannot happen: a node under this key is registered, hence never re-published
        raise RuntimeError(f"a document node under key {key.digest[:12]} exists unregistered")
    return result.last_device_node
