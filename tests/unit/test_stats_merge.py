from sgl_kvc.server.routes import merge_stats


def test_single_rank_is_returned_as_is() -> None:
    s = {"policy": "none", "pool": {"total_tokens": 10}}
    assert merge_stats([s]) is s


def test_ranks_are_summed() -> None:
    a = {"policy": "rkv", "pool": {"total_tokens": 10, "free_tokens": 4}, "compression": {"seconds": 0.5}}
    b = {"policy": "rkv", "pool": {"total_tokens": 10, "free_tokens": 6}, "compression": {"seconds": 0.25}}
    assert merge_stats([a, b]) == {
        "policy": "rkv",
        "pool": {"total_tokens": 20, "free_tokens": 10},
        "compression": {"seconds": 0.75},
    }
