"""Locust users for the OpenAI chat API, streaming, with per-request LLM latency metrics.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:30000            # web UI
    locust -f loadtest/locustfile.py --host URL --headless -u 8 -r 2 -t 60s \
        --scenario long_gen --csv out/run

Each request is one streaming `POST /v1/chat/completions` with
`stream_options={"include_usage": true}`. Every completed request fires locust `request`
events, so the numbers land in locust's own statistics and CSV (Type column = metric,
Name column = the `--scenario` of the run, response_time in milliseconds):

  E2E   whole request, response_length = output tokens from the server's `usage`
        (failed requests are recorded here, with the error)
  TTFT  time to the first chunk that carries text
  TPOT  (E2E - TTFT) / (output tokens - 1), per request with at least two output tokens
  ITL   one event per gap between consecutive text-carrying chunks

Output tokens are the server's `usage.completion_tokens`; chunks are not counted (a chunk can
carry several tokens or none, e.g. while a byte-level BPE character is incomplete).
With `--requests-csv PATH` one row per request is also written there (the fields of
`loadtest.metrics.RequestRecord`); the runner computes throughput and goodput from it.

Options added to locust's: --scenario {short,shared_prefix,long_gen,shared_documents,conversations,mix}
(default mix), --prompt-seed, --long-max-tokens, --system-prompts, --document-ratio, --document-words,
--turns, --model (default: the first of GET /v1/models), --requests-csv, --request-timeout.
"""

from __future__ import annotations

import csv
import itertools
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

import requests
from locust import User, constant, events, task
from locust.env import Environment

_REPO = str(Path(__file__).resolve().parent.parent)
if _REPO not in sys.path:  # loaded by path (`locust -f`): make the `loadtest` package importable
    sys.path.insert(0, _REPO)

from loadtest.metrics import REQUEST_FIELDS, RequestRecord
from loadtest.prompts import SCENARIOS, ChatRequest, PromptGenerator, PromptSettings


@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    group = parser.add_argument_group("sgl-kvc load test")
    group.add_argument("--scenario", choices=SCENARIOS, default="mix", help="request mix")
    group.add_argument("--prompt-seed", type=int, default=0, help="seed of the prompt generator")
    group.add_argument(
        "--long-max-tokens", type=int, default=PromptSettings.long_max_tokens,
        help="max_tokens (with ignore_eos) of the long_gen scenario",
    )
    group.add_argument(
        "--system-prompts", type=int, default=PromptSettings.system_prompts,
        help="shared_prefix: number of different system prompts requests draw from; shared_documents, "
             "conversations: of documents",
    )
    group.add_argument(
        "--document-ratio", type=float, default=PromptSettings.document_ratio,
        help="shared_documents, conversations: the ratio documents are compressed to and shared at (0: not asked)",
    )
    group.add_argument("--turns", type=int, default=PromptSettings.turns,
                       help="conversations: turns of each conversation")
    group.add_argument("--document-words", type=int, default=PromptSettings.document_words,
                       help="shared_documents, conversations: words of each document")
    group.add_argument("--model", default="", help="model name (default: first of /v1/models)")
    group.add_argument("--requests-csv", default="", help="also write one row per request here")
    group.add_argument("--request-timeout", type=float, default=300.0, help="read timeout, s")


class _RequestLog:
    """The optional per-request CSV, open for the duration of the test."""

    file: TextIO | None = None
    writer: Any = None

    @classmethod
    def open(cls, path: str) -> None:
        cls.file = open(path, "w", newline="")
        cls.writer = csv.DictWriter(cls.file, fieldnames=REQUEST_FIELDS)
        cls.writer.writeheader()

    @classmethod
    def write(cls, record: RequestRecord) -> None:
        if cls.writer is not None and cls.file is not None:
            cls.writer.writerow(asdict(record))
            cls.file.flush()

    @classmethod
    def close(cls) -> None:
        if cls.file is not None:
            cls.file.close()
        cls.file = cls.writer = None


def _option(env: Environment, name: str, default: Any) -> Any:
    return getattr(env.parsed_options, name, default) if env.parsed_options else default


@events.test_start.add_listener
def _on_test_start(environment: Environment, **_: Any) -> None:
    path = _option(environment, "requests_csv", "")
    if path and _RequestLog.file is None:
        _RequestLog.open(path)


@events.quitting.add_listener
def _on_quitting(environment: Environment, **_: Any) -> None:
    _RequestLog.close()


_models: dict[str, str] = {}
_user_ids = itertools.count()


def discover_model(session: requests.Session, base_url: str) -> str:
    """The first model the server lists at GET /v1/models (cached per host)."""
    if base_url not in _models:
        r = session.get(base_url + "/v1/models", timeout=30)
        r.raise_for_status()
        _models[base_url] = r.json()["data"][0]["id"]
    return _models[base_url]


class StreamError(Exception):
    """The server answered, but not with a usable stream."""


class ChatUser(User):
    """A closed-loop chat user: sends one streaming request after another, no think time."""

    wait_time = constant(0)

    def on_start(self) -> None:
        env = self.environment
        self.base_url = (self.host or "").rstrip("/")
        self.session = requests.Session()
        self.label: str = _option(env, "scenario", "mix")
        self.timeout: float = _option(env, "request_timeout", 300.0)
        self.model: str = _option(env, "model", "") or discover_model(self.session, self.base_url)
        settings = PromptSettings(
            seed=_option(env, "prompt_seed", 0),
            long_max_tokens=_option(env, "long_max_tokens", PromptSettings.long_max_tokens),
            system_prompts=_option(env, "system_prompts", PromptSettings.system_prompts),
            document_ratio=_option(env, "document_ratio", PromptSettings.document_ratio),
            turns=_option(env, "turns", PromptSettings.turns),
            document_words=_option(env, "document_words", PromptSettings.document_words),
        )
        self.prompts = PromptGenerator(self.label, settings, stream_id=next(_user_ids))

    def on_stop(self) -> None:
        self.session.close()

    @task
    def chat(self) -> None:
        self.send(next(self.prompts))

    def send(self, req: ChatRequest) -> RequestRecord:
        """`_send`, and the answer given back to the prompt generator (a conversation's next turn
        resends it)."""
        texts: list[str] = []
        rec = self._send(req, texts)
        self.prompts.reply("".join(texts) if rec.ok else None)
        return rec

    def _fire(self, metric: str, ms: float, length: int = 0, exc: Exception | None = None) -> None:
        self.environment.events.request.fire(
            request_type=metric, name=self.label, response_time=ms, response_length=length,
            exception=exc, context={"user": self},
        )

    def _send(self, req: ChatRequest, texts: list[str]) -> RequestRecord:
        t_wall, t0 = time.time(), time.perf_counter()
        rec = RequestRecord(req.scenario, t_wall, t_wall, 0, 0, 0.0, 0.0, 0.0, 0, 0, turn=req.turn)
        text_times: list[float] = []
        try:
            with self.session.post(
                self.base_url + "/v1/chat/completions", json=req.body(self.model), stream=True,
                timeout=(10, self.timeout),
            ) as resp:
                rec.status = resp.status_code
                if resp.status_code != 200:
                    raise StreamError(f"HTTP {resp.status_code}: {resp.text[:200]}")
                usage = _read_stream(resp, text_times, texts)
            t_end = time.perf_counter()
            rec.prompt_tokens = int(usage.get("prompt_tokens", 0))
            rec.output_tokens = int(usage["completion_tokens"])
        except Exception as e:  # noqa: BLE001 - every failure is a failed request in locust
            rec.e2e_ms = (time.perf_counter() - t0) * 1000
            rec.t_end = t_wall + rec.e2e_ms / 1000
            rec.error = f"{type(e).__name__}: {e}"[:300]
            self._fire("E2E", rec.e2e_ms, 0, e)
            _RequestLog.write(rec)
            return rec
        rec.ok = 1
        rec.e2e_ms = (t_end - t0) * 1000
        rec.t_end = t_wall + rec.e2e_ms / 1000
        rec.ttft_ms = (text_times[0] - t0) * 1000 if text_times else rec.e2e_ms
        self._fire("E2E", rec.e2e_ms, rec.output_tokens)
        self._fire("TTFT", rec.ttft_ms)
        if rec.output_tokens > 1:
            rec.tpot_ms = (rec.e2e_ms - rec.ttft_ms) / (rec.output_tokens - 1)
            self._fire("TPOT", rec.tpot_ms)
        for a, b in zip(text_times, text_times[1:]):
            self._fire("ITL", (b - a) * 1000)
        _RequestLog.write(rec)
        return rec


def _read_stream(resp: requests.Response, text_times: list[float], texts: list[str]) -> dict[str, Any]:
    """Consume an SSE chat stream; append the arrival time of each text chunk and its answer text
    (`content`) to `texts`; return usage."""
    usage: dict[str, Any] | None = None
    for line in resp.iter_lines():
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise StreamError(f"error in stream: {str(chunk['error'])[:200]}")
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                texts.append(delta["content"])
            if delta.get("content") or delta.get("reasoning_content"):
                text_times.append(time.perf_counter())
                break
    if usage is None or "completion_tokens" not in usage:
        raise StreamError("stream ended without usage (stream_options.include_usage)")
    return usage
