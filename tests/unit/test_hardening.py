"""Scheduler-side safety: request settings validated once, per-request failure isolation, and
tensor-parallel ranks agreeing on what to keep. No SGLang server; fake requests and groups."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from sgl_kvc.adapter.safety.tp import ScoreReducer
from sgl_kvc.adapter.scheduling.requests import is_middle_chunk
from sgl_kvc.config import KvcConfig
from sgl_kvc.policies import LayerView, PolicyParams, available_policies, get_policy
from sgl_kvc.request_settings import RequestCompression
from sgl_kvc.adapter.kvc_req import admit, of_request


class FakeReq:
    def __init__(self, custom_params) -> None:
        self.rid = "r"
        self.sampling_params = SimpleNamespace(custom_params=custom_params)
        self.aborted: tuple | None = None

    def finished(self) -> bool:
        return self.aborted is not None

    def set_finish_with_abort(self, msg: str, status_code: int = 400) -> None:
        self.aborted = (msg, status_code)


SERVER = KvcConfig(policy="rkv")


@pytest.mark.parametrize(
    "value",
    ["bogus-string", {"policy": "bogus"}, {"budget": "x"}, {"budget": -5}, {"budget": 1.5},
     {"budget": True}, {"budget": 10**9}, {"extra": 1}, ["rkv"], None, {"policy": {"a": 1}}],
)
def test_bad_settings_abort_the_request_with_a_400(value) -> None:
    req = FakeReq({"sgl_kvc": value})
    assert of_request(req) == RequestCompression(policy="none")  # never raises
    assert admit(req, SERVER)
    msg, status = req.aborted
    assert status == 400 and "custom_params.sgl_kvc" in msg
    assert "Traceback" not in msg and "Error(" not in msg


@pytest.mark.parametrize(
    ("custom", "expected"),
    [
        (None, RequestCompression()),
        ("not a dict", RequestCompression()),
        ({"other": 1}, RequestCompression()),
        ({"sgl_kvc": {"policy": "snapkv", "budget": 64}}, RequestCompression("snapkv", 64)),
    ],
)
def test_good_settings_pass(custom, expected) -> None:
    req = FakeReq(custom)
    assert of_request(req) == expected
    assert not admit(req, SERVER) and req.aborted is None


@pytest.mark.parametrize(
    ("custom", "config", "param"),
    [
        ({"policy": "h2o", "prompt_policy": "snapkv"}, KvcConfig(policy="h2o"), None),  # servable
        ({"policy": "snapkv", "prompt_policy": "h2o"}, KvcConfig(policy="rkv"), "custom_params.sgl_kvc.prompt_policy"),
        ({"prompt_policy": "batchmax"}, KvcConfig(policy="rkv"), "custom_params.sgl_kvc.prompt_policy"),
        ({"budget": 64}, KvcConfig(policy="none"), "custom_params.sgl_kvc.budget"),
        ({"policy": "none", "budget": 64}, KvcConfig(policy="none"), "custom_params.sgl_kvc.budget"),
        ({"policy": "none"}, KvcConfig(policy="none"), None),
    ],
)
def test_settings_this_server_cannot_serve_are_a_400_at_admission(custom, config, param) -> None:
    """Checked against the server's configuration when the request enters the queue, so that it
    never fails later, in a step it shares with other requests."""
    req = FakeReq({"sgl_kvc": custom})
    refused = admit(req, config)
    assert refused == (param is not None)
    if param is not None:
        msg, status = req.aborted
        assert status == 400 and msg.startswith(f"Invalid {param}:")


def test_settings_are_parsed_once() -> None:
    req = FakeReq({"sgl_kvc": {"policy": "h2o"}})
    first = of_request(req)
    req.sampling_params.custom_params = {"sgl_kvc": {"policy": "bogus"}}
    assert of_request(req) is first


def test_middle_chunk_is_told_by_the_batch() -> None:
    req = SimpleNamespace(inflight_middle_chunks=0)
    assert is_middle_chunk(SimpleNamespace(chunked_req=req), req)
    assert not is_middle_chunk(SimpleNamespace(chunked_req=None), req)
    assert not is_middle_chunk(SimpleNamespace(chunked_req=SimpleNamespace()), req)


# --- tensor parallelism ----------------------------------------------------------------------------
class FakeGroup:
    """An in-process stand-in for a TP group: `all_reduce_sum` blocks until every rank called."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world)
        self.parts: dict[int, torch.Tensor] = {}

    def reducer(self, rank: int) -> ScoreReducer:
        def all_reduce_sum(t: torch.Tensor) -> None:
            self.parts[rank] = t.clone()
            self.barrier.wait()
            total = sum(self.parts[r] for r in range(self.world))
            self.barrier.wait()
            t.copy_(total)

        return ScoreReducer(world_size=self.world, all_reduce_sum=all_reduce_sum)


def _views(seed: int, n: int = 96, h_kv: int = 4, group: int = 2, layers: int = 3) -> list[LayerView]:
    g = torch.Generator().manual_seed(seed)
    g_values = torch.Generator().manual_seed(1000 + seed)  # a stream of their own
    return [
        LayerView(
            keys=torch.randn(n, h_kv, 16, generator=g),
            queries=torch.randn(8, h_kv * group, 16, generator=g),
            stats=torch.rand(h_kv, n, generator=g),
            values=torch.randn(n, h_kv, 16, generator=g_values),
            reconstruction=torch.rand(h_kv, n, generator=g_values),  # KVzip's scores
        )
        for _ in range(layers)
    ]


def _shard(view: LayerView, rank: int, world: int) -> LayerView:
    """The heads one rank holds: a contiguous slice of KV heads and their query groups."""
    h_kv = view.n_kv_heads
    group = view.queries.shape[1] // h_kv
    k0, k1 = rank * h_kv // world, (rank + 1) * h_kv // world
    return LayerView(
        keys=view.keys[:, k0:k1], queries=view.queries[:, k0 * group : k1 * group],
        stats=view.stats[k0:k1], values=view.values[:, k0:k1], reconstruction=view.reconstruction[k0:k1],
    )


def _ranks_select(policy, views, keep: int, group: FakeGroup | None, world: int = 2) -> list[torch.Tensor]:
    out: list[torch.Tensor | None] = [None] * world

    def run(rank: int) -> None:
        shards = [_shard(v, rank, world) for v in views]
        reduce = group.reducer(rank) if group is not None else None
        out[rank] = policy.select(shards, keep, reduce=reduce)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out  # type: ignore[return-value]


@pytest.mark.parametrize("name", [p for p in available_policies() if p != "none"])
def test_tp_ranks_keep_the_same_tokens_as_one_device(name: str) -> None:
    policy = get_policy(name, PolicyParams(budget=40, window=8))
    for seed in range(3):
        views = _views(seed)
        single = policy.select(views, 40)
        rank0, rank1 = _ranks_select(policy, views, 40, FakeGroup(2))
        assert torch.equal(rank0, rank1)
        assert torch.equal(rank0, single)


def test_without_the_reduction_ranks_diverge() -> None:
    """The check above can fail: each rank scoring only its own heads picks other tokens."""
    policy = get_policy("snapkv", PolicyParams(budget=40, window=8))
    diverged = [
        not torch.equal(*_ranks_select(policy, _views(seed), 40, None)) for seed in range(3)
    ]
    assert any(diverged)
