"""The project's own settings: one frozen dataclass, the single source of CLI defaults.

The launcher parses these flags, removes them from the argument list it hands to SGLang, and
passes the resulting `KvcConfig` to SGLang's worker processes through one environment variable
(they are separate interpreters; SGLang's own `ServerArgs` has no room for foreign fields).
Policy hyper-parameter defaults come from `PolicyParams` (the policy core) and nowhere else.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any

from sgl_kvc.core.reconstruction import CHUNK
from sgl_kvc.policies import (
    AUTO,
    BUDGET_MODES,
    DEFAULT_SELECTION,
    RKV_EXEMPTIONS,
    SELECTIONS,
    PolicyParams,
    available_policies,
    canonical_policy,
    decode_policies,
    policy_class,
    prompt_policy_error,
    prompt_policy_name,
)

ENV_VAR = "SGLKVC_CONFIG"
MOMENTS: tuple[str, ...] = ("prefill", "chunk", "chunk-always", "decode", "preempt")
# Between two chunks a prompt is cut back before its end (the question) is read, which costs
# answers (docs/quality.md, "Prompts compressed between chunks"): `chunk` does it only when the
# next chunk would not otherwise fit (`adapter/scheduling/chunk_pressure.py`), `chunk-always` after every
# chunk over the budget.
DEFAULT_MOMENTS: tuple[str, ...] = ("prefill", "chunk", "decode", "preempt")
FP8_KV_DTYPES: tuple[str, ...] = ("fp8_e4m3", "fp8_e5m2")  # served by sgl-kvc's FP8 pool
DECODE_ATTENTION: tuple[str, ...] = ("batched", "batched-float32", "sglang")
# The values of `--kv-decode-attention` whose decode attention is sgl-kvc's kernel.
KERNEL_DECODE_ATTENTION: tuple[str, ...] = ("batched", "batched-float32")
# The observation window of a pass that cuts a prompt between its chunks (`--kv-chunk-window`):
# its question's queries, from one forward of the prompt's end (`core/reconstruction.QUESTION_TOKENS`),
# or the chunk's.
CHUNK_WINDOWS: tuple[str, ...] = ("question", "chunk")
# A shared document that begins with a resident one starts from it (`--kv-document-extend`,
# adapter/documents/matching.py), or is read whole.
DOCUMENT_EXTENDS: tuple[str, ...] = ("resident", "off")
# Seconds at most a request waits for another to publish the shared document it declares
# (`--kv-document-wait`); a waiter that reaches it reads the document itself (adapter/documents/__init__.py).
DEFAULT_DOCUMENT_WAIT = 10.0
# Compressed documents at most in one chain (`--kv-document-depth`): a client must not grow one
# without bound (each link is a node, and a request starting from a chain reads every link's
# tables); the next turn of a chain that deep compresses it again as one.
DEFAULT_DOCUMENT_DEPTH = 16
# Entries per (layer, KV head) a conversation's chain holds at most beyond what compressing it anew
# would keep (`--kv-turn-window`): its latest turns, kept whole (`ExtensionRule.entries`). 256: the
# default set's eight turns of about 40 tokens each stay within it (docs/quality.md, Conversations).
DEFAULT_TURN_WINDOW = 256
MAX_TURN_WINDOW = 1 << 20
# Each link of a chain holds the chain's links above it (`documents/links.py`: flat, no walk), so a
# chain's references grow with the square of its depth: bounded here, whatever an operator asks.
MAX_DOCUMENT_DEPTH = 1024
# `--kv-head-budget auto`: the launcher picks `policy` where the unit pool can serve, else `uniform`.
HEAD_BUDGET_AUTO = "auto"
# `--kv-decode-graphs`: decode steps from SGLang's CUDA graphs for a policy whose decode keeps no
# attention statistics (`core/graph_step.py`), or eagerly, with SGLang's graphs off.
DECODE_GRAPHS: tuple[str, ...] = ("off", "on")
_P = PolicyParams()


def _flag(help: str, **extra: Any) -> dict[str, Any]:
    return {"help": help, **extra}


@dataclass(frozen=True)
class KvcConfig:
    """sgl-kvc settings for one server. Field metadata `help` becomes the flag's help line."""

    policy: str = field(
        default="none",
        metadata=_flag("KV-cache eviction policy; 'none' behaves exactly like plain SGLang."),
    )
    prompt_policy: str = field(
        default=AUTO,
        metadata=_flag(
            "Policy that compresses prompts (after prefill, and between chunks); --policy compresses "
            "the generated tokens (decode, preempt). auto: the one --policy names, SnapKV for rkv "
            "(a decode-time method), else --policy itself."
        ),
    )
    kv_budget: int = field(
        default=_P.budget,
        metadata=_flag("Entries each (layer, KV head) keeps after a compression (with --kv-selection "
                       "shared: tokens per request)."),
    )
    kv_selection: str = field(
        default=DEFAULT_SELECTION,
        metadata=_flag(
            "per-head: every (layer, KV head) keeps its own best tokens, as the papers do; "
            "shared: one kept set per request (scores averaged over heads and layers)."
        ),
    )
    kv_head_budget: str = field(
        default=HEAD_BUDGET_AUTO,
        metadata=_flag(
            "Per-head selection's budget: uniform (every (layer, KV head) keeps --kv-budget "
            "tokens; KVzip keeps the same tokens in every head), policy (the unit pool: KVzip sorts "
            "every head at once, as its paper does; every other policy keeps --kv-budget per head, "
            "as under uniform, and decodes as fast), layer (Ada-SnapKV: one sort per layer, each "
            "layer keeping --kv-budget x KV heads) or variable (KV-Compress: the request keeps "
            "--kv-budget x layers x KV heads entries in all, one sort over layer x head x token for "
            "KV-Compress, per layer for the attention sums of the others). KVzip sorts every head at "
            "once under policy, layer and variable, which need one rank, the torch_native or triton "
            "backend and batched decode attention. auto (the default): policy where the server can "
            "have it (and the model's config.json names no logit cap nor sliding-window layers), "
            "else uniform; the launcher says which in one line."
        ),
    )
    kv_pass_work: int = field(
        default=3 << 16,  # a short stall per step; what it costs: docs/architecture.md, "Staged passes"
        metadata=_flag(
            "Compression work per scheduler step (cost units: one cached token scored in one "
            "layer by a linear-cost policy; R-KV's redundancy costs more per token). A per-head "
            "pass over more is spread over several steps, which bounds the stall a long prompt "
            "causes; 0 runs every pass in the step it is due."
        ),
    )
    kv_chunk_keep: float = field(
        default=1.0,
        metadata=_flag(
            "A pass between two chunks of a prompt keeps this many times the budget; the pass after "
            "its last chunk, which has read the question, cuts it to the budget (1: the budget)."
        ),
    )
    kv_decode_attention: str = field(
        default="batched",
        metadata=_flag(
            "Decode attention of a compressing server on SGLang's CPU backend: batched (sgl-kvc's "
            "kernel, one padded computation per layer, whose attention also feeds the statistics "
            "policies; a request that holds nothing compressed is attended as SGLang attends it, bit "
            "for bit in bfloat16), batched-float32 (the kernel for every request, its softmax in "
            "float32: within the dtype's rounding of SGLang's, not bit for bit) or sglang (SGLang's "
            "loop over requests). Other backends keep their own."
        ),
    )
    kv_chunk_window: str = field(
        default="question",
        metadata=_flag(
            "Observation window of a pass that cuts a prompt between two chunks, before its "
            "question is read (SnapKV, R-KV, KV-Compress, Expected Attention): question (one extra "
            "forward reads the prompt's last 64 tokens after what it holds, and its last --kv-window "
            "queries choose, as after its last chunk) or chunk (the last queries of the chunk read)."
        ),
    )
    kv_budget_ratio: float | None = field(
        default=None,
        metadata=_flag("Instead of --kv-budget: keep this fraction of the request's length."),
    )
    kv_buffer: int = field(
        default=_P.buffer,
        metadata=_flag("Decode tokens allowed above the budget before compressing again."),
    )
    kv_window: int = field(
        default=_P.window, metadata=_flag("Observation queries (R-KV alpha, SnapKV w).")
    )
    kv_keep_recent: int = field(
        default=_P.keep_recent,
        metadata=_flag(
            "Most recent tokens always kept by R-KV, SnapKV, KV-Compress, Expected Attention and "
            "KeyDiff, when more than --kv-window (0: the observation window only, as the papers "
            "do). Unlike a larger --kv-window it leaves the observation queries as they are."
        ),
    )
    rkv_lambda: float = field(
        default=_P.rkv_lambda, metadata=_flag("R-KV importance/redundancy trade-off (eq. 7).")
    )
    rkv_exemption: str = field(
        default=_P.rkv_exemption,
        metadata=_flag(
            "R-KV: whose mean similarity drops a token's similarity to its most recent similar "
            "token: own (Algorithm 1) or recent (the public code; the newest of similar tokens "
            "is the least redundant)."
        ),
    )
    sink_tokens: int = field(
        default=_P.sink_tokens,
        metadata=_flag("Attention-sink tokens kept by StreamingLLM and Expected Attention."),
    )
    compress_on: tuple[str, ...] = field(
        default=DEFAULT_MOMENTS,
        metadata=_flag(
            "When to compress (comma separated): prefill (after a prompt's last chunk), decode, "
            "preempt, and chunk (between two chunks of a long prompt, only when its next chunk "
            "would not fit the memory left: prompts longer than the pool are served). "
            "chunk-always instead compresses after every chunk (Batch-Max: a prompt never holds "
            "more than budget + one chunk, and forgets more of what its end asks for)."
        ),
    )
    kvzip_chunk: int = field(
        default=CHUNK,
        metadata=_flag(
            "KVzip (--prompt-policy kvzip): context tokens its reconstruction pass repeats per "
            "forward; what one forward holds beside the request, reserved at admission."
        ),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=_flag(
            "KV cache storage (SGLang's flag): fp8_e4m3 / fp8_e5m2 select sgl-kvc's FP8 pool with "
            "one scale per (token, KV head); any other value is passed to SGLang as it is."
        ),
    )
    kv_cache_memory_gb: float | None = field(
        default=None,
        metadata=_flag(
            "Fixed KV pool budget in GB (codes and scales), instead of profiling free memory; "
            "without --max-total-tokens the pool holds as many tokens as fit."
        ),
    )
    # How long another tenant's request may hold one back (docs/safety.md): the publisher's
    # prompt, hence its prefill, is of its own tenant's choosing.
    kv_document_wait: float = field(
        default=DEFAULT_DOCUMENT_WAIT,
        metadata=_flag(
            "Seconds at most a request waits for another request in flight to publish the shared "
            "document it declares (kv_compression.document); after, it reads the document itself. "
            "0: it never waits."
        ),
    )

    kv_document_extend: str = field(
        default="resident",
        metadata=_flag(
            "A request whose shared document begins with a resident one (a conversation's next "
            "turn): resident (it starts from the longest such document, reads only the rest, and "
            "publishes the rest's entries as an extension of it) or off (its document is read and "
            "compressed whole)."
        ),
    )
    kv_decode_graphs: str = field(
        default="off",
        metadata=_flag(
            "on: decode steps replay SGLang's CUDA graphs (prefill graphs stay off), for a --policy "
            "whose decode keeps no attention statistics; a step holding a request whose policy keeps "
            "them (h2o, batchmax, kvcompress) decodes eagerly. On a CPU the same decode step runs "
            "eagerly (there are no graphs). off: a compressing server decodes eagerly, SGLang's "
            "graphs off."
        ),
    )
    kv_document_depth: int = field(
        default=DEFAULT_DOCUMENT_DEPTH,
        metadata=_flag(
            "The most compressed documents one chain holds (a conversation's document and its "
            "extensions): the next turn of a chain that deep compresses it again as one document."
        ),
    )
    kv_turn_window: int = field(
        default=DEFAULT_TURN_WINDOW,
        metadata=_flag(
            "Entries per head a conversation kept compressed from turn to turn holds beyond what "
            "compressing it anew keeps (a document's ratio of all its tokens): its latest turns are "
            "kept whole up to it; the turn past it compresses the chain again to that ratio. 0: "
            "every turn compresses its chain again."
        ),
    )

    def __post_init__(self) -> None:
        # An earlier policy name (e.g. avgattn) is stored as the policy's name.
        object.__setattr__(self, "policy", canonical_policy(self.policy))
        object.__setattr__(self, "prompt_policy", canonical_policy(self.prompt_policy))
        choices = available_policies()
        if self.policy not in decode_policies():
            what = "a prompt policy (it compresses prompts only: --prompt-policy)" if self.policy in choices else "unknown policy"
            raise ValueError(f"{what} {self.policy!r}; choose one of {decode_policies()}")
        if self.prompt_policy != AUTO and self.prompt_policy not in choices:
            raise ValueError(f"unknown --prompt-policy {self.prompt_policy!r}; choose auto or one of {choices}")
        why = prompt_policy_error(self.policy, self.prompt_policy)
        if why is not None:
            raise ValueError(f"--prompt-policy {self.prompt_policy} with --policy {self.policy}: {why}")
        if self.kv_decode_attention not in DECODE_ATTENTION:
            raise ValueError(
                f"--kv-decode-attention must be one of {list(DECODE_ATTENTION)}, got {self.kv_decode_attention!r}"
            )
        if self.kv_chunk_window not in CHUNK_WINDOWS:
            raise ValueError(
                f"--kv-chunk-window must be one of {list(CHUNK_WINDOWS)}, got {self.kv_chunk_window!r}"
            )
        if self.kv_document_extend not in DOCUMENT_EXTENDS:
            raise ValueError(
                f"--kv-document-extend must be one of {list(DOCUMENT_EXTENDS)}, got {self.kv_document_extend!r}"
            )
        if self.kv_selection not in SELECTIONS:
            raise ValueError(f"--kv-selection must be one of {list(SELECTIONS)}, got {self.kv_selection!r}")
        if self.kv_decode_graphs not in DECODE_GRAPHS:
            raise ValueError(f"--kv-decode-graphs must be one of {list(DECODE_GRAPHS)}, got {self.kv_decode_graphs!r}")
        if self.kv_head_budget not in (HEAD_BUDGET_AUTO, *BUDGET_MODES):
            raise ValueError(
                f"--kv-head-budget must be one of {[HEAD_BUDGET_AUTO, *BUDGET_MODES]}, got {self.kv_head_budget!r}"
            )
        if self.variable_budget:
            # Heads of a packed request hold different numbers of entries: only sgl-kvc's
            # batched kernel reads them through per-head tables (docs/per-head-eviction.md).
            if self.kv_selection != "per-head":
                raise ValueError(f"--kv-head-budget {self.kv_head_budget} needs --kv-selection per-head")
            if self.kv_decode_attention not in KERNEL_DECODE_ATTENTION:
                raise ValueError(f"--kv-head-budget {self.kv_head_budget} needs --kv-decode-attention batched")
        object.__setattr__(self, "compress_on", tuple(self.compress_on))
        bad = [m for m in self.compress_on if m not in MOMENTS]
        if bad:
            raise ValueError(f"--compress-on: unknown moment(s) {bad}; choose from {list(MOMENTS)}")
        if isinstance(self.kv_pass_work, bool) or not isinstance(self.kv_pass_work, int) or self.kv_pass_work < 0:
            raise ValueError(f"--kv-pass-work must be an integer >= 0, got {self.kv_pass_work!r}")
        if isinstance(self.kv_chunk_keep, bool) or not isinstance(self.kv_chunk_keep, (int, float)) \
                or not 1.0 <= self.kv_chunk_keep <= 64.0:
            raise ValueError(f"--kv-chunk-keep must be a number in [1, 64], got {self.kv_chunk_keep!r}")
        if self.kv_budget_ratio is not None and not 0.0 < self.kv_budget_ratio <= 1.0:
            raise ValueError(f"--kv-budget-ratio must be in (0, 1], got {self.kv_budget_ratio}")
        if isinstance(self.kvzip_chunk, bool) or not isinstance(self.kvzip_chunk, int) or self.kvzip_chunk < 1:
            raise ValueError(f"--kvzip-chunk must be an integer >= 1, got {self.kvzip_chunk!r}")
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ValueError(f"--kv-cache-memory-gb must be > 0, got {self.kv_cache_memory_gb}")
        if isinstance(self.kv_document_depth, bool) or not isinstance(self.kv_document_depth, int) \
                or not 1 <= self.kv_document_depth <= MAX_DOCUMENT_DEPTH:
            raise ValueError(f"--kv-document-depth must be an integer in [1, {MAX_DOCUMENT_DEPTH}], "
                             f"got {self.kv_document_depth!r}")
        if isinstance(self.kv_turn_window, bool) or not isinstance(self.kv_turn_window, int) \
                or not 0 <= self.kv_turn_window <= MAX_TURN_WINDOW:
            raise ValueError(f"--kv-turn-window must be an integer in [0, {MAX_TURN_WINDOW}], "
                             f"got {self.kv_turn_window!r}")
        if isinstance(self.kv_document_wait, bool) or not isinstance(self.kv_document_wait, (int, float)) \
                or not 0.0 <= self.kv_document_wait < float("inf"):
            raise ValueError(f"--kv-document-wait must be a number of seconds >= 0, got {self.kv_document_wait!r}")
        self.policy_params()  # validates budget, buffer, window, lambda, sinks

    @property
    def compressing(self) -> bool:
        return self.policy != "none"

    @property
    def prompt_policy_name(self) -> str:
        """The policy that compresses prompts (`--prompt-policy` resolved)."""
        return prompt_policy_name(self.policy, self.prompt_policy)

    @property
    def chunk_moment(self) -> str | None:
        """How a prompt read in chunks is compressed between them: "always" (`chunk-always`),
        "pressure" (`chunk`: only when its next chunk would not fit), or None."""
        if not self.compressing:
            return None
        if "chunk-always" in self.compress_on:
            return "always"
        return "pressure" if "chunk" in self.compress_on else None

    def chunk_target(self, budget: int) -> int:
        """What a pass between two chunks of a prompt keeps of a request with this budget."""
        return max(budget, int(budget * self.kv_chunk_keep))

    @property
    def variable_budget(self) -> bool:
        """Heads may keep different numbers of entries (`--kv-head-budget policy`, `variable` or
        `layer`), served from the unit pool. `auto` is resolved by the launcher
        (`launcher.head_budget.resolve_head_budget`); a config that reaches a server unresolved is uniform."""
        return self.compressing and self.kv_head_budget not in ("uniform", HEAD_BUDGET_AUTO)

    @property
    def decode_graphs(self) -> bool:
        """Decode steps from CUDA graphs (`--kv-decode-graphs on`, `core/graph_step.py`): on for a
        compressing policy whose decode keeps no attention statistics (`graphs_refusal`)."""
        return self.compressing and self.kv_decode_graphs == "on" and self.graphs_refusal is None

    @property
    def graphs_refusal(self) -> str | None:
        """Why `--kv-decode-graphs on` leaves this server's decode graphs off, or None."""
        if self.kv_decode_graphs != "on" or not self.compressing:
            return None
        if policy_class(self.policy).uses_stats:
            return (f"--policy {self.policy} keeps attention statistics, which a decode step from a CUDA "
                    "graph does not add to yet")
        return None

    @property
    def fp8_kv(self) -> str | None:
        """The FP8 format of sgl-kvc's KV pool, or None (SGLang's own pool)."""
        return self.kv_cache_dtype if self.kv_cache_dtype in FP8_KV_DTYPES else None

    def policy_params(self, budget: int | None = None) -> PolicyParams:
        return replace(
            _P,
            budget=self.kv_budget if budget is None else budget,
            buffer=self.kv_buffer,
            window=self.kv_window,
            keep_recent=self.kv_keep_recent,
            rkv_lambda=self.rkv_lambda,
            rkv_exemption=self.rkv_exemption,
            sink_tokens=self.sink_tokens,
        )

    # --- transport to SGLang's worker processes -------------------------------------------
    def to_env(self) -> None:
        os.environ[ENV_VAR] = json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> "KvcConfig | None":
        """The config the launcher exported, or None when SGLang was started without it: decoded
        once per process (per exported text), since the HTTP hooks ask for it on every request."""
        raw = os.environ.get(ENV_VAR)
        return None if raw is None else _decoded(raw)

    # --- command line ---------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("sgl-kvc")
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            default = f.default if f.default is not MISSING else None
            kwargs: dict[str, Any] = {"default": default, "help": f.metadata.get("help", "")}
            if f.name == "policy":
                kwargs["choices"] = decode_policies()
                kwargs["type"] = canonical_policy  # an earlier name is accepted
            elif f.name == "prompt_policy":
                kwargs["choices"] = [AUTO, *(p for p in available_policies() if p != "none")]
                kwargs["type"] = canonical_policy
            elif f.name in _CHOICES:
                kwargs["choices"] = _CHOICES[f.name]
                kwargs["type"] = str
            elif f.name == "compress_on":
                kwargs["type"] = _moments
                kwargs["default"] = ",".join(DEFAULT_MOMENTS)
            elif f.name in ("kv_budget_ratio", "kv_cache_memory_gb", "kv_chunk_keep", "kv_document_wait"):
                kwargs["type"] = float
            else:
                kwargs["type"] = type(default)
            group.add_argument(flag, dest=f.name, **kwargs)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "KvcConfig":
        values = {f.name: getattr(ns, f.name) for f in fields(cls)}
        if isinstance(values["compress_on"], str):
            values["compress_on"] = _moments(values["compress_on"])
        return cls(**values)


_CHOICES: dict[str, tuple[str, ...]] = {
    "kv_selection": SELECTIONS,
    "kv_decode_attention": DECODE_ATTENTION,
    "kv_chunk_window": CHUNK_WINDOWS,
    "kv_document_extend": DOCUMENT_EXTENDS,
    "kv_decode_graphs": DECODE_GRAPHS,
    "kv_head_budget": (HEAD_BUDGET_AUTO, *BUDGET_MODES),
    "rkv_exemption": RKV_EXEMPTIONS,
}


def _moments(text: str) -> tuple[str, ...]:
    items = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in items if m not in MOMENTS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown moment(s) {bad}; choose from {list(MOMENTS)}")
    return items


@functools.lru_cache(maxsize=1)
def _decoded(raw: str) -> KvcConfig:
    """The config exported as `raw` (frozen, so one instance serves every caller)."""
    return KvcConfig(**json.loads(raw))
