import pytest

from sgl_kvc.request_settings import (
    CUSTOM_PARAMS_KEY,
    RequestCompression,
    RequestSettingError,
    from_custom_params,
    parse_kv_compression,
)


def test_valid_settings_roundtrip_through_custom_params() -> None:
    s = parse_kv_compression({"policy": "snapkv", "budget": 64})
    assert s == RequestCompression("snapkv", 64)
    assert from_custom_params({CUSTOM_PARAMS_KEY: s.to_custom_params(), "other": 1}) == s
    assert from_custom_params(None) == RequestCompression()
    shared = parse_kv_compression({"selection": "shared"})
    assert shared.selection == "shared" and shared.to_custom_params() == {"selection": "shared"}


@pytest.mark.parametrize(
    "obj, param",
    [
        ({"policy": "nope"}, "kv_compression.policy"),
        ({"budget": 0}, "kv_compression.budget"),
        ({"budget": True}, "kv_compression.budget"),
        ({"budget": "8"}, "kv_compression.budget"),
        ({"budget": 1 << 40}, "kv_compression.budget"),
        ({"ratio": 0.5}, "kv_compression.ratio"),
        ({"selection": "per_layer"}, "kv_compression.selection"),
        ({"selection": 1}, "kv_compression.selection"),
        ({"prompt_policy": "none"}, "kv_compression.prompt_policy"),
        ({"prompt_policy": 3}, "kv_compression.prompt_policy"),
        ([1, 2], "kv_compression"),
    ],
)
def test_invalid_settings_name_the_field(obj, param: str) -> None:
    with pytest.raises(RequestSettingError) as info:
        parse_kv_compression(obj)
    assert info.value.param == param


def test_prompt_policy_resolution() -> None:
    """A request that names its policy alone gets that policy's prompt policy, not the server's."""
    from sgl_kvc.policies import prompt_policy_name

    assert parse_kv_compression({"prompt_policy": "kvcompress"}).prompt_policy == "kvcompress"
    for name in ("expected_attention", "keydiff"):  # registered policies are valid by name
        assert parse_kv_compression({"policy": name, "prompt_policy": name}).prompt_policy == name
    assert RequestCompression().policies("rkv", "auto") == ("rkv", "auto")
    assert RequestCompression().policies("rkv", "streamingllm") == ("rkv", "streamingllm")
    assert RequestCompression(policy="h2o").policies("rkv", "streamingllm") == ("h2o", "auto")
    assert RequestCompression(policy="rkv", prompt_policy="rkv").policies("h2o", "auto") == ("rkv", "rkv")
    assert RequestCompression(prompt_policy="snapkv").policies("h2o", "h2o") == ("h2o", "snapkv")
    assert prompt_policy_name("rkv", "auto") == "snapkv" and prompt_policy_name("rkv", "rkv") == "rkv"


def test_query_agnostic_prompt_policies_are_served_under_any_server_policy() -> None:
    """Expected Attention and KeyDiff keep no statistic: a request may name either as its prompt
    policy whatever the server decodes with; a statistics policy still may not."""
    from sgl_kvc.config import KvcConfig
    from sgl_kvc.request_settings import server_conflict

    for server in ("rkv", "h2o", "batchmax", "kvcompress", "snapkv"):
        config = KvcConfig(policy=server)
        for prompt in ("expected_attention", "keydiff"):
            assert server_conflict(parse_kv_compression({"prompt_policy": prompt}), config) is None
    refused = server_conflict(parse_kv_compression({"prompt_policy": "batchmax"}), KvcConfig(policy="keydiff"))
    assert refused is not None and refused.param == "kv_compression.prompt_policy"


def test_an_earlier_policy_name_is_accepted_as_the_policy() -> None:
    """`avgattn`, Batch-Max's name before it was `batchmax`, still works in flags and requests,
    and is served (and reported) as `batchmax`; it is not listed as a choice of its own."""
    import argparse

    from sgl_kvc.config import KvcConfig
    from sgl_kvc.policies import available_policies, get_policy

    assert "avgattn" not in available_policies() and get_policy("avgattn").name == "batchmax"
    parsed = parse_kv_compression({"policy": "avgattn", "prompt_policy": "avgattn"})
    assert parsed == RequestCompression(policy="batchmax", prompt_policy="batchmax")
    assert KvcConfig(policy="avgattn").policy == "batchmax"
    parser = argparse.ArgumentParser()
    KvcConfig.add_cli_args(parser)
    ns = parser.parse_args(["--policy", "avgattn", "--prompt-policy", "avgattn"])
    assert KvcConfig.from_cli_args(ns).policy == KvcConfig.from_cli_args(ns).prompt_policy == "batchmax"
