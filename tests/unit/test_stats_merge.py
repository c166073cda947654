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


def test_answer_sums_ranks_and_lists_them_in_rank_order() -> None:
    from sgl_kvc.server.routes import stats_answer

    r0 = {"policy": "rkv", "pool": {"total_tokens": 10}, "dp_rank": 0}
    r1 = {"policy": "rkv", "pool": {"total_tokens": 12}, "dp_rank": 1}
    answer = stats_answer([r1, r0])  # ranks answer in arrival order
    assert answer["pool"] == {"total_tokens": 22} and answer["policy"] == "rkv"
    assert "dp_rank" not in answer and answer["dp_size"] == 2
    assert answer["per_rank"] == [r0, r1]
    one = stats_answer([r0])
    assert one["pool"] == {"total_tokens": 10} and one["dp_size"] == 1 and one["per_rank"] == [r0]
