"""Seeded prompt generator: the same seed and stream id give the same requests, in order.

Scenarios:
  short          a short question, a short answer (chat traffic)
  shared_prefix  a long system prompt shared by every user, then a varied question
                 (the radix cache computes the prefix once and reuses it); with
                 `system_prompts` > 1, each request draws one of that many system prompts
                 (several applications behind one endpoint: what prefix-aware routing sorts)
  long_gen       a short question, `ignore_eos` and a fixed `max_tokens` (reasoning-style
                 long outputs, where KV-cache compression matters)
  shared_documents  one of `system_prompts` long documents (`document_words` words) as the first
                 message, then a question about it; with `document_ratio` > 0 the request asks
                 sgl-kvc to keep the document compressed and shared (`kv_compression.document`;
                 0 for a server without sgl-kvc's compression)
  conversations  multi-turn chat over one of `system_prompts` documents: turn 1 is the document
                 and a question, each later turn resends every earlier message, the server's own
                 answers included (`reply`), and one new question, as a chat client does; after
                 `turns` turns (or a failed one) the user starts a new conversation. With
                 `document_ratio` > 0 each turn declares every message but the last as its
                 document (`kv_compression.document`)
  mix            a weighted draw of short, shared_prefix and long_gen, from the same seeded stream
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

SCENARIOS: tuple[str, ...] = ("short", "shared_prefix", "long_gen", "shared_documents", "conversations", "mix")
MIX_WEIGHTS: dict[str, float] = {"short": 0.5, "shared_prefix": 0.3, "long_gen": 0.2}

# Words the demo model's tokenizer was trained on, so prompts tokenize compactly.
_NOUNS = (
    "cache memory token prompt answer model attention layer river valley bridge school "
    "library orchestra violin planet fraction equation integer server request policy budget "
    "window tree branch prefix weather barley honey bread mountain monastery symphony"
).split()
_TOPICS = (
    "the KV cache|a radix tree|eight-bit floating point|attention sinks|the weather in the valley|"
    "the old stone bridge|a quadratic equation|the sum of the first hundred integers|"
    "the first notes of the symphony|heavy hitters|a window of recent tokens|good software"
).split("|")
_TEMPLATES = (
    "Explain {topic} in two sentences.",
    "How does {topic} relate to the {noun}?",
    "Write a short note about {topic} and the {noun}.",
    "What would change if the {noun} were twice as large?",
    "Compare {topic} with the {noun} and the {noun2}.",
    "Summarise what you know about {topic}.",
)


@dataclass(frozen=True)
class ChatRequest:
    """One chat completion to send: the body fields that vary between requests."""

    scenario: str
    messages: tuple[dict[str, str], ...]
    max_tokens: int
    ignore_eos: bool = False
    extra: tuple[tuple[str, Any], ...] = ()  # more body fields (sgl-kvc's kv_compression)
    turn: int = 0  # conversations: the turn number, from 1; 0 in the other scenarios

    def body(self, model: str) -> dict[str, Any]:
        """The JSON body of a streaming `/v1/chat/completions` request."""
        out: dict[str, Any] = {
            "model": model,
            "messages": list(self.messages),
            "max_tokens": self.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.0,
        }
        if self.ignore_eos:
            out["ignore_eos"] = True  # SGLang extension: generate exactly max_tokens tokens
        out.update(dict(self.extra))
        return out


@dataclass(frozen=True)
class PromptSettings:
    """Shapes of the generated requests (lengths in words or tokens)."""

    seed: int = 0
    short_max_tokens: int = 48
    system_prompt_words: int = 400
    shared_max_tokens: int = 32
    long_max_tokens: int = 256
    long_prompt_words: int = 0  # long_gen: pad the question with distinct sentences to this length
    system_prompts: int = 1  # shared_prefix: how many different system prompts requests draw from
    document_words: int = 1500  # shared_documents: words of each document
    document_ratio: float = 0.3  # shared_documents, conversations: kv_compression.document's ratio (0: none asked)
    turns: int = 4  # conversations: turns before a user starts a new conversation
    mix_weights: dict[str, float] = field(default_factory=lambda: dict(MIX_WEIGHTS))


def _sentence(rng: random.Random) -> str:
    return rng.choice(_TEMPLATES).format(
        topic=rng.choice(_TOPICS), noun=rng.choice(_NOUNS), noun2=rng.choice(_NOUNS)
    )


def system_prompt(seed: int, words: int, index: int = 0) -> str:
    """A long system prompt of the shared_prefix scenario: fixed by the seed and its index (the
    first one, index 0, is the one the scenario always used)."""
    rng = random.Random(f"system:{seed}" if index == 0 else f"system:{seed}:{index}")
    out: list[str] = ["You are a careful assistant. Background notes follow."]
    count = len(out[0].split())
    while count < words:
        s = _sentence(rng)
        out.append(s)
        count += len(s.split())
    return " ".join(out)


class PromptGenerator:
    """An endless, repeatable stream of `ChatRequest`s for one scenario and one stream id."""

    def __init__(self, scenario: str, settings: PromptSettings, stream_id: int = 0) -> None:
        if scenario not in SCENARIOS:
            raise ValueError(f"unknown scenario {scenario!r}; choose one of {SCENARIOS}")
        self.scenario = scenario
        self.settings = settings
        self._rng = random.Random(f"stream:{settings.seed}:{stream_id}")
        if settings.system_prompts < 1:
            raise ValueError(f"system_prompts must be at least 1, got {settings.system_prompts}")
        if settings.turns < 1:
            raise ValueError(f"turns must be at least 1, got {settings.turns}")
        self._systems = [
            system_prompt(settings.seed, settings.system_prompt_words, i)
            for i in range(settings.system_prompts)
        ]
        # conversations: the messages so far (the last one a question awaiting its `reply`)
        self._history: list[dict[str, str]] = []
        self._answered = False

    def __iter__(self) -> "PromptGenerator":
        return self

    def __next__(self) -> ChatRequest:
        kind = self.scenario
        if kind == "mix":
            names = list(self.settings.mix_weights)
            weights = [self.settings.mix_weights[n] for n in names]
            kind = self._rng.choices(names, weights=weights)[0]
        return getattr(self, "_" + kind)()

    def _question(self, sentences: int) -> str:
        return " ".join(_sentence(self._rng) for _ in range(sentences))

    def _short(self) -> ChatRequest:
        q = self._question(self._rng.randint(1, 2))
        messages = ({"role": "user", "content": q},)
        return ChatRequest("short", messages, self.settings.short_max_tokens)

    def _shared_prefix(self) -> ChatRequest:
        system = self._systems[0]
        if len(self._systems) > 1:
            system = self._systems[self._rng.randrange(len(self._systems))]
        messages = (
            {"role": "system", "content": system},
            {"role": "user", "content": self._question(1)},
        )
        return ChatRequest("shared_prefix", messages, self.settings.shared_max_tokens)

    def _document(self) -> dict[str, str]:
        """One of the `system_prompts` documents, drawn, as the first message of a request."""
        index = self._rng.randrange(self.settings.system_prompts)
        return {"role": "user", "content": system_prompt(self.settings.seed + 1, self.settings.document_words, index)}

    def _document_extra(self) -> tuple[tuple[str, Any], ...]:
        """The body field that asks for everything but the last message as a shared document."""
        if self.settings.document_ratio <= 0:
            return ()
        return (("kv_compression", {"document": {"ratio": self.settings.document_ratio}}),)

    def _shared_documents(self) -> ChatRequest:
        messages = (self._document(), {"role": "user", "content": self._question(1)})
        return ChatRequest("shared_documents", messages, self.settings.shared_max_tokens,
                           extra=self._document_extra())

    def reply(self, text: str | None) -> None:
        """The server's answer to the last request (None: it failed). A conversation goes on from
        its answer; a failed turn ends it, as a client would start over."""
        if self.scenario != "conversations" or not self._history:
            return
        if text is None:
            self._history = []
            return
        self._history.append({"role": "assistant", "content": text})
        self._answered = True

    def _conversations(self) -> ChatRequest:
        turn = sum(m["role"] == "user" for m in self._history)  # the document counts as one
        if not self._answered or turn > self.settings.turns:
            self._history, turn = [self._document()], 1
        self._history.append({"role": "user", "content": self._question(1)})
        self._answered = False
        return ChatRequest("conversations", tuple(self._history), self.settings.shared_max_tokens,
                           extra=self._document_extra(), turn=turn)

    def _long_gen(self) -> ChatRequest:
        q = self._question(1)
        while len(q.split()) < self.settings.long_prompt_words:
            q += " " + self._question(1)
        q += " Think step by step."
        return ChatRequest(
            "long_gen", ({"role": "user", "content": q},), self.settings.long_max_tokens, True
        )
