"""The local cluster's configuration, commands and the cluster view of `/v1/kvc/stats`, without
starting a server (the live cluster is tests/e2e/test_cluster.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sgl_kvc import cluster_stats
from sgl_kvc.cluster import ClusterConfig, ClusterError, gateway_command, main, worker_commands


def test_flags_before_the_double_dash_are_the_clusters_after_it_the_workers() -> None:
    c = ClusterConfig.from_argv([
        "--workers", "3", "--router-policy", "round_robin", "--port", "8000",
        "--router-args", "--cache-threshold 0.5", "--log-dir", "/tmp/x",
        "--", "--model-path", "demo", "--policy", "rkv",
    ])  # fmt: skip
    assert (c.workers, c.router_policy, c.port, c.log_dir) == (3, "round_robin", 8000, Path("/tmp/x"))
    assert c.server_flags == ("--model-path", "demo", "--policy", "rkv")
    assert c.router_flags == ("--cache-threshold", "0.5")
    assert ClusterConfig.from_argv([]) == ClusterConfig()  # 2 workers, cache_aware, :30000


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workers", "0"], "--workers must be at least 1"),
        (["--router-policy", "fastest"], "invalid choice: 'fastest'"),
        (["--", "--port", "31000"], "--port in the server flags"),
        (["--", "--host=0.0.0.0"], "--host=0.0.0.0 in the server flags"),
        (["--router-args", "--port 9"], "--port in the --router-args"),
        (["--router-args", "--policy random"], "set by the cluster"),
        (["--router-args=--policy=random"], "set by the cluster"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_flags_are_one_line_errors(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ClusterConfig.from_argv(argv)
    with pytest.raises(SystemExit) as exc:  # the command says it on one line, exit status 2
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m sgl_kvc.cluster: error:") and message in err[-1]


def test_gateway_command_puts_the_users_flags_last() -> None:
    cmd = gateway_command(["http://a:1", "http://b:2"], "cache_aware", ["--log-level", "info"])
    assert cmd[1:4] == ["-m", "smg", "launch"]
    i = cmd.index("--worker-urls")
    assert cmd[i + 1 : i + 3] == ["http://a:1", "http://b:2"] and cmd[i + 3] == "--policy"
    assert cmd.index("--health-check-interval-secs") < len(cmd) - 2  # the local defaults ...
    assert cmd[-2:] == ["--log-level", "info"]  # ... and the user's, last (argparse keeps them)
    assert "--host" not in cmd and "--port" not in cmd  # ServerProcess adds them


def test_workers_get_gpus_of_their_own() -> None:
    c = ClusterConfig(workers=2, server_flags=("--policy", "rkv", "--tp-size", "2"))
    assert worker_commands(c, gpus=0)[0][-4:] == ["--policy", "rkv", "--tp-size", "2"]  # CPU
    a, b = worker_commands(c, gpus=4)
    assert a[-2:] == ["--base-gpu-id", "0"] and b[-2:] == ["--base-gpu-id", "2"]
    with pytest.raises(ClusterError, match="needs 4 GPUs, this machine has 2"):
        worker_commands(c, gpus=2)
    placed = ClusterConfig(workers=2, server_flags=("--base-gpu-id", "1"))
    assert worker_commands(placed, gpus=1)[1][-2:] == ["--base-gpu-id", "1"]  # the user's choice


def _snapshot(total: int, passes: int, rank: int = 0) -> dict:
    return {"policy": "rkv", "pool": {"total_tokens": total}, "compression": {"passes": passes},
            "dp_size": 1, "per_rank": [{"dp_rank": rank}]}  # fmt: skip


def test_cluster_view_sums_the_workers_that_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = {"http://w0": _snapshot(10, 3), "http://w1": _snapshot(20, 4), "http://w2": None}
    monkeypatch.setattr(cluster_stats, "server_stats", lambda url, timeout_s=0: answers[url])
    monkeypatch.setattr(cluster_stats, "gateway_workers", lambda url: list(answers))
    view = cluster_stats.kvc_stats("http://gateway/")
    assert view is not None
    assert view["pool"] == {"total_tokens": 30} and view["compression"] == {"passes": 7}
    assert view["dp_size"] == 2 and "per_rank" not in view  # ranks stay with their worker
    assert view["cluster"] == {"workers": 3, "answering": 2}
    assert [w["url"] for w in view["per_worker"]] == list(answers)
    assert view["per_worker"][0]["stats"] == answers["http://w0"]
    assert view["per_worker"][2] == {"url": "http://w2", "error": "no answer"}


def test_a_server_answers_for_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_stats, "gateway_workers", lambda url: None)  # no /workers
    monkeypatch.setattr(cluster_stats, "server_stats", lambda url, timeout_s=0: {"url": url})
    assert cluster_stats.kvc_stats("http://one:1/") == {"url": "http://one:1"}


def test_load_test_and_benchmark_take_a_cluster_as_one_configuration() -> None:
    from benchmarks.eviction import cluster_of, parse_config
    from loadtest import run

    spec = "cluster:--workers 2 --router-policy round_robin -- --model-path demo --policy rkv"
    c = run.ServerConfig.parse("two=" + spec)
    assert c.cluster == ClusterConfig(router_policy="round_robin",
                                      server_flags=("--model-path", "demo", "--policy", "rkv"))
    assert c.describe() == spec and run.ServerConfig.parse("one=--policy rkv").cluster is None
    with pytest.raises(ValueError, match="configuration 'bad': --workers must be at least 1"):
        run.ServerConfig.parse("bad=cluster:--workers 0")
    name, flags = parse_config("two=" + spec, budget=128)
    assert name == "two" and cluster_of(flags) == c.cluster
    assert cluster_of(parse_config("rkv", budget=128)[1]) is None


def test_shared_prefix_draws_from_several_system_prompts() -> None:
    from loadtest.prompts import PromptGenerator, PromptSettings

    one = PromptGenerator("shared_prefix", PromptSettings(seed=3), stream_id=1)
    same = PromptGenerator("shared_prefix", PromptSettings(seed=3, system_prompts=1), stream_id=1)
    assert [next(one) for _ in range(5)] == [next(same) for _ in range(5)]  # default unchanged
    many = PromptGenerator("shared_prefix", PromptSettings(seed=3, system_prompts=3), stream_id=1)
    systems = {next(many).messages[0]["content"] for _ in range(40)}
    assert len(systems) == 3
    first = next(PromptGenerator("shared_prefix", PromptSettings(seed=3), 0)).messages[0]["content"]
    assert first in systems  # the first of several is the single one
    with pytest.raises(ValueError, match="system_prompts must be at least 1"):
        PromptGenerator("shared_prefix", PromptSettings(system_prompts=0))
