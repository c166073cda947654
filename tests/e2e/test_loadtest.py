"""The load-testing tools (`loadtest/`) and the server under load.

Fast unit tests (no server): the seeded prompt generator, the summary/goodput computation on
synthetic CSVs, the runner's configuration syntax. Live tests (marked e2e) share one server
with a small KV pool (`--max-total-tokens 2048`): a short locust run through the runner, clients
that disconnect mid-stream, and more long generations than the pool holds at once.
"""

from __future__ import annotations

import csv
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest

from kvc_reference import assert_pool_whole
from loadtest import run
from loadtest.metrics import (
    REQUEST_FIELDS,
    Limits,
    read_locust_stats,
    read_requests,
    summarize,
)
from loadtest.prompts import SCENARIOS, PromptGenerator, PromptSettings
from loadtest.report import markdown_table, write_plot
from loadtest.server import ServerProcess

POOL_TOKENS = 2048


# --- unit tests (no server) ---------------------------------------------------------------


def test_prompts_are_repeatable() -> None:
    settings = PromptSettings(seed=7, long_max_tokens=99)
    for scenario in SCENARIOS:
        a, b = PromptGenerator(scenario, settings, 3), PromptGenerator(scenario, settings, 3)
        assert [next(a) for _ in range(20)] == [next(b) for _ in range(20)]
    ref = next(PromptGenerator("short", settings, stream_id=3))
    assert next(PromptGenerator("short", settings, stream_id=4)) != ref  # users differ
    assert next(PromptGenerator("short", PromptSettings(seed=8), stream_id=3)) != ref  # seeds too


def test_prompt_scenarios() -> None:
    settings = PromptSettings(seed=0, long_max_tokens=99, long_prompt_words=120)
    mix = PromptGenerator("mix", settings, stream_id=0)
    drawn = [next(mix) for _ in range(60)]
    assert {r.scenario for r in drawn} == {"short", "shared_prefix", "long_gen"}
    shared = [r for r in drawn if r.scenario == "shared_prefix"]
    assert len({r.messages[0]["content"] for r in shared}) == 1  # one system prompt for all
    assert len({r.messages[1]["content"] for r in shared}) > 1  # varied questions
    conversation = PromptGenerator("conversations", PromptSettings(turns=3), stream_id=2)
    first = next(conversation)
    assert first.turn == 1 and len(first.messages) == 2 and first.messages[0]["content"].startswith("You are")
    assert dict(first.extra)["kv_compression"] == {"document": {"ratio": PromptSettings.document_ratio}}
    conversation.reply("the first answer")
    second = next(conversation)  # everything so far, the server's answer included, and a new question
    assert second.turn == 2 and second.messages[:2] == first.messages
    assert second.messages[2] == {"role": "assistant", "content": "the first answer"}
    assert [m["role"] for m in second.messages] == ["user", "user", "assistant", "user"]
    conversation.reply("the second answer")
    third = next(conversation)
    assert third.turn == 3 and len(third.messages) == 6
    conversation.reply("the third answer")
    assert next(conversation).turn == 1  # after `turns` turns, a new conversation
    conversation.reply(None)  # a failed turn ends its conversation
    restarted = next(conversation)
    assert restarted.turn == 1 and len(restarted.messages) == 2
    plain = next(PromptGenerator("conversations", PromptSettings(document_ratio=0), stream_id=2))
    assert plain.extra == () and plain.messages == first.messages  # the same stream, no document asked
    long = next(PromptGenerator("long_gen", settings, stream_id=1))
    assert long.ignore_eos and long.max_tokens == 99
    assert len(long.messages[0]["content"].split()) >= 120
    body = long.body("m")
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True
    assert "ignore_eos" not in next(PromptGenerator("short", settings)).body("m")
    docs = PromptGenerator("shared_documents", PromptSettings(system_prompts=3, document_words=200), stream_id=0)
    drawn = [next(docs) for _ in range(30)]
    assert len({r.messages[0]["content"] for r in drawn}) == 3  # three documents, asked about in turn
    assert all(len(r.messages[0]["content"].split()) >= 200 for r in drawn)
    assert drawn[0].body("m")["kv_compression"] == {"document": {"ratio": 0.3}}
    plain = next(PromptGenerator("shared_documents", PromptSettings(document_ratio=0)))
    assert "kv_compression" not in plain.body("m")  # for a server without sgl-kvc's compression
    with pytest.raises(ValueError):
        PromptGenerator("nope", settings)


def _write_csv(path: Path, header: list[str], rows: list[list[Any]]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


LOCUST_HEADER = (
    "Type,Name,Request Count,Failure Count,Median Response Time,Average Response Time,"
    "Min Response Time,Max Response Time,Average Content Size,Requests/s,Failures/s,"
    "50%,66%,75%,80%,90%,95%,98%,99%,99.9%,99.99%,100%"
).split(",")


def _locust_row(kind: str, count: int, fails: int, p50: int, p90: int, p99: int) -> list[Any]:
    return [kind, "mix", count, fails, p50, p50, 1, p99, 0, 1.0, 0.0,
            p50, p50, p90, p90, p90, p99, p99, p99, p99, p99, p99]  # fmt: skip


def test_summary_and_goodput_from_synthetic_csv(tmp_path: Path) -> None:
    stats_csv = _write_csv(tmp_path / "locust_stats.csv", LOCUST_HEADER, [
        _locust_row("E2E", 4, 1, 5000, 9000, 9900),
        _locust_row("TTFT", 3, 0, 200, 2500, 3000),
        _locust_row("TPOT", 3, 0, 40, 150, 160),
        _locust_row("ITL", 300, 0, 35, 80, 210),
        ["", "Aggregated", 310, 1, 40, 50, 1, 9900, 0, 31.0, 0.1, *[99] * 11],
    ])  # fmt: skip
    # 10 s window (t=100..110): three successes and one failure. Limits: TTFT 2000, TPOT 100.
    requests_csv = _write_csv(tmp_path / "requests.csv", list(REQUEST_FIELDS), [
        ["short", 100.0, 102.0, 1, 200, 150.0, 40.0, 2000.0, 20, 48, ""],  # good
        ["long_gen", 101.0, 108.0, 1, 200, 2500.0, 30.0, 7000.0, 20, 150, ""],  # TTFT too slow
        ["long_gen", 103.0, 110.0, 1, 200, 300.0, 150.0, 7000.0, 20, 42, ""],  # TPOT too slow
        ["short", 104.0, 104.5, 0, 503, 0.0, 0.0, 500.0, 0, 0, "StreamError: HTTP 503"],
    ])  # fmt: skip
    before = {"prefix_cache": {"prompt_tokens": 1000, "hit_tokens": 100},
              "requests": {"running": 0, "max_running": 2}}  # fmt: skip
    after = {"prefix_cache": {"prompt_tokens": 1400, "hit_tokens": 400},
             "requests": {"running": 0, "max_running": 3}}  # fmt: skip
    s = summarize(stats_csv, requests_csv, Limits(ttft_ms=2000, tpot_ms=100), config="c",
                  scenario="mix", users=2, stats_before=before, stats_after=after)  # fmt: skip
    assert (s.requests, s.failures, s.duration_s) == (3, 1, 10.0)
    assert s.requests_per_s == pytest.approx(0.3)
    assert s.output_tokens_per_s == pytest.approx(24.0)  # (48 + 150 + 42) / 10 s
    assert s.mean_output_tokens == pytest.approx(80.0)
    assert s.goodput_rps == pytest.approx(0.1) and s.goodput_fraction == pytest.approx(0.25)
    assert (s.ttft_p50_ms, s.ttft_p90_ms, s.ttft_p99_ms) == (200, 2500, 3000)
    assert (s.tpot_p50_ms, s.tpot_p99_ms, s.itl_p99_ms) == (40, 160, 210)
    assert s.prefix_hit_rate == pytest.approx(0.75) and s.max_running == 3
    # looser limits: every success is good
    loose = summarize(stats_csv, requests_csv, Limits(ttft_ms=5000, tpot_ms=500), config="c",
                      scenario="mix", users=2)  # fmt: skip
    assert loose.goodput_rps == pytest.approx(0.3) and loose.prefix_hit_rate is None
    assert len(read_requests(requests_csv)) == 4 and set(read_locust_stats(stats_csv)) == {
        "E2E", "TTFT", "TPOT", "ITL"}  # fmt: skip
    table = markdown_table([s, loose])
    assert "| metric | c | c |" in table and "| goodput (% of requests) | 25.0% | 75.0% |" in table
    write_plot([s, loose], tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 1000


def test_runner_config_syntax() -> None:
    c = run.ServerConfig.parse("small=--max-total-tokens 4096 --policy none")
    assert c == run.ServerConfig("small", ("--max-total-tokens", "4096", "--policy", "none"))
    assert run.ServerConfig.parse("plain") == run.ServerConfig("plain", ())
    with pytest.raises(ValueError):
        run.ServerConfig.parse("bad name=--policy none")
    cmd = run.locust_command("http://127.0.0.1:1", run.LoadSettings(users=3), Path("/o"))
    assert cmd[cmd.index("--users") + 1] == "3" and "--headless" in cmd


# --- live server ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_pool_server() -> Iterator[ServerProcess]:
    cmd = [
        sys.executable, "-m", "sgl_kvc.launch", "--model-path", "demo",
        "--max-total-tokens", str(POOL_TOKENS),
    ]
    with ServerProcess.launch(cmd) as server:
        yield server


def _assert_pool_whole(stats: dict) -> None:
    assert stats["requests"]["running"] == 0, stats
    assert_pool_whole(stats)


@pytest.mark.e2e
def test_short_load_through_runner(small_pool_server: ServerProcess, tmp_path: Path) -> None:
    """A short locust run (mix scenario, 4 users): no failures, metrics recorded, nothing leaked."""
    (s,) = run.main([
        "--url", small_pool_server.url, "--name", "live", "--users", "4", "--spawn-rate", "4",
        "--duration", "15", "--scenario", "mix", "--long-max-tokens", "64", "--stop-timeout", "60",
        "--out", str(tmp_path),
    ])  # fmt: skip
    assert s.failures == 0 and s.requests >= 4, s
    assert s.output_tokens_per_s > 0 and s.prefix_hit_rate and s.prefix_hit_rate > 0, s
    assert None not in (s.ttft_p50_ms, s.ttft_p99_ms, s.tpot_p50_ms, s.tpot_p99_ms, s.itl_p99_ms)
    rows = read_locust_stats(tmp_path / "live" / "locust_stats.csv")
    assert set(rows) == {"E2E", "TTFT", "TPOT", "ITL"} and rows["E2E"]["Failure Count"] == "0"
    records = read_requests(tmp_path / "live" / "requests.csv")
    assert records and all(r.ok and r.status == 200 for r in records)
    # usage-based token counts: ignore_eos generations are exactly max_tokens long
    assert all(r.output_tokens == 64 for r in records if r.scenario == "long_gen")
    for name in ("results.md", "results.png", "summaries.json", "live/summary.json"):
        assert (tmp_path / name).is_file(), name
    stats = small_pool_server.wait_idle()
    _assert_pool_whole(stats)


@pytest.mark.e2e
def test_disconnected_streams_are_aborted(small_pool_server: ServerProcess) -> None:
    """Clients that close a stream mid-generation: the requests stop, their KV is freed."""
    import openai

    client = openai.OpenAI(base_url=small_pool_server.url + "/v1", api_key="none",
                           max_retries=0, timeout=60)  # fmt: skip
    model = client.models.list().data[0].id
    max_tokens, n_streams, n_read = 600, 3, 12
    streams, paces = [], []
    for i in range(n_streams):
        sent = time.monotonic()
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Tell a long story number {i}."}],
            max_tokens=max_tokens, stream=True, extra_body={"ignore_eos": True},
        )
        chunks = 0
        for chunk in stream:  # keep `stream` referenced: dropping its iterator closes it too
            chunks += bool(chunk.choices and chunk.choices[0].delta.content)
            if chunks >= n_read:
                break
        paces.append((time.monotonic() - sent) / n_read)  # seconds per text chunk, TTFT included
        streams.append(stream)
    assert small_pool_server.stats()["requests"]["running"] == n_streams
    for stream in streams:
        stream.close()
    t0 = time.monotonic()
    stats = small_pool_server.wait_idle()
    drained_s = time.monotonic() - t0
    # Had they not been aborted: the rest of the generation at stream 0's pace (measured while it
    # ran alone; halved, as a chunk can carry two tokens) would take this long.
    remaining_s = (max_tokens - n_read) * paces[0] / 2
    assert drained_s < min(10.0, remaining_s / 2), (drained_s, remaining_s)
    _assert_pool_whole(stats)


@pytest.mark.e2e
def test_more_users_than_the_pool_holds(small_pool_server: ServerProcess) -> None:
    """Six long ignore_eos generations whose KV together exceeds the pool: some wait in the
    queue, all complete with exactly max_tokens tokens, no 5xx, nothing leaked."""
    import openai

    client = openai.OpenAI(base_url=small_pool_server.url + "/v1", api_key="none",
                           max_retries=0, timeout=180)  # fmt: skip
    model = client.models.list().data[0].id
    users, max_tokens = 6, 192  # ~370 prompt tokens each: 3 fit in the pool at once
    settings = PromptSettings(seed=1, long_max_tokens=max_tokens, long_prompt_words=200)
    reqs = [next(PromptGenerator("long_gen", settings, stream_id=i)) for i in range(users)]

    def send(i: int) -> tuple[int, int, str | None]:
        body = reqs[i].body(model)
        stream = client.chat.completions.create(
            model=model, messages=body["messages"], max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        usage, finish = None, None
        for chunk in stream:
            usage = chunk.usage or usage
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        assert usage is not None
        return usage.prompt_tokens, usage.completion_tokens, finish

    with ThreadPoolExecutor(users) as pool:
        results = list(pool.map(send, range(users), timeout=240))  # raises on any 4xx/5xx
    assert all(done == max_tokens and finish == "length" for _, done, finish in results), results
    demand = sum(p + c for p, c, _ in results)
    assert demand > POOL_TOKENS, demand  # the pool could not hold them all at once
    stats = small_pool_server.wait_idle()
    assert stats["requests"]["max_running"] < users, stats["requests"]  # so some waited
    _assert_pool_whole(stats)


@pytest.mark.e2e
def test_conversations_resend_every_earlier_turn(small_pool_server: ServerProcess, tmp_path: Path) -> None:
    """The conversations scenario against a live server (no document asked: the default server's
    prompt policy, SnapKV, reads a question): each user's turns resend the conversation with the
    server's answers, so a conversation's prompt grows every turn; nothing fails, nothing leaks."""
    (s,) = run.main([
        "--url", small_pool_server.url, "--name", "live", "--users", "2", "--spawn-rate", "2",
        "--duration", "12", "--scenario", "conversations", "--turns", "3", "--document-ratio", "0",
        "--document-words", "300",
        "--stop-timeout", "60", "--out", str(tmp_path),
    ])  # fmt: skip
    records = read_requests(tmp_path / "live" / "requests.csv")
    assert s.failures == 0 and records and all(r.ok for r in records), s
    assert {r.turn for r in records} >= {1, 2}, [r.turn for r in records]
    by_turn = {t: min(r.prompt_tokens for r in records if r.turn == t) for t in {r.turn for r in records}}
    turns = sorted(by_turn)
    # a later turn's prompt holds an earlier one's: its question, the answer and a new question
    assert all(by_turn[a] < by_turn[b] for a, b in zip(turns, turns[1:])), by_turn
    assert sorted(int(t) for t in s.by_turn) == turns and "Per turn" in (tmp_path / "results.md").read_text()
    _assert_pool_whole(small_pool_server.wait_idle())
