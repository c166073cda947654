"""What the compressor counts: `CompressionStats` (read by `/v1/kvc/stats`) and, when SGLang
runs with `--enable-metrics`, the same events as Prometheus counters.

SGLang serves `/metrics` from the HTTP process in prometheus_client's multi-process mode
(`PROMETHEUS_MULTIPROC_DIR`, set before the scheduler starts), so counters created here in the
scheduler process appear there next to SGLang's own `sglang:*` metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner


@dataclass
class CompressionStats:
    passes: int = 0
    evicted_tokens: int = 0  # slots given back by compactions (a slot holds one token's entries of every layer and head)
    seconds: float = 0.0
    prefill_passes: int = 0
    chunk_passes: int = 0  # between two chunks of a long prompt
    decode_passes: int = 0
    preempt_passes: int = 0
    avoided_retractions: int = 0
    retractions: int = 0
    skipped: int = 0
    failed_requests: int = 0  # requests aborted because sgl-kvc raised while handling them
    max_step_seconds: float = 0.0  # the longest compression work in one scheduler step: the worst stall
    staged_passes: int = 0  # passes spread over several scheduler steps (--kv-pass-work)
    max_compacted_together: int = 0  # most requests compacted by one batched move (same step)
    max_row_slots: int = 0  # the longest row a compaction found: what one compressing request held at most
    moments_declined: int = 0  # prompts scored from the observation window: every moment slot was taken


class CompressionMetrics:
    def __init__(self, labels: dict[str, str]) -> None:
        from prometheus_client import Counter, Gauge

        names = list(labels)
        self._labels = labels
        self.passes = Counter(
            "sgl_kvc:compression_passes_total", "KV-cache compressions, by moment",
            names + ["moment"],
        )
        self.evicted = Counter(
            "sgl_kvc:evicted_tokens_total", "KV slots (token x every layer and head) given back by compression", names
        )
        self.seconds = Counter(
            "sgl_kvc:compression_seconds_total", "Seconds spent compressing", names
        )
        self.avoided = Counter(
            "sgl_kvc:avoided_retractions_total",
            "Decode steps where compression made room and no request was retracted", names,
        )
        self.retractions = Counter(
            "sgl_kvc:retractions_total", "Requests retracted (preempted) by the scheduler", names
        )
        self.documents = Counter(
            "sgl_kvc:documents_total", "Shared documents: compressed and published, hit, evicted",
            names + ["event"],
        )
        self.resident = Gauge(
            "sgl_kvc:documents_resident", "Compressed documents in the prefix cache", names, multiprocess_mode="mostrecent"
        )
        self.document_entries = Gauge(
            "sgl_kvc:document_entries", "Entries per (layer, KV head) the resident documents hold", names,
            multiprocess_mode="mostrecent",
        )

    def compressed(self, moment: str, evicted: int) -> None:
        self.passes.labels(**self._labels, moment=moment).inc()
        self.evicted.labels(**self._labels).inc(evicted)

    def spent(self, seconds: float) -> None:
        """Compression work of one scheduler step (a staged pass spends over several)."""
        self.seconds.labels(**self._labels).inc(seconds)

    def document(self, event: str, resident: int, entries: int) -> None:
        """A document was compressed, hit or evicted; what is resident after it."""
        self.documents.labels(**self._labels, event=event).inc()
        self.resident.labels(**self._labels).set(resident)
        self.document_entries.labels(**self._labels).set(entries)

    def avoided_retraction(self) -> None:
        self.avoided.labels(**self._labels).inc()

    def retracted(self, n: int) -> None:
        if n:
            self.retractions.labels(**self._labels).inc(n)


def maybe_metrics(model_runner: ModelRunner, policy: str) -> CompressionMetrics | None:
    server_args = getattr(model_runner, "server_args", None)
    if not getattr(server_args, "enable_metrics", False):
        return None
    from sgl_kvc.adapter.safety.tp import tp_rank

    return CompressionMetrics({"policy": policy, "tp_rank": str(tp_rank())})
