"""Compressed documents shared through the prefix cache, on a live server.

One server (demo model, float32): SnapKV for decoding, KVzip for prompts, a budget of 64 entries
per (layer, KV head), a pool of 2000 slots, chunks of 256 tokens compressed between them when the
next would not fit (the default `chunk` moment), invariants checked after every compaction.
Prompts are a document of 120 random tokens, then a question of 12: the document is compressed to
30% (36 entries per head) by the first request that declares it, at a chunk that ends at the
document's end, and shared by the later ones. A second server does the same with variable head
budgets (the unit pool: the document is packed); a third, with layer head budgets and a context
length of 192, compresses nothing between chunks, so its first request reads its prompt whole and
publishes a copy of the document's kept entries.
"""

from __future__ import annotations

import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvc_reference import assert_pool_whole, generate, launcher_argv, logprob_error, trace_events
from loadtest.server import ServerProcess

pytestmark = pytest.mark.e2e

DOC, QUESTION, ENTRIES, POOL = 120, 12, 36, 2000  # ENTRIES = ceil(0.3 x DOC)
# float32 serving against a float32 reference (as in test_kvzip_serving); the same reference
# without the document's eviction must be 10x further off, so the comparison can fail.
TOLERANCE = 1e-3


CMD = [
    sys.executable, "-m", "sgl_kvc.launch", "--model-path", "demo", "--dtype", "float32",
    "--policy", "snapkv", "--prompt-policy", "kvzip", "--kv-budget", "64", "--kv-window", "4",
    "--kvzip-chunk", "48", "--max-total-tokens", str(POOL), "--chunked-prefill-size", "256", "--enable-metrics",
    "--kv-head-budget", "uniform",  # SGLang's own pool (the default, policy, packs KVzip as variable does)
]
# a context length far below the demo model's 16384 positions: a prompt near it leaves its
# reconstruction forward room in the row only because sgl-kvc widens the rows
CONTEXT = 192
READ_WHOLE = ["--compress-on", "prefill,decode,preempt", "--kv-head-budget", "layer", "--context-length", str(CONTEXT)]


# The demo model's template, reading also a message's `name` and a `greeting` chat template argument
# (the variable server's `--chat-template`; SGLang reads `\n` in the file as a newline); with a
# `rewrite` argument it rewrites every message but the last (as Qwen3's drops earlier reasoning).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if greeting is defined %}{{ '<|system|>\\n' + greeting + '</s>\\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if rewrite is defined and not loop.last %}{{ '(earlier) ' }}{% endif %}"
    "{% if message['name'] is defined %}{{ message['name'] + ': ' }}{% endif %}"
    "{{ message['content'] + '</s>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def servers(trace: Path):
    """Three servers started at once: uniform head budgets, variable ones, and layer ones without
    the chunk moment. The variable one renders chats with `CHAT_TEMPLATE` (a Jinja file), the
    layer one with SGLang's conversation template `chatml` (the others: the demo model's own)."""
    env = {"SGLKVC_TRACE": str(trace), "SGLKVC_CHECK": "1",
           "SGLKVC_FAILPOINTS": "document_raise,node_raise,adopt_raise,turn_raise"}
    template = trace.parent / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    cmds = [CMD, [*CMD, "--kv-head-budget", "variable", "--chat-template", str(template)],
            [*CMD, *READ_WHOLE, "--chat-template", "chatml"]]
    with ServerProcess.launch_all(cmds, env=env) as (uniform, variable, whole):
        yield {"uniform": uniform, "variable": variable, "whole": whole}


@pytest.fixture(scope="module")
def documents_server(servers):
    return servers["uniform"]


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n)]


def _ask(server: ServerProcess, doc: list[int], question: list[int], n: int = 4, ratio: float = 0.3,
         budget: int | None = None, **extra) -> dict:
    spec = {"tokens": len(doc), **({"ratio": ratio} if budget is None else {"budget": budget})}
    return generate(server, doc + question, n, sampling={"custom_params": {"sgl_kvc": {"document": spec}}}, **extra)


# Documents kept at 80% (96 slots each, packed or not): 24 of them need more than the pool.
LARGE, MANY = 0.8, 24
LONG = 2400  # a document longer than the pool


def _documents(server: ServerProcess) -> dict:
    return server.stats()["documents"]


@pytest.mark.parametrize("name", ["uniform", "whole"])
def test_a_second_request_prefills_only_its_suffix(servers, name: str, trace: Path, demo_model_path: str) -> None:
    """The first request compresses the document once; the second starts from its 36 entries
    (its matched prefix), prefills its 12 question tokens at logical positions 120.., and answers
    exactly as a dense reference whose queries after the document see only the entries the
    document kept (a request holding its own copy compressed the same way, the question unread).
    Compressed between chunks, the first request answers so too; reading its prompt whole, it
    answers from the whole document."""
    _second_request(servers[name], trace, demo_model_path, split=name != "whole")


def test_variable_head_budgets(servers, trace: Path, demo_model_path: str) -> None:
    """The same with variable head budgets: the document is packed into G = 36 slots, each head
    keeping its own number of entries (one sort over layer x head x entry); the second request's
    row starts packed. Then more documents than the pool keeps: the pool adds up."""
    server = servers["variable"]
    events = _second_request(server, trace, demo_model_path, split=True)
    lengths = {len(h) for layer in events[0]["kept_positions"] for h in layer}
    assert len(lengths) > 1, "every head kept as many entries: not a variable budget"
    for i in range(MANY):
        _ask(server, _tokens(600 + i, DOC), _tokens(700 + i, QUESTION), ratio=LARGE)
    docs = _documents(server)
    assert docs["evictions"] > 0 and docs["resident"] >= 1, docs
    assert_pool_whole(server.stats())


def _second_request(server: ServerProcess, trace: Path, demo_model_path: str, split: bool) -> list[dict]:
    doc = _tokens(1, DOC)
    before = _documents(server)
    first_question = _tokens(2, QUESTION)
    first = _ask(server, doc, first_question)
    after_first = _documents(server)
    assert after_first["compressions"] == before["compressions"] + 1, after_first
    assert after_first["entries"] == before["entries"] + ENTRIES, after_first
    events = trace_events(trace, first["meta_info"]["id"])
    published = [e for e in events if e["moment"] == "document"]
    assert len(published) == 1 and published[0]["logical_len"] == DOC, published
    # compressed between chunks: a chunk ended at the document's end, cut there to its entries
    assert [e["logical_len"] for e in events if e["moment"] == "chunk"] == ([DOC] if split else []), events
    first_error = logprob_error(demo_model_path, doc + first_question, first, published)()
    print(f"first request: max |logprob error| {first_error:.2e}")
    assert (first_error < TOLERANCE) == split, first_error

    question = _tokens(3, QUESTION)
    prefilled = server.stats()["prefix_cache"]["prefilled_tokens"]
    second = _ask(server, doc, question)
    assert server.stats()["prefix_cache"]["prefilled_tokens"] - prefilled == QUESTION
    after = _documents(server)
    assert after["hits"] == after_first["hits"] + 1, after
    assert after["compressions"] == after_first["compressions"], "the document was compressed again"
    # its prefix is the document's slots; its client is told the document's tokens were cached
    assert second["meta_info"]["cached_tokens"] == DOC
    assert not [e for e in trace_events(trace, second["meta_info"]["id"]) if e["moment"] == "document"]

    error = logprob_error(demo_model_path, doc + question, second, published)
    err, dense = error(), error(evict=False)
    print(f"second request: max |logprob error| {err:.2e}; against the whole document {dense:.3f}")
    assert err < TOLERANCE
    assert dense > 10 * TOLERANCE
    return published


def test_a_document_longer_than_the_pool(documents_server, trace: Path) -> None:
    """A document of 2400 tokens on a pool of 2000: its first request reads it in chunks of 256,
    compressed between them when the next would not fit, and one of them ends at the document's
    end, where it is cut to the document's 240 entries (10%) and published; its question is read
    after. A second request with the same question starts from the document, prefills only its
    question and answers as the first did (both attend to the same entries)."""
    doc, question = _tokens(900, LONG), _tokens(901, QUESTION)
    before = _documents(documents_server)
    first = _ask(documents_server, doc, question, ratio=0.1)
    chunks = [e["logical_len"] for e in trace_events(trace, first["meta_info"]["id"]) if e["moment"] == "chunk"]
    assert chunks[-1] == LONG and min(chunks) < POOL, chunks
    after_first = _documents(documents_server)
    assert after_first["compressions"] == before["compressions"] + 1, after_first
    prefilled = documents_server.stats()["prefix_cache"]["prefilled_tokens"]
    second = _ask(documents_server, doc, question, ratio=0.1)
    assert documents_server.stats()["prefix_cache"]["prefilled_tokens"] - prefilled == QUESTION
    assert second["meta_info"]["cached_tokens"] == LONG
    assert _documents(documents_server)["hits"] == after_first["hits"] + 1
    assert second["output_ids"] == first["output_ids"]
    served = [[lp[0] for lp in out["meta_info"]["output_token_logprobs"]] for out in (first, second)]
    assert max(abs(a - b) for a, b in zip(*served)) < TOLERANCE, served
    assert_pool_whole(documents_server.stats())


def test_what_a_document_keeps_is_decided_by_its_key_not_its_publisher(documents_server, trace: Path) -> None:
    """The same document of 2400 tokens (longer than the pool: the pool's pressure would cut it)
    published by two tenants (two `extra_key`s, so that both copies are resident) whose requests
    differ in all a publisher decides: the second has its own budget of 8 instead of the server's
    64, and 100 of the document's tokens already in the tree (another of its requests read them),
    so SGLang's chunks of it start elsewhere. Both rows are cut only where the key says (every
    256 tokens, to the document's 240 entries, then at its end), and both documents keep the same
    entries. Before, each was cut where the pool ran short, to its publisher's own budget + k
    (304 or 248 entries), from wherever its chunks ended: the two kept different tokens."""
    doc = _tokens(1400, LONG)
    spec = {"tokens": LONG, "ratio": 0.1}

    def publish(tenant: str, cached: int, **kv) -> tuple[list, list]:
        out = generate(documents_server, doc + _tokens(1401, QUESTION), 2, extra_key=tenant,
                       sampling={"custom_params": {"sgl_kvc": {**kv, "document": spec}}})
        assert out["meta_info"]["cached_tokens"] == cached
        events = trace_events(trace, out["meta_info"]["id"])
        [published] = [e for e in events if e["moment"] == "document"]
        return published["kept_positions"], [e["logical_len"] for e in events if e["moment"] == "chunk"]

    before = _documents(documents_server)
    first, cuts = publish("tenant-a", 0)
    # the second tenant's tree holds the document's first 100 tokens (a request without a document)
    generate(documents_server, doc[:100] + _tokens(1402, 4), 1, extra_key="tenant-b")
    second, cuts_b = publish("tenant-b", 100, budget=8)
    assert _documents(documents_server)["compressions"] == before["compressions"] + 2
    assert first == second
    assert cuts == cuts_b == [*range(256, LONG, 256), LONG]
    assert_pool_whole(documents_server.wait_idle())


def test_a_request_reading_its_prompt_whole_publishes_nothing_where_documents_are_cut_between_chunks(
        documents_server) -> None:
    """On a server that cuts documents between chunks, a request that reads its prompt whole (it
    asks for its prompt's log-probabilities) and declares a document not resident publishes
    nothing (it would keep other entries than the key's cuts do: all D scored at once), and holds
    no one back; the next request of the document publishes it, cut between chunks."""
    doc, question = _tokens(1410, DOC), _tokens(1411, QUESTION)
    before = _documents(documents_server)
    out = generate(documents_server, doc + question, 2, logprob_start_len=0,
                   sampling={"custom_params": {"sgl_kvc": {"document": {"tokens": DOC, "ratio": 0.3}}}})
    assert len(out["meta_info"]["input_token_logprobs"]) == DOC + QUESTION
    mid = _documents(documents_server)
    assert mid["compressions"] == before["compressions"] and mid["not_published"] == before["not_published"], mid
    _ask(documents_server, doc, _tokens(1412, QUESTION))
    assert _documents(documents_server)["compressions"] == before["compressions"] + 1
    assert_pool_whole(documents_server.wait_idle())


def test_a_first_request_that_ends_at_its_first_token_publishes(servers) -> None:
    """Read whole, the first request of a document publishes it even when it ends at its first
    token: `max_tokens` 1, a stop token at once, and SGLang's prefix warm-up for `n` > 1 (the
    prompt alone with `max_new_tokens` 0, before the n samples). SGLang releases such a request,
    and its row, while it processes the prefill's result: the document is published before that.
    Before, none of them published it (nor counted it in `not_published`), and both samples of
    `n` = 2 found no document (one compressed it, the other waited for it)."""
    server = servers["whole"]

    def first_token(seed: int, sampling: dict) -> None:
        doc = _tokens(seed, DOC)
        before = _documents(server)
        document = {"custom_params": {"sgl_kvc": {"document": {"tokens": DOC, "ratio": 0.3}}}}
        out = generate(server, doc + _tokens(seed + 1, QUESTION), 1, sampling={**document, **sampling})
        assert len(out["output_ids"]) == 1, out
        mid = _documents(server)
        assert mid["compressions"] == before["compressions"] + 1, (sampling, mid)
        assert mid["not_published"] == before["not_published"], mid
        later = _ask(server, doc, _tokens(seed + 2, QUESTION))
        assert later["meta_info"]["cached_tokens"] == DOC and _documents(server)["hits"] == mid["hits"] + 1

    first_token(1300, {})  # max_tokens 1
    stop = generate(server, _tokens(1310, DOC) + _tokens(1311, QUESTION), 1)["output_ids"][0]
    first_token(1310, {"ignore_eos": False, "stop_token_ids": [stop]})  # its first token stops it

    doc, question = _tokens(1320, DOC), _tokens(1321, QUESTION)
    before = _documents(server)
    r = server.post("/generate", json={"input_ids": doc + question, "sampling_params": {
        "n": 2, "max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True,
        "custom_params": {"sgl_kvc": {"document": {"tokens": DOC, "ratio": 0.3}}}}})
    assert r.status_code == 200, r.text
    samples = r.json()
    assert len(samples) == 2 and all(s["meta_info"]["cached_tokens"] == DOC for s in samples), samples
    after = _documents(server)
    assert after["compressions"] == before["compressions"] + 1 and after["hits"] == before["hits"] + 2, after
    assert_pool_whole(server.wait_idle())


def test_a_request_aborted_while_it_compresses_its_document(documents_server) -> None:
    """The first request of a long document is aborted while it reads it (SGLang's
    `/abort_request`, as for a client gone): the requests that waited for it go on, one of them
    compresses the document, and the pool adds up."""
    doc = _tokens(950, LONG)
    rid = "aborted-document"
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(lambda: documents_server.post("/generate", json={
            "rid": rid, "input_ids": doc + _tokens(951, QUESTION), "sampling_params": {
                "max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True,
                "custom_params": {"sgl_kvc": {"document": {"tokens": LONG, "ratio": 0.1}}}}}))
        time.sleep(0.3)
        waiting = [pool.submit(_ask, documents_server, doc, _tokens(952 + i, QUESTION), 4, 0.1) for i in range(2)]
        documents_server.post("/abort_request", json={"rid": rid})
        r = first.result()  # aborted while it read its document (or, on a fast machine, done first)
        print("first request:", r.status_code, r.text[-120:])
        assert all(len(w.result()["output_ids"]) == 4 for w in waiting)
    assert documents_server.stats()["documents"]["resident"] >= 1
    assert_pool_whole(documents_server.wait_idle())


@pytest.mark.parametrize("policy", ["rkv", "h2o", "snapkv", "kvcompress", "streamingllm", "batchmax"])
def test_a_request_on_a_document_compresses_its_own_tokens(documents_server, policy: str) -> None:
    """Each decode policy on a request that started from a document: its generated tokens go past
    the document's entries + its budget, so its own pass runs over the document's entries (scored
    without statistics of their own) and its tokens; it copies what it keeps, the document stays."""
    doc = _tokens(800, DOC)
    _ask(documents_server, doc, _tokens(801, QUESTION))
    before = documents_server.stats()
    spec = {"tokens": DOC, "ratio": 0.3}
    out = generate(documents_server, doc + _tokens(802, QUESTION), 200, sampling={"custom_params": {"sgl_kvc": {
        "policy": policy, "prompt_policy": "kvzip", "budget": 8, "document": spec}}})
    assert len(out["output_ids"]) == 200 and out["meta_info"]["cached_tokens"] == DOC
    after = documents_server.stats()
    assert after["documents"]["hits"] == before["documents"]["hits"] + 1
    assert after["compression"]["decode_passes"] > before["compression"]["decode_passes"], policy
    assert after["compression"]["failed_requests"] == before["compression"]["failed_requests"]
    _ask(documents_server, doc, _tokens(803, QUESTION))  # the document is still there, whole
    assert documents_server.stats()["documents"]["hits"] == after["documents"]["hits"] + 1
    assert_pool_whole(documents_server.stats())


def test_concurrent_first_requests_compress_once(documents_server) -> None:
    doc = _tokens(10, DOC)
    before = _documents(documents_server)
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda i: _ask(documents_server, doc, _tokens(20 + i, QUESTION)), range(4)))
    assert all(len(o["output_ids"]) == 4 for o in outs)
    after = _documents(documents_server)
    assert after["compressions"] == before["compressions"] + 1, after
    # the other three waited in the queue while it was compressed, then started from it
    assert after["hits"] == before["hits"] + 3, after
    assert sum(o["meta_info"]["cached_tokens"] == DOC for o in outs) == 3, outs
    assert after["resident"] >= 1


def test_the_pool_adds_up_after_documents_are_evicted(documents_server) -> None:
    """More documents than the pool keeps: the tree evicts the least recently used (every
    compaction and publication checked the pool meanwhile, SGLKVC_CHECK); an evicted document is
    compressed again by the next request that declares it; idle, every slot is free or cached."""
    before = _documents(documents_server)
    docs = [_tokens(100 + i, DOC) for i in range(MANY)]
    for i, doc in enumerate(docs):
        _ask(documents_server, doc, _tokens(200 + i, QUESTION), ratio=LARGE)
    after = _documents(documents_server)
    assert after["compressions"] == before["compressions"] + len(docs), after
    assert after["evictions"] > before["evictions"], after
    assert after["resident"] < after["compressions"], after
    _ask(documents_server, docs[0], _tokens(300, QUESTION), ratio=LARGE)
    again = _documents(documents_server)
    assert again["compressions"] == after["compressions"] + 1, again
    assert_pool_whole(documents_server.stats())


def test_a_failure_while_compressing_a_document_loses_only_the_document(documents_server) -> None:
    """A planted fault while the first request compresses its document: the request answers
    (its own cache was only read), nothing is published; the next request publishes it."""
    doc = _tokens(400, DOC)
    before = _documents(documents_server)
    out = _ask(documents_server, doc, _tokens(401, QUESTION), rid="failpoint-document-0")
    assert len(out["output_ids"]) == 4 and out["meta_info"]["finish_reason"]["type"] == "length"
    mid = _documents(documents_server)
    assert mid["compressions"] == before["compressions"] and mid["not_published"] == before["not_published"] + 1
    _ask(documents_server, doc, _tokens(402, QUESTION))
    assert _documents(documents_server)["compressions"] == before["compressions"] + 1
    assert_pool_whole(documents_server.stats())


@pytest.mark.parametrize("name", ["uniform", "variable", "whole"])
def test_a_failure_while_a_documents_node_is_made_leaves_its_slots_to_the_pool(servers, name: str) -> None:
    """A planted fault where a document published from copies gets its node's metadata, after
    its entries were copied into fresh slots (read whole: the document itself; where documents are
    cut between chunks: a conversation's extension): nothing is published, those slots go back to
    the pool and the tree never maps them. The request answers, the pool adds up (every compaction
    and publication checked, `SGLKVC_CHECK`), and the next request publishes it; a third starts
    from it."""
    server = servers[name]
    doc, turn = _tokens(410, DOC), _tokens(411, TURN)
    document = doc if name == "whole" else doc + turn
    if name != "whole":
        _ask(server, doc, _tokens(412, QUESTION))  # the document the extension extends
    assert_pool_whole(server.wait_idle())
    before = _documents(server)
    out = _ask(server, document, _tokens(413, QUESTION), rid=f"failpoint-node-{name}")
    assert len(out["output_ids"]) == 4 and out["meta_info"]["finish_reason"]["type"] == "length"
    mid = _documents(server)
    assert mid["compressions"] == before["compressions"] and mid["not_published"] == before["not_published"] + 1, mid
    assert_pool_whole(server.wait_idle())
    _ask(server, document, _tokens(414, QUESTION))
    assert _documents(server)["compressions"] == before["compressions"] + 1
    hit = _ask(server, document, _tokens(415, QUESTION))
    assert hit["meta_info"]["cached_tokens"] == len(document)
    assert_pool_whole(server.wait_idle())


def test_a_chat_document_is_its_messages(documents_server) -> None:
    """With the openai client: `kv_compression.document` on a chat request names the messages
    before the last (the HTTP layer counts their tokens); a second conversation with the same
    first message starts from its compressed copy. A template split that cannot be a prefix (the
    document naming every message) is a 400."""
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=documents_server.url + "/v1", api_key="-")
    text = " ".join(f"Fact {i}: the {w} is {i * 7 % 13}." for i, w in enumerate(["river", "lamp", "seed"] * 6))
    before = _documents(documents_server)

    def ask(question: str):
        return client.chat.completions.create(
            model="demo", max_tokens=4, temperature=0,
            messages=[{"role": "user", "content": text}, {"role": "user", "content": question}],
            extra_body={"kv_compression": {"document": {"ratio": 0.3}}},
        )

    first, second = ask("What is the lamp?"), ask("What is the seed?")
    assert first.choices[0].message.content is not None and second.usage.completion_tokens == 4
    after = _documents(documents_server)
    assert after["compressions"] == before["compressions"] + 1 and after["hits"] == before["hits"] + 1, after
    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(model="demo", max_tokens=2, messages=[{"role": "user", "content": text}],
                                       extra_body={"kv_compression": {"document": {}}})
    assert "kv_compression.document" in str(e.value)


# Two text parts whose join matters to the demo tokenizer ("itsinstruments" is 2 tokens more)
_PARTS = [{"type": "text", "text": "Fact 1: the river is 7, the lamp is 1. The orchestra tuned its"},
          {"type": "text", "text": "instruments while the audience found their seats."}]


@pytest.mark.parametrize("case, name", [("parts", "uniform"), ("name", "variable"), ("template_kwargs", "variable"),
                                        ("chat_template", "whole")])
def test_a_chat_documents_tokens_are_those_of_sglangs_own_prompt(servers, trace: Path, case: str, name: str) -> None:
    """A chat document's D is the tokens SGLang's own prompt of the request starts with for its
    messages, counted where SGLang renders and tokenizes the request: its text parts joined as
    SGLang joins them (" " for the demo template); on the variable server (a `--chat-template`
    file) an assistant message's `name`, or a system message and a `chat_template_kwargs` argument
    the template reads; on the layer server SGLang's conversation template `chatml` (`--chat-template
    chatml`: its system prompt, parts joined with ""). D is what SGLang's /v1/tokenize gives the
    document's messages alone (`add_generation_prompt: false`), or, there being no such option for
    a conversation template, the tokens of chatml's text of them. The next conversation with the
    same first messages starts from the document. Before, D was counted from sgl-kvc's own
    rendering: parts joined with "", `name`, template arguments and `--chat-template` ignored."""
    server = servers[name]
    first = {"role": "user", "content": _PARTS}
    document, kwargs = [first], {}
    if case in ("name", "template_kwargs"):  # each alone: the message's text as one string
        first = {"role": "user", "content": " ".join(p["text"] for p in _PARTS)}
        document = [first]
    if case == "name":  # SGLang drops a user message's `name`, not an assistant's
        document = [first, {"role": "assistant", "name": "Bob", "content": "Noted."}]
    elif case == "template_kwargs":
        document = [{"role": "system", "content": "Answer from the facts."}, first]
        kwargs = {"chat_template_kwargs": {"greeting": "Hello, reader."}}
    if case == "chat_template":
        text = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                + "".join(p["text"] for p in _PARTS) + "<|im_end|>\n")
        expected = server.post("/v1/tokenize", json={"model": "demo", "prompt": text}).json()["count"]
    else:
        r = server.post("/v1/tokenize", json={"model": "demo", "messages": document, "add_generation_prompt": False,
                                              **kwargs})
        expected = r.json()["count"]
    before = _documents(server)

    def ask(rid: str, question: str) -> None:
        r = server.post("/v1/chat/completions", json={
            "model": "demo", "max_tokens": 2, "temperature": 0, "rid": rid,
            "messages": [*document, {"role": "user", "content": question}],
            "kv_compression": {"document": {"ratio": 0.3}}, **kwargs})
        assert r.status_code == 200, r.text

    ask(f"chat-document-{case}", "What is the seed?")
    [published] = [e for e in trace_events(trace, f"chat-document-{case}") if e["moment"] == "document"]
    assert published["logical_len"] == expected
    ask(f"chat-document-{case}-2", "What is the lamp?")
    after = _documents(server)
    assert after["compressions"] == before["compressions"] + 1 and after["hits"] == before["hits"] + 1, after
    assert_pool_whole(server.wait_idle())


def test_a_template_that_rewrites_earlier_turns_reads_the_conversation_whole(servers) -> None:
    """A chat template that renders the document's messages otherwise inside the whole
    conversation (here, with `rewrite`, every message but the last, as Qwen3's drops earlier
    reasoning): no document is the start of the prompt, so the request reads it whole, compressed
    by its own settings, and is served; the stats count it. Before, it was a 400 on every turn
    after the first."""
    server = servers["variable"]
    kwargs = {"chat_template_kwargs": {"rewrite": True}}
    messages = [{"role": "user", "content": " ".join(p["text"] for p in _PARTS)},
                {"role": "assistant", "content": "Noted."}, {"role": "user", "content": "What is the seed?"}]
    before = _documents(server)
    for _ in range(2):
        r = server.post("/v1/chat/completions", json={
            "model": "demo", "max_tokens": 2, "temperature": 0, "messages": messages,
            "kv_compression": {"prompt_policy": "kvzip", "document": {"ratio": 0.3}}, **kwargs})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
    after = _documents(server)
    assert after["history_rewritten"] == before["history_rewritten"] + 2, after
    assert after["compressions"] == before["compressions"] and after["hits"] == before["hits"], after
    # the same conversation rendered as given is a document again
    r = server.post("/v1/chat/completions", json={
        "model": "demo", "max_tokens": 2, "temperature": 0, "messages": messages,
        "kv_compression": {"prompt_policy": "kvzip", "document": {"ratio": 0.3}}})
    assert r.status_code == 200, r.text
    assert _documents(server)["compressions"] == before["compressions"] + 1
    assert_pool_whole(server.wait_idle())


def test_a_chat_document_whose_messages_are_not_the_prompt_is_a_400(documents_server) -> None:
    """A chat request that gives its prompt's `input_ids` (SGLang's extension) and names its
    document by messages: the messages are not what SGLang reads, so no D can be counted from
    them, a 400 naming the field. Before, D was counted from the messages and applied to the
    input ids: a document of whatever tokens they held."""
    r = documents_server.post("/v1/chat/completions", json={
        "model": "demo", "max_tokens": 2, "input_ids": _tokens(1420, 60),
        "messages": [{"role": "user", "content": _PARTS}, {"role": "user", "content": "What is the seed?"}],
        "kv_compression": {"document": {"ratio": 0.3}}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "kv_compression.document.messages", r.text


def test_prometheus_metrics(documents_server) -> None:
    doc = _tokens(500, DOC)
    _ask(documents_server, doc, _tokens(501, QUESTION))
    _ask(documents_server, doc, _tokens(502, QUESTION))
    text = documents_server.get("/metrics").text
    lines = [l for l in text.splitlines() if l.startswith("sgl_kvc:document")]
    counts = {e: sum(float(l.rsplit(" ", 1)[1]) for l in lines if f'event="{e}"' in l) for e in ("compressed", "hit")}
    assert counts["compressed"] >= 1 and counts["hit"] >= 1, lines
    assert any(l.startswith("sgl_kvc:documents_resident{") and float(l.rsplit(" ", 1)[1]) >= 1 for l in lines), lines


@pytest.mark.parametrize("document, why", [
    ({"tokens": DOC + QUESTION}, "must end before the prompt does"),
    ({"tokens": DOC, "ratio": 1.5}, "ratio must be a number between 0 and 1"),
    ({"ratio": 0.3}, "tokens is required"),
])
def test_a_bad_document_is_a_400(documents_server, document: dict, why: str) -> None:
    r = documents_server.post("/generate", json={
        "input_ids": _tokens(5, DOC + QUESTION),
        "sampling_params": {"max_new_tokens": 2, "custom_params": {"sgl_kvc": {"document": document}}},
    })
    assert r.status_code == 400, r.text
    assert why in r.text


def test_a_prompt_at_the_context_length_is_repeated_in_whole_chunks(servers) -> None:
    """SGLang sizes a request's row to the context length (here 192), and a reconstruction forward
    writes its chunk past the prompt: sgl-kvc widens the rows, so a prompt 8 tokens short of the
    context is repeated in forwards of a whole chunk (without the room it was a failed request)."""
    server = servers["whole"]
    prompt = _tokens(900, CONTEXT - 8)  # SGLang takes at most 186 here; no template: the context starts after 4 sinks
    before = server.stats()["compression"]
    out = generate(server, prompt, 4)
    assert len(out["output_ids"]) == 4
    after = server.wait_idle()
    rec, was = after["compression"]["reconstruction"], before["reconstruction"]
    context = len(prompt) - 4
    assert rec["forwards"] - was["forwards"] == -(-context // 48)  # --kvzip-chunk 48
    assert rec["context_tokens"] - was["context_tokens"] == context
    assert after["compression"]["failed_requests"] == before["failed_requests"]
    assert_pool_whole(after)


def _kvc_config(flags: list[str]):
    """The sgl-kvc settings a server started with `flags` runs with (as its launcher parses them)."""
    from sgl_kvc.launcher.cli import parse_args

    return parse_args(launcher_argv(flags))[0]


@pytest.mark.parametrize("name", ["variable", "whole"])
def test_prompt_logprobs_on_a_resident_document(servers, name: str) -> None:
    """A request asking for its prompt's log-probabilities (`/generate` with `logprob_start_len`
    0, `/v1/completions` with `echo` and `logprobs`) on a resident document: it cannot start from
    the compressed copy (its prompt's tokens up to D would have no log-probability; SGLang asserted
    in its scheduler loop and the server exited), so it reads its prompt itself and gets exact
    prompt log-probabilities, those of the same prompt without a document. The server goes on."""
    server = servers[name]
    tenant = _tokens(1105, DOC + QUESTION)
    quiet = generate(server, tenant, 8)["output_ids"]
    doc, question = _tokens(1100, DOC), _tokens(1101, QUESTION)
    prompt = doc + question
    _ask(server, doc, _tokens(1102, QUESTION))  # publishes the document
    before = _documents(server)
    assert before["resident"] >= 1, before

    def prompt_logprobs(document: bool) -> list:
        sampling = {"custom_params": {"sgl_kvc": {"document": {"tokens": DOC}}}} if document else {}
        out = generate(server, prompt, 2, sampling=sampling, logprob_start_len=0)
        return [lp[0] for lp in out["meta_info"]["input_token_logprobs"]]

    served, plain = prompt_logprobs(True), prompt_logprobs(False)
    assert len(served) == len(prompt) and served[0] is None
    assert max(abs(a - b) for a, b in zip(served[1:], plain[1:])) < TOLERANCE

    r = server.post("/v1/completions", json={
        "model": "demo", "prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1,
        "kv_compression": {"document": {"tokens": DOC}},
    })
    assert r.status_code == 200, r.text
    token_logprobs = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert len(token_logprobs) == len(prompt) + 2
    assert max(abs(a - b) for a, b in zip(token_logprobs[1:len(prompt)], plain[1:])) < TOLERANCE

    # still serving: the document is still resident and a later request starts from it
    _ask(server, doc, _tokens(1103, QUESTION))
    after = _documents(server)
    assert after["hits"] == before["hits"] + 1 and after["compressions"] == before["compressions"], after
    assert_pool_whole(server.wait_idle())
    assert generate(server, tenant, 8)["output_ids"] == quiet  # another tenant's answer is unchanged


def test_a_client_cannot_plant_a_node_in_a_documents_namespace(servers) -> None:
    """A client's `extra_key` (or `cache_salt`) in the namespace of a document's node (the key
    formula is public, k is in the stats): a 400 naming the field. Planted before the document was
    published, it split into the node's place in the tree and its slots were owned twice (the
    scheduler exited). The document is then published and shared as usual, the pool adds up
    (SGLKVC_CHECK), and another tenant's greedy answer is unchanged. (Past the 400, the node's key
    cannot be reached either: tests/unit/test_document_registry.py plants one in the tree.)"""
    from types import SimpleNamespace

    from sgl_kvc.adapter.documents import NAMESPACE, request_key
    from sgl_kvc.request_settings import CUSTOM_PARAMS_KEY

    server = servers["variable"]
    tenant = _tokens(1200, DOC + QUESTION)
    quiet = generate(server, tenant, 8)["output_ids"]

    doc, question = _tokens(1201, DOC), _tokens(1202, QUESTION)
    spec = {"tokens": DOC, "ratio": 0.3}
    req = SimpleNamespace(origin_input_ids=doc + question, extra_key=None, cache_salt=None,
                          sampling_params=SimpleNamespace(custom_params={CUSTOM_PARAMS_KEY: {"document": spec}}))
    digest = request_key(req, _kvc_config([*CMD, "--kv-head-budget", "variable"])).digest
    for field in ("extra_key", "cache_salt"):
        # a few placeholder tokens (0), as the node's key holds, under the node's namespace
        r = server.post("/generate", json={
            "input_ids": [0] * 8, field: NAMESPACE + digest,
            "sampling_params": {"max_new_tokens": 2, "temperature": 0},
        })
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"], r.text
    r = server.post("/v1/completions", json={"model": "demo", "prompt": [0] * 8, "max_tokens": 2,
                                              "extra_key": NAMESPACE + digest})
    assert r.status_code == 400 and r.json()["error"]["param"] == "extra_key", r.text

    before = _documents(server)
    _ask(server, doc, question)
    _ask(server, doc, _tokens(1204, QUESTION))
    after = _documents(server)
    assert after["compressions"] == before["compressions"] + 1 and after["hits"] == before["hits"] + 1, after
    assert_pool_whole(server.wait_idle())
    assert generate(server, tenant, 8)["output_ids"] == quiet


@pytest.mark.parametrize("policy", ["h2o", "batchmax", "kvcompress"])
def test_a_statistics_policy_answers_alike_from_the_document_it_published_and_from_a_hit(
        documents_server, trace: Path, policy: str) -> None:
    """A decode policy that keeps attention statistics (H2O, Batch-Max; KV-Compress seeds its own
    at its first pass) on a document's first request, which compresses it between chunks and goes
    on from its node, and on a later request with the same question, which starts from the node:
    neither has statistics of the document's own queries for its entries (a hit never read them),
    so both count them from the document's end, and they answer alike, token for token, through
    every decode pass. Before, the first request carried the statistics of its own reading of the
    document and chose differently."""
    doc, question = _tokens(1500 + 10 * len(policy), DOC), _tokens(1501 + 10 * len(policy), QUESTION)
    spec = {"tokens": DOC, "ratio": 0.3}
    sampling = {"custom_params": {"sgl_kvc": {"policy": policy, "prompt_policy": "kvzip", "budget": 8,
                                              "document": spec}}}
    before = documents_server.stats()
    first = generate(documents_server, doc + question, 200, sampling=sampling)
    second = generate(documents_server, doc + question, 200, sampling=sampling)
    after = documents_server.stats()
    assert after["documents"]["compressions"] == before["documents"]["compressions"] + 1
    assert after["documents"]["hits"] == before["documents"]["hits"] + 1
    assert second["meta_info"]["cached_tokens"] == DOC != first["meta_info"]["cached_tokens"]
    assert after["compression"]["decode_passes"] >= before["compression"]["decode_passes"] + 2, policy
    assert after["compression"]["failed_requests"] == before["compression"]["failed_requests"]
    # the first request's passes after its document's cut, and the hit's, keep the same entries
    kept = [[e["kept_positions"] for e in trace_events(trace, out["meta_info"]["id"])
             if e["moment"] in ("prefill", "decode")] for out in (first, second)]
    assert kept[0] == kept[1], policy
    assert first["output_ids"] == second["output_ids"], policy
    served = [[lp[0] for lp in out["meta_info"]["output_token_logprobs"]] for out in (first, second)]
    assert max(abs(a - b) for a, b in zip(*served)) < TOLERANCE, served
    assert_pool_whole(documents_server.stats())


@pytest.mark.parametrize("name", ["uniform", "variable"])
def test_a_documents_metadata_is_int32_and_within_its_reservation(servers, name: str) -> None:
    """What a resident document keeps beside its KV (the position each entry holds; packed, each
    head's length; KVzip's float32 score of each entry) is 8 bytes per (layer, KV head) and entry
    of the demo model's 2 x 2, for a uniform KVzip document exactly 8 x 2 x 2 x k. Every resident document's metadata is
    within the bytes the KV memory reserved for it (`documents.metadata_budget`, charged to the
    pool where SGLang's KV memory is sized, `adapter/memory/kv_memory.py`), after more documents than the
    pool holds. Before, the positions and units were int64 and reserved nowhere."""
    server = servers[name]
    assert _documents(server)["metadata_budget"] > 0
    # none of the other tests' documents (a reply keeps no scores: 4 bytes per entry)
    assert server.post("/flush_cache?timeout=30", json={}).status_code == 200
    for i in range(MANY):
        _ask(server, _tokens(1700 + i, DOC), _tokens(1800 + i, QUESTION), ratio=LARGE if i else 0.3)
        docs = _documents(server)
        if name == "uniform":  # [2, 2, k] positions per document, k its entries per head
            assert docs["metadata_bytes"] == 8 * 2 * 2 * docs["entries"], docs
        else:  # each head's positions and scores, and lengths [2, 2]
            assert docs["metadata_bytes"] % 16 == 0, docs
        assert docs["metadata_bytes"] <= docs["metadata_budget"], docs
    assert_pool_whole(server.wait_idle())


# The hostile-client suite's CI seed on each server (`--fuzz-seed S` runs another, `--fuzz-bursts N`
# more bursts); a document of 1000 tokens (four chunks) is compressed while its clients hang up,
# of 160 on the server whose context is 192.
HOSTILE = {"uniform": (6000, 1000), "variable": (6100, 1000), "whole": (6200, 160)}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_clients(servers, name: str, hostile_documents) -> None:
    """The hostile-client suite for shared documents and KVzip (`tests/hostile_documents.py`), on
    each server: a burst of everything a client controls about them (reserved and near `extra_key`
    and `cache_salt` values, LoRA adapters on a server without LoRA, prompt log-probabilities and
    `echo` on documents, `n`, `max_tokens` 0 and 1, stop strings, clients hanging up while a
    document is compressed or waited for, budgets of 1, ratios near 0 and 1, documents of one
    token and at the context length, chat documents of content parts, `messages` at its edges),
    mixed with the request mix's ordinary tenants. After it the server serves, its pool is whole
    (SGLKVC_CHECK), another tenant's greedy answers are those of the quiet server, every served
    request got what it asked for and every refusal is an OpenAI-style 4xx naming its field."""
    flags = {"uniform": CMD, "variable": [*CMD, "--kv-head-budget", "variable"], "whole": [*CMD, *READ_WHOLE]}
    seed, long = HOSTILE[name]
    counts = hostile_documents(servers[name], ci_seed=seed, flags=flags[name], long=long)
    assert counts["refused"] and counts["served"], counts


# (document tokens, suffix tokens) per server: the suffix is more than the request's own budget of 64
# beyond its document, so its prompt pass (KVzip) compresses it; on "whole" the context is 192.
SUFFIX_PAST_BUDGET = {"uniform": (DOC, 150), "variable": (DOC, 150), "whole": (60, 100)}


@pytest.mark.parametrize("name", list(SUFFIX_PAST_BUDGET))
def test_a_hit_whose_suffix_exceeds_its_budget_repeats_only_its_suffix(servers, name: str) -> None:
    """A request that starts from a document and reads more than its own budget after it: its
    KVzip pass repeats only its context after the document, the document's entries scored as the
    document's own pass scored them (kept with the document, `Document.carried`); so does the
    request that published the document between chunks, after its cut, and the two answer alike.
    Before, each repeated the whole document again in its own pass: a hit paid for the document."""
    server = servers[name]
    d, suffix = SUFFIX_PAST_BUDGET[name]
    doc, question = _tokens(4100 + d, d), _tokens(4200 + d, suffix)
    sinks = 4  # the demo model has no template: a context starts after kvpress's sinks

    def repeated() -> tuple[int, dict]:
        was = server.wait_idle()["compression"]["reconstruction"]["context_tokens"]
        out = _ask(server, doc, question, n=6)
        now = server.wait_idle()["compression"]["reconstruction"]["context_tokens"]
        return now - was, out

    before = _documents(server)
    first_tokens, first = repeated()
    assert _documents(server)["compressions"] == before["compressions"] + 1
    hit_tokens, hit = repeated()
    assert _documents(server)["hits"] == before["hits"] + 1
    assert hit_tokens == suffix, f"a hit repeated {hit_tokens} tokens, its suffix is {suffix}"
    if name == "whole":  # the publisher's pass over its document, then its own copy whole
        assert first_tokens == (d - sinks) + (d + suffix - sinks), first_tokens
    else:  # its cut at the document's end, then its suffix only
        assert first_tokens == (d - sinks) + suffix, first_tokens
        assert hit["output_ids"] == first["output_ids"]
    assert_pool_whole(server.wait_idle())


# A conversation's turns: 24 tokens after the document, then 16 more (a whole server's prompts
# stay below its context length of 192).
TURN, NEXT_TURN = 24, 16


@pytest.mark.parametrize("name", ["uniform", "variable", "whole"])
def test_a_document_that_extends_a_resident_one_starts_from_it(servers, name: str, trace: Path,
                                                               demo_model_path: str) -> None:
    """A conversation whose document grows by a turn each time: the request whose document is the
    resident document + one turn starts from the resident one (it prefills the turn and its
    question only), keeps its entries as they are and publishes the turn's, chosen among its own
    tokens, as a child node; the next request with that document prefills only its question and
    answers exactly as a dense reference that reads the chain's entries (so does the publisher,
    where documents are compressed between chunks: it reads its question after its turn, from
    the chain); a second branch shares
    the first document's node (its entries are in the tree once); a third turn extends the chain;
    the pool adds up once they are evicted, and another tenant's answer is unchanged. The turns
    declare a budget for their chain (its document's 36 entries and 12 more, then 10 more): a
    turn declaring a ratio is kept whole within `--kv-turn-window`
    (`test_a_turn_within_the_window_is_kept_whole`), and this is the pass that chooses among a
    turn's tokens, with the parent's entries held. On the
    uniform server (compressed between chunks) every head keeps as many of the turn's entries; on
    the variable one they are packed, one sort over every head; on the layer server (prompts read
    whole), one sort per layer."""
    server = servers[name]
    tenant = _tokens(5000, DOC + QUESTION)
    quiet = generate(server, tenant, 4)["output_ids"]
    doc, turn, branch, turn3 = _tokens(5001, DOC), _tokens(5002, TURN), _tokens(5003, TURN), _tokens(5004, NEXT_TURN)

    budgets = {DOC: None, DOC + TURN: ENTRIES + 12, DOC + TURN + NEXT_TURN: ENTRIES + 22}

    def ask(document: list[int], seed: int) -> tuple[dict, int, dict]:
        was = server.stats()["prefix_cache"]["prefilled_tokens"]
        out = _ask(server, document, _tokens(seed, QUESTION), budget=budgets[len(document)])
        return out, server.stats()["prefix_cache"]["prefilled_tokens"] - was, _documents(server)

    def published(out: dict) -> dict:
        events = [e for e in trace_events(trace, out["meta_info"]["id"]) if e["moment"] == "document"]
        assert len(events) == 1, events
        return events[0]

    first, _, start = ask(doc, 5010)
    root = published(first)
    # turn 2: starts from the document, reads its turn and question, publishes the turn's entries
    second, prefilled, after = ask(doc + turn, 5011)
    assert prefilled == TURN + QUESTION and second["meta_info"]["cached_tokens"] == DOC
    assert after["extensions"] == start["extensions"] + 1 and after["hits"] == start["hits"] + 1, after
    chain = published(second)
    assert chain["logical_len"] == DOC + TURN
    heads = [(head, parent_head) for layer, parent in zip(chain["kept_positions"], root["kept_positions"])
             for head, parent_head in zip(layer, parent)]
    for head, parent_head in heads:  # the document's entries as it kept them, then the turn's
        assert head[:len(parent_head)] == parent_head and all(DOC <= p < DOC + TURN for p in head[len(parent_head):])
    own = sum(len(head) - len(parent_head) for head, parent_head in heads) / len(heads)  # per (layer, KV head)
    assert 0 < own < TURN and after["entries"] == start["entries"] + own, (own, after)
    # the publisher answers from the chain it published where documents are cut between chunks,
    # as a later request with that document does; where prompts are read whole, from the
    # document's entries and its turn exact
    seen = [root] if name == "whole" else [root, chain]
    assert logprob_error(demo_model_path, doc + turn + _tokens(5011, QUESTION), second, seen)() < TOLERANCE

    # the same conversation again: starts from the chain, prefills only its question
    third, prefilled, again = ask(doc + turn, 5012)
    assert prefilled == QUESTION and third["meta_info"]["cached_tokens"] == DOC + TURN
    assert again["compressions"] == after["compressions"] and again["hits"] == after["hits"] + 1, again
    error = logprob_error(demo_model_path, doc + turn + _tokens(5012, QUESTION), third, [root, chain])
    err, dense = error(), error([root])
    print(f"a hit on the chain: max |logprob error| {err:.2e}; with the turn whole {dense:.3f}")
    assert err < TOLERANCE and dense > 10 * TOLERANCE

    # another branch of the same document: the document's node is shared, not copied
    fork, prefilled, branched = ask(doc + branch, 5013)
    assert prefilled == TURN + QUESTION and fork["meta_info"]["cached_tokens"] == DOC
    assert branched["extensions"] == again["extensions"] + 1
    if branched["evictions"] == again["evictions"]:  # (else older documents made room for it)
        assert branched["resident"] == again["resident"] + 1 and branched["entries"] == again["entries"] + own
    # turn 3 extends the chain of turn 2
    fourth, prefilled, longer = ask(doc + turn + turn3, 5014)
    assert prefilled == NEXT_TURN + QUESTION and fourth["meta_info"]["cached_tokens"] == DOC + TURN
    assert longer["extensions"] == branched["extensions"] + 1
    assert published(fourth)["logical_len"] == DOC + TURN + NEXT_TURN
    _, prefilled, _ = ask(doc + turn + turn3, 5015)
    assert prefilled == QUESTION

    if name == "uniform":
        # more documents than the pool keeps: the chains are evicted leaf first (SGLKVC_CHECK
        # checks every chain's parent is its node's parent), and the pool adds up
        resident = _documents(server)
        for i in range(MANY):
            _ask(server, _tokens(5100 + i, DOC), _tokens(5200 + i, QUESTION), ratio=LARGE)
        assert _documents(server)["evictions"] >= resident["evictions"] + 5
        assert_pool_whole(server.wait_idle())
    assert server.post("/flush_cache?timeout=30", json={}).status_code == 200
    assert _documents(server)["resident"] == 0
    assert_pool_whole(server.wait_idle())
    assert generate(server, tenant, 4)["output_ids"] == quiet


def test_a_turn_within_the_window_is_kept_whole(servers, trace: Path, demo_model_path: str) -> None:
    """A turn declaring a ratio (as README's conversations do) is kept whole as its extension while
    the chain then holds at most `--kv-turn-window` (256) entries beyond that ratio of its tokens
    (`ExtensionRule.entries`): the chain keeps the document's entries, then every position of the
    turn, and the next request with that document answers as a dense reference reading them."""
    server = servers["uniform"]
    doc, turn = _tokens(5701, DOC), _tokens(5702, TURN)

    def published(out: dict) -> dict:
        events = [e for e in trace_events(trace, out["meta_info"]["id"]) if e["moment"] == "document"]
        assert len(events) == 1, events
        return events[0]

    root = published(_ask(server, doc, _tokens(5710, QUESTION)))
    start = _documents(server)
    chain = published(_ask(server, doc + turn, _tokens(5711, QUESTION)))
    after = _documents(server)
    assert after["extensions"] == start["extensions"] + 1 and after["rebuilds"] == start["rebuilds"], after
    for layer, parent in zip(chain["kept_positions"], root["kept_positions"]):
        for head, parent_head in zip(layer, parent):
            assert head[:len(parent_head)] == parent_head and sorted(head[len(parent_head):]) == [*range(DOC, DOC + TURN)]
    assert after["entries"] == start["entries"] + TURN, after
    third = _ask(server, doc + turn, _tokens(5712, QUESTION))
    assert logprob_error(demo_model_path, doc + turn + _tokens(5712, QUESTION), third, [root, chain])() < TOLERANCE
    assert_pool_whole(server.wait_idle())


def test_a_chat_conversation_reads_each_turn_once(documents_server) -> None:
    """With the openai client, a conversation as every chat client sends it: each turn resends
    every message so far and its new question, declaring the default document (every message but
    the last). Turn 1 compresses the first message; each later turn starts from the document of
    the turn before (whose messages its own begin with) and from that turn's question and answer,
    which its request left in the tree (the answers here are words the template renders back
    into the tokens the model generated: `logit_bias`); it prefills only the answer's last token,
    what the template adds after it and its own question, and publishes the last question and
    answer's entries as an extension. A client that resends other answers (its own edits) starts
    from the documents alone and reads the rest. The same conversation again starts from each
    turn's own document, compressing nothing."""
    from openai import OpenAI

    server = documents_server
    client = OpenAI(base_url=server.url + "/v1", api_key="-")
    text = " ".join(f"Fact {i}: the {w} is {i * 5 % 11}." for i, w in enumerate(["door", "bell", "kite"] * 6))
    questions = ["What is the door?", "What is the bell?", "What is the kite?"]
    answer = 4  # tokens: " the" four times

    def conversation(answers: list[str]) -> list[tuple[int, int, int]]:
        """Per turn: the tokens it prefilled, its prompt's and its document's. The client keeps
        the server's answers in `answers`, or resends those there."""
        messages, out = [{"role": "user", "content": text}], []
        for t, question in enumerate(questions):
            document = server.post("/v1/tokenize", json={"model": "demo", "messages": messages,
                                                         "add_generation_prompt": False}).json()["count"]
            messages.append({"role": "user", "content": question})
            was = server.stats()["prefix_cache"]["prefilled_tokens"]
            r = client.chat.completions.create(model="demo", max_tokens=answer, temperature=0, messages=messages,
                                               logit_bias={"266": 100},
                                               extra_body={"kv_compression": {"document": {"ratio": 0.3}}})
            prefilled = server.stats()["prefix_cache"]["prefilled_tokens"] - was
            out.append((prefilled, r.usage.prompt_tokens, document))
            if len(answers) == t:
                answers.append(r.choices[0].message.content)
            messages.append({"role": "assistant", "content": answers[t]})
        return out

    before = _documents(server)
    answers: list[str] = []
    turns = conversation(answers)
    assert answers == [" the" * answer] * len(questions), answers
    after = _documents(server)
    assert after["compressions"] == before["compressions"] + 3 and after["extensions"] == before["extensions"] + 2
    assert after["hits"] == before["hits"] + 2 and after["turns"] == before["turns"] + 3, after
    # turn 1 reads its prompt (but what the tree holds of the template's first tokens); each later
    # one starts from the turn before: its prompt, and its answer but the last token
    assert turns[0][0] <= turns[0][1] and [prefilled for prefilled, _, _ in turns[1:]] == [
        prompt - (turns[t][1] + answer - 1) for t, (_, prompt, _) in enumerate(turns[1:])], turns
    edited = conversation([" a door", " a bell", " a kite"])  # from the documents alone
    assert [prefilled for prefilled, _, _ in edited[1:]] == [
        prompt - edited[t][2] for t, (_, prompt, _) in enumerate(edited[1:])], edited
    compressed = _documents(server)["compressions"]
    again = conversation(answers)  # the same conversation: from each turn's own document
    assert [prefilled for prefilled, _, _ in again] == [prompt - document for _, prompt, document in again], again
    assert _documents(server)["compressions"] == compressed, "a chain was compressed again"
    assert_pool_whole(server.wait_idle())


@pytest.mark.parametrize("name", ["uniform", "variable", "whole"])
def test_a_conversation_at_its_budget_is_compressed_again(servers, name: str, trace: Path, demo_model_path: str) -> None:
    """A document whose `budget` (entries per head for the whole conversation) its resident start
    has spent: its request starts from that chain as an extension's does (it prefills only its
    turn and question), and compresses the chain's entries and its turn's tokens together to its
    budget (KVzip over the kept entries, their scores carried), not cut where the budget runs out:
    a document of its own, which the next request with that document starts from and answers
    from exactly as a dense reference reading those entries; a turn after it is compressed so
    again. (Packed, `budget` is each head's on average.)"""
    server = servers[name]
    doc, turn, turn3 = _tokens(5301, DOC), _tokens(5302, TURN), _tokens(5306, NEXT_TURN)
    budget = 40

    def ask(document: list[int], seed: int) -> tuple[dict, list[int], int]:
        was = server.stats()["prefix_cache"]["prefilled_tokens"]
        prompt = document + _tokens(seed, QUESTION)
        spec = {"tokens": len(document), "budget": budget}
        out = generate(server, prompt, 2, sampling={"custom_params": {"sgl_kvc": {"document": spec}}})
        return out, prompt, server.stats()["prefix_cache"]["prefilled_tokens"] - was

    def published(out: dict) -> dict:
        events = [e for e in trace_events(trace, out["meta_info"]["id"]) if e["moment"] == "document"]
        assert len(events) == 1, events
        return events[0]

    before = _documents(server)
    root = published(ask(doc, 5303)[0])
    out, _, prefilled = ask(doc + turn, 5304)
    assert prefilled == TURN + QUESTION
    after = _documents(server)
    assert after["extensions"] == before["extensions"] and after["rebuilds"] == before["rebuilds"] + 1, after
    assert after["compressions"] == before["compressions"] + 2 and after["entries"] == before["entries"] + 2 * budget
    rebuilt = published(out)
    kept = [set(head) for layer in rebuilt["kept_positions"] for head in layer]
    assert sum(map(len, kept)) == budget * len(kept) and max(map(max, kept)) < DOC + TURN
    assert min(map(min, kept)) < DOC <= max(map(max, kept))  # of the chain's entries and of the turn's
    again, prompt, prefilled = ask(doc + turn, 5305)
    assert prefilled == QUESTION and again["meta_info"]["cached_tokens"] == DOC + TURN
    error = logprob_error(demo_model_path, prompt, again, [root, rebuilt])
    err, unrebuilt = error(), error([root])
    print(f"a hit on the rebuilt chain: max |logprob error| {err:.2e}; with the turn whole {unrebuilt:.3f}")
    assert err < TOLERANCE and unrebuilt > 10 * TOLERANCE
    _, _, prefilled = ask(doc + turn + turn3, 5307)
    assert prefilled == NEXT_TURN + QUESTION and _documents(server)["rebuilds"] == after["rebuilds"] + 1
    assert_pool_whole(server.wait_idle())

def test_a_chain_never_grows_past_its_depth(documents_server) -> None:
    """One client extends its document by one token at each request, one after another (the
    sequence that once ended the server with a recursion 960 links deep): each request extends
    the chain by a link, until the chain is at `--kv-document-depth` (16 by default) and the next
    request compresses it again as one document. No chain is ever deeper, every request is
    answered, the pool adds up and another tenant's answer is unchanged."""
    server, depth = documents_server, 16
    tenant = _tokens(5401, DOC + QUESTION)
    quiet = generate(server, tenant, 4)["output_ids"]
    tokens, question = _tokens(5402, DOC + depth + 4), _tokens(5403, QUESTION)
    before, deepest = _documents(server), []
    for i in range(depth + 4):
        out = _ask(server, tokens[: DOC + i], question, n=1)
        assert len(out["output_ids"]) == 1
        deepest.append(_documents(server)["deepest_chain"])
    after = _documents(server)
    assert max(deepest) == depth and after["rebuilds"] > before["rebuilds"], (deepest, after)
    assert after["extensions"] >= before["extensions"] + depth - 1, after
    assert generate(server, tenant, 4)["output_ids"] == quiet
    assert_pool_whole(server.wait_idle())


TAIL = 2  # what a chat template renders after an answer (`<|im_end|>` and a newline, say)


def _turn(server: ServerProcess, document: list[int], seed: int, **extra) -> tuple[dict, list[int], int]:
    """A turn over `document` with question `seed` (`_ask`): its result, its prompt, and the tokens
    the server prefilled for it."""
    was = server.stats()["prefix_cache"]["prefilled_tokens"]
    question = _tokens(seed, QUESTION)
    out = _ask(server, document, question, **extra)
    return out, document + question, server.stats()["prefix_cache"]["prefilled_tokens"] - was


@pytest.mark.parametrize("name", ["uniform", "variable"])
def test_a_finished_turn_is_where_the_next_one_starts(servers, name: str, trace: Path, demo_model_path: str) -> None:
    """A request that declared a document finishes: its question and answer (all but its last
    token, never read) stay in the tree as a turn after its document, their slots taken from its
    row. The next turn, whose document is the conversation so far (+ a template's tail), starts
    from that document and the turn, prefills only the answer's last token, the tail and its
    question, publishes its extension (chosen among the last question and answer, read from the
    turn's slots), reads its question from that extension, and finishes into a turn of its own after
    that extension, which the third turn starts from; the turn a later one started from is dropped
    once that one kept its own. Each answers exactly as a dense reference whose queries see what
    the rows held: a turn's tokens as its request computed them, then the extension's entries, and
    10x further off from the other way of reading its question. A document whose
    tokens differ from the turn's in one token matches no turn. The pool adds up after flushing;
    another tenant's answer is unchanged."""
    server = servers[name]
    # nothing of earlier tests resident: none of their turns is evicted while this one counts its own
    assert server.post("/flush_cache?timeout=30", json={}).status_code == 200
    tenant = _tokens(6000, DOC + QUESTION)
    quiet = generate(server, tenant, 4)["output_ids"]
    doc, tail = _tokens(6001, DOC), _tokens(6002, TAIL)
    before = _documents(server)

    def budget_of(document: list[int]) -> int | None:
        """Each turn declares a budget for its chain, 10 entries a turn beyond the document's: a
        pass that chooses among the turn's tokens (a ratio keeps a turn whole within the window)."""
        return None if len(document) == DOC else ENTRIES + 10 * round((len(document) - DOC) / (QUESTION + 6))

    def ask(document: list[int], seed: int) -> tuple[dict, list[int], int]:
        return _turn(server, document, seed, budget=budget_of(document))

    def published(out: dict) -> dict:
        events = [e for e in trace_events(trace, out["meta_info"]["id"]) if e["moment"] == "document"]
        assert len(events) == 1, events
        return events[0]

    def seen(chain: dict, start: int, end: int) -> dict:
        """What a row starting from `chain` and holding [start, end) exact showed a query at end."""
        kept = [[[*head, *range(start, end)] for head in layer] for layer in chain["kept_positions"]]
        return {"logical_len": end, "kept_positions": kept}

    first, prompt1, _ = ask(doc, 6010)
    root = published(first)
    end1 = len(prompt1) + 3
    after1 = _documents(server)
    assert after1["turns"] == before["turns"] + 1 and after1["turn_tokens"] == before["turn_tokens"] + end1 - DOC

    # turn 2: the conversation so far, the template's tail, a new question
    doc2 = prompt1 + first["output_ids"] + tail
    second, prompt2, prefilled = ask(doc2, 6011)
    assert prefilled == 1 + TAIL + QUESTION and second["meta_info"]["cached_tokens"] == end1, prefilled
    after2 = _documents(server)
    assert after2["extensions"] == after1["extensions"] + 1 and after2["turns"] == after1["turns"] + 1, after2
    # turn 1's turn, which turn 2 started from, is dropped: one turn of the conversation stays exact
    assert after2["turns_resident"] == after1["turns_resident"] and after2["turns_evicted"] == after1["turns_evicted"] + 1
    chain = published(second)
    assert chain["logical_len"] == len(doc2)

    def answered_from(events: list[dict], extension: dict, prompt: list[int], out: dict) -> list[dict]:
        """What a turn's question saw: the extension its request published (as a later request with
        that document does), not its extension exact, which must be 10x further off."""
        expected, other = [*events, extension], events
        error = logprob_error(demo_model_path, prompt, out, expected)
        err, off = error(), error(other)
        print(f"{name}: max |logprob error| {err:.2e}; the other way {off:.3f}")
        assert err < TOLERANCE and off > 10 * TOLERANCE
        return expected

    events = answered_from([root, seen(root, DOC, end1)], chain, prompt2, second)

    # turn 3 starts from turn 2's extension and turn (turn 2's question and answer as its
    # request computed them, not read from its extension)
    doc3 = prompt2 + second["output_ids"] + tail
    third, prompt3, prefilled = ask(doc3, 6012)
    end2 = len(prompt2) + 3
    assert prefilled == 1 + TAIL + QUESTION and third["meta_info"]["cached_tokens"] == end2, prefilled
    assert published(third)["logical_len"] == len(doc3)
    answered_from([*events, seen(chain, len(doc2), end2)], published(third), prompt3, third)

    # the same conversation, another question: from turn 3's extension; a client that changed
    # one token of the last answer matches no turn, and reads its extension itself
    _, _, prefilled = ask(doc3, 6013)
    assert prefilled == QUESTION
    changed = doc3[:end2 - 1] + [doc3[end2 - 1] + 1] + doc3[end2:]
    _, _, prefilled = ask(changed, 6014)
    assert prefilled == len(changed) - len(doc2) + QUESTION
    # a failure while a request goes on from the extension it published fails that request alone;
    # the extension stays, and the next request with that document starts from it
    doc4 = doc3 + _tokens(6013, QUESTION) + tail
    spec = {"tokens": len(doc4), "budget": budget_of(doc4)}
    r = server.post("/generate", json={"rid": f"failpoint-adopt-{name}", "input_ids": doc4 + _tokens(6017, QUESTION),
                                       "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True,
                                                           "custom_params": {"sgl_kvc": {"document": spec}}}})
    aborted = r.status_code >= 400 or r.json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert aborted, r.text[:300]
    _, _, prefilled = ask(doc4, 6018)
    assert prefilled == QUESTION
    # a failure while a turn is kept loses that turn only: the next turn reads its extension
    turns = _documents(server)["turns"]
    failed = _ask(server, doc2, _tokens(6015, QUESTION), budget=budget_of(doc2), rid=f"failpoint-turn-{name}")
    assert len(failed["output_ids"]) == 4 and _documents(server)["turns"] == turns
    _, _, prefilled = ask(doc2 + _tokens(6015, QUESTION) + failed["output_ids"] + tail, 6016)
    assert prefilled == QUESTION + 4 + TAIL + QUESTION

    assert server.post("/flush_cache?timeout=30", json={}).status_code == 200
    docs = _documents(server)
    assert docs["resident"] == 0 and docs["turns_resident"] == 0, docs
    assert_pool_whole(server.wait_idle())
    assert generate(server, tenant, 4)["output_ids"] == quiet


@pytest.mark.parametrize("name", ["uniform", "variable"])
def test_a_document_ending_where_the_last_turn_does_is_published_from_it(servers, name: str) -> None:
    """A conversation's next document that ends exactly where the finished turn does (all of the
    last request's prompt and answer but the answer's last token, which no turn holds): its
    request starts from the document and that turn, which cover its whole document, reads only its
    question, and still publishes its extension (at its first chunk: no chunk of it can end at the
    document's end); the next request with that document starts from the extension."""
    server = servers[name]
    doc = _tokens(6200, DOC)
    first = _ask(server, doc, _tokens(6201, QUESTION))
    document = doc + _tokens(6201, QUESTION) + first["output_ids"][:-1]
    before = _documents(server)
    was = server.stats()["prefix_cache"]["prefilled_tokens"]
    _ask(server, document, _tokens(6202, QUESTION))
    after = _documents(server)
    assert server.stats()["prefix_cache"]["prefilled_tokens"] - was == QUESTION
    assert after["extensions"] == before["extensions"] + 1 and after["not_published"] == before["not_published"], after
    was = server.stats()["prefix_cache"]["prefilled_tokens"]
    hit = _ask(server, document, _tokens(6203, QUESTION))
    assert hit["meta_info"]["cached_tokens"] == len(document)
    assert server.stats()["prefix_cache"]["prefilled_tokens"] - was == QUESTION
    assert_pool_whole(server.wait_idle())


def test_a_request_that_read_its_document_whole_keeps_no_turn(servers, trace: Path, demo_model_path: str) -> None:
    """A turn holds its question and answer as computed against its document's entries, which its
    key names: a request that read its document whole computed them against the exact document,
    and keeps none. Where prompts are read whole, neither the first turn (its document's
    publisher) nor a turn that extends the conversation beside its extension exact keeps one:
    each next turn reads the last question and answer again after the last document, and answers
    exactly as a dense reference reading that document's entries (10x further off without them).
    Where documents are cut between chunks, a request asking for its prompt's log-probabilities
    (it reads its prompt whole) keeps none either: the next turn reads its question and answer
    after the document."""

    def published(out: dict) -> dict:
        [event] = [e for e in trace_events(trace, out["meta_info"]["id"]) if e["moment"] == "document"]
        return event

    whole, tail = servers["whole"], _tokens(6302, TAIL)
    before = _documents(whole)
    first, prompt1, _ = _turn(whole, _tokens(6301, DOC), 6310)
    # each turn declares a budget for its chain, 10 entries a turn beyond the document's: a pass
    # that chooses among the turn's tokens (a ratio keeps a turn whole within the window)
    doc2 = prompt1 + first["output_ids"] + tail
    second, prompt2, prefilled = _turn(whole, doc2, 6311, budget=ENTRIES + 10)
    assert prefilled == len(doc2) - DOC + QUESTION  # after the document: turn 1 kept no turn
    doc3 = prompt2 + second["output_ids"] + tail
    third, prompt3, prefilled = _turn(whole, doc3, 6312, budget=ENTRIES + 20)
    assert prefilled == len(doc3) - len(doc2) + QUESTION  # after turn 2's extension: no turn either
    after = _documents(whole)
    assert after["turns"] == before["turns"] and after["extensions"] == before["extensions"] + 2, after
    # turn 3 saw the chain turn 2 published (its entries as turn 2 computed them after the
    # document's), then its own tokens exact
    root, chain = published(first), published(second)
    error = logprob_error(demo_model_path, prompt3, third, [root, chain])
    err, off = error(), error([root])
    assert err < TOLERANCE and off > 10 * TOLERANCE, (err, off)

    uniform = servers["uniform"]
    doc = _tokens(6320, DOC)
    _turn(uniform, doc, 6321)  # publishes the document
    turns = _documents(uniform)["turns"]
    logprobs, prompt, _ = _turn(uniform, doc, 6322, logprob_start_len=0)
    assert len(logprobs["meta_info"]["input_token_logprobs"]) == len(prompt)
    assert _documents(uniform)["turns"] == turns
    _, _, prefilled = _turn(uniform, prompt + logprobs["output_ids"] + tail, 6323)
    assert prefilled == QUESTION + len(logprobs["output_ids"]) + TAIL + QUESTION
    assert_pool_whole(whole.wait_idle())
    assert_pool_whole(uniform.wait_idle())


REPLY = 150  # output tokens: past the row's budget + buffer (40 + 16 + 128) after 12 question tokens


@pytest.mark.parametrize("name", ["uniform", "variable"])
def test_a_reply_compacted_during_decode_is_where_the_next_turn_starts(
    servers, name: str, trace: Path, demo_model_path: str
) -> None:
    """A request that declared a document compacts its row while it decodes (R-KV, its own
    budget): its row no longer holds the document's entries and its question and answer exact,
    so it keeps no turn; at release its kept entries become a document of their own (a reply,
    over what its last pass covered) and what it decoded since a turn after it. The next turn
    starts from them, prefills only the answer's last token, the template's tail and its
    question, and answers as a dense reference that replays the first request's compactions;
    it compresses the reply and its own turn again (KVzip over them all: a rebuild, repeating only
    what the first request's document did not cover, whose scores its entries carry), which the
    next request on that conversation starts from exactly. A request of other decode settings
    never starts from the reply. A failure while the reply is kept loses it only. The pool adds
    up after flushing; another tenant's answer is unchanged.
    (`whole` is left out: its context length, 192, is below what this reply needs.)"""
    server = servers[name]
    tenant = _tokens(6100, DOC + QUESTION)
    quiet = generate(server, tenant, 4)["output_ids"]
    doc, tail = _tokens(6101, DOC), _tokens(6102, TAIL)
    rkv = {"policy": "rkv", "prompt_policy": "kvzip", "budget": 16}
    before = _documents(server)

    def ask(document: list[int], seed: int, n: int = 4, budget: int = 16, **extra) -> tuple[dict, list[int], int]:
        was = server.stats()["prefix_cache"]["prefilled_tokens"]
        prompt = document + _tokens(seed, QUESTION)
        spec = {**rkv, "budget": budget, "document": {"tokens": len(document), "budget": 40}}
        out = generate(server, prompt, n, sampling={"custom_params": {"sgl_kvc": spec}}, **extra)
        return out, prompt, server.stats()["prefix_cache"]["prefilled_tokens"] - was

    def events(out: dict, moment: str) -> list[dict]:
        return [e for e in trace_events(trace, out["meta_info"]["id"]) if e["moment"] == moment]

    first, prompt1, _ = ask(doc, 6110, REPLY)
    (root,), decoded = events(first, "document"), events(first, "decode")
    assert decoded, "the reply was not compacted while it decoded"
    end1 = len(prompt1) + REPLY - 1
    after1 = _documents(server)
    assert after1["replies"] == before["replies"] + 1 and after1["turns"] == before["turns"] + 1, after1

    doc2 = prompt1 + first["output_ids"] + tail
    # What the reply keeps, its decode settings decided (a budget of 16): a request of other
    # settings in the same namespace never starts from it (nor from what is made from it), but
    # from the document under it, reading the rest itself.
    other, _, prefilled = ask(doc2, 6118, budget=24)
    assert other["meta_info"]["cached_tokens"] == DOC and prefilled == len(doc2) - DOC + QUESTION, prefilled
    after1 = _documents(server)
    repeated = server.stats()["compression"]["reconstruction"]["context_tokens"]
    second, prompt2, prefilled = ask(doc2, 6111)
    assert prefilled == 1 + TAIL + QUESTION and second["meta_info"]["cached_tokens"] == end1, prefilled
    after2 = _documents(server)
    assert after2["rebuilds"] == after1["rebuilds"] + 1, after2
    # KVzip repeated only what the reply's document did not cover (its entries carry its scores)
    repeated = server.stats()["compression"]["reconstruction"]["context_tokens"] - repeated
    assert 0 < repeated <= len(doc2) - DOC, repeated
    (rebuilt,) = events(second, "document")
    # its question read from what it rebuilt, as a later request with that document reads it
    err = logprob_error(demo_model_path, prompt2, second, [root, *decoded, rebuilt])()
    print(f"turn 2 after a compacted reply: max |logprob error| {err:.2e}")
    assert err < TOLERANCE
    kept = [set(head) for layer in rebuilt["kept_positions"] for head in layer]
    assert max(map(max, kept)) < len(doc2) and min(map(min, kept)) < DOC  # among them all

    # the same conversation, another question: from the rebuilt document, exactly
    again, prompt, prefilled = ask(doc2, 6112)
    assert prefilled == QUESTION and again["meta_info"]["cached_tokens"] == len(doc2)
    error = logprob_error(demo_model_path, prompt, again, [root, *decoded, rebuilt])
    err, unrebuilt = error(), error([root, *decoded])
    print(f"a hit on the rebuilt reply: max |logprob error| {err:.2e}; from the reply {unrebuilt:.3f}")
    assert err < TOLERANCE and unrebuilt > 10 * TOLERANCE

    # its prefill pass cut the first request's row too (a budget of 8 below its question): the
    # reply's entries carry that pass's scores, and the next turn again repeats only the answer
    doc = _tokens(6115, DOC)
    first, prompt1, _ = ask(doc, 6116, REPLY, budget=8)
    assert events(first, "prefill") and events(first, "decode")
    repeated = server.stats()["compression"]["reconstruction"]["context_tokens"]
    doc2 = prompt1 + first["output_ids"] + tail
    _, _, prefilled = ask(doc2, 6117, budget=8)
    repeated = server.stats()["compression"]["reconstruction"]["context_tokens"] - repeated
    assert prefilled == 1 + TAIL + QUESTION and 0 < repeated <= 2 * (len(doc2) - DOC), repeated

    # a failure while the reply is kept loses it only: its next turn reads its extension itself
    replies = _documents(server)["replies"]
    failed, prompt3, _ = ask(doc, 6113, REPLY, rid=f"failpoint-turn-reply-{name}")
    assert len(failed["output_ids"]) == REPLY and _documents(server)["replies"] == replies
    _, _, prefilled = ask(prompt3 + failed["output_ids"] + tail, 6114)
    assert prefilled == QUESTION + REPLY + TAIL + QUESTION

    assert server.post("/flush_cache?timeout=30", json={}).status_code == 200
    docs = _documents(server)
    assert docs["resident"] == 0 and docs["turns_resident"] == 0, docs
    assert_pool_whole(server.wait_idle())
    assert generate(server, tenant, 4)["output_ids"] == quiet


def test_a_kvzip_request_on_uniform_head_budgets_is_warned(servers) -> None:
    """The README's chat-over-an-upload request (a KVzip document) on a server whose heads all keep
    the same number of entries is served, and its response says in a header that KVzip keeps one set
    of tokens for every head there (docs/quality.md); on the variable server, no such header, and a
    request whose prompt policy is not KVzip gets none either."""
    from openai import OpenAI

    text = " ".join(f"Fact {i}: the {w} is {i * 7 % 13}." for i, w in enumerate(["river", "lamp", "seed"] * 6))
    messages = [{"role": "user", "content": text}, {"role": "user", "content": "What is the lamp?"}]

    def headers(name: str, settings: dict) -> dict:
        client = OpenAI(base_url=servers[name].url + "/v1", api_key="-")
        raw = client.chat.completions.with_raw_response.create(
            model="demo", max_tokens=2, temperature=0, messages=messages, extra_body={"kv_compression": settings})
        assert raw.parse().usage.completion_tokens == 2
        return raw.headers

    kvzip = {"prompt_policy": "kvzip", "document": {"ratio": 0.3}}
    assert "--kv-head-budget policy" in headers("uniform", kvzip).get("x-sgl-kvc-warning", "")
    assert "x-sgl-kvc-warning" not in headers("variable", kvzip)
    assert "x-sgl-kvc-warning" not in headers("uniform", {"prompt_policy": "snapkv"})
