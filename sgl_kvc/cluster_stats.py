"""`/v1/kvc/stats` for a whole cluster: a client, not a server.

A gateway (the SGLang Model Gateway, `smg`) does not forward `/v1/kvc/stats`; it lists its
workers at `GET /workers`. `kvc_stats(url)` answers for whatever `url` is: a worker's own
snapshot, or, for a gateway, the sum over its workers (the same sum a data-parallel server gives
over its ranks, `merge_stats`) with each worker's snapshot under `per_worker`. So the load test
and the benchmarks read a cluster's pool, compression passes, prefix hits and requests in flight
in one place, through the URL they already have.

    python -m sgl_kvc.cluster_stats http://127.0.0.1:30000     # prints the JSON
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests

from sgl_kvc.server.routes import merge_stats

# Keys of a server's answer that describe its own ranks: kept per worker, never summed.
_PER_SERVER_KEYS = ("per_rank", "dp_rank")


def server_stats(url: str, timeout_s: float = 30.0) -> dict[str, Any] | None:
    """One server's `GET /v1/kvc/stats`, or None where it has no such route (plain SGLang, a
    gateway) or does not answer."""
    try:
        r = requests.get(url + "/v1/kvc/stats", timeout=timeout_s)
    except requests.RequestException:
        return None
    return r.json() if r.status_code == 200 else None


def gateway_workers(url: str, timeout_s: float = 10.0) -> list[str] | None:
    """The worker URLs a gateway routes to (`GET /workers`), or None where `url` is no gateway."""
    try:
        r = requests.get(url + "/workers", timeout=timeout_s)
    except requests.RequestException:
        return None
    if r.status_code != 200:
        return None
    try:
        workers = r.json().get("workers")
    except ValueError:
        return None
    if not isinstance(workers, list):
        return None
    return [w["url"] for w in workers if isinstance(w, dict) and "url" in w]


def cluster_stats(workers: list[str], timeout_s: float = 10.0) -> dict[str, Any]:
    """The sum of the workers' snapshots, plus `cluster` (how many workers, how many answered)
    and `per_worker` (each worker's URL with its snapshot, or the error it gave). A worker
    that does not answer (killed, restarting) is left out of the sum and named in `per_worker`."""

    def one(url: str) -> dict[str, Any]:
        stats = server_stats(url, timeout_s)
        return {"url": url, "stats": stats} if stats else {"url": url, "error": "no answer"}

    with ThreadPoolExecutor(max(len(workers), 1)) as pool:
        per_worker = list(pool.map(one, workers))
    answered = [w["stats"] for w in per_worker if "stats" in w]
    total = (
        merge_stats([{k: v for k, v in s.items() if k not in _PER_SERVER_KEYS} for s in answered])
        if answered
        else {}
    )
    return {
        **total,
        "cluster": {"workers": len(workers), "answering": len(answered)},
        "per_worker": per_worker,
    }


def kvc_stats(url: str) -> dict[str, Any] | None:
    """`/v1/kvc/stats` of a server, or the cluster's view where `url` is a gateway; None where
    neither answers (a plain SGLang server, or a gateway none of whose workers answers)."""
    url = url.rstrip("/")
    workers = gateway_workers(url)
    if workers is None:
        return server_stats(url)
    stats = cluster_stats(workers)
    return stats if stats["cluster"]["answering"] else None


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m sgl_kvc.cluster_stats URL  (a server or a gateway)", file=sys.stderr)
        return 2
    stats = kvc_stats(args[0])
    if stats is None:
        print(f"{args[0]}: no /v1/kvc/stats answer (not sgl-kvc, or no worker answers)", file=sys.stderr)
        return 1
    print(json.dumps(stats, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
