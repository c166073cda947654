"""The Triton per-head decode kernel (`kernels/triton_per_head.py`, the CUDA path of
`per_head_decode`) against the torch version, on ragged per-head tables, bf16 and FP8 unit
pools, several splits per sequence, and the probabilities the statistics read.

On a GPU it runs compiled. Without one it runs under Triton's interpreter: the CPU install has
the `triton` package (xgrammar depends on it); where it is missing, this module is skipped.
"""

from __future__ import annotations

import pytest
import torch

# Without a GPU, tests/conftest.py switched Triton to its interpreter before anything imported it.
triton = pytest.importorskip("triton", reason="needs the triton package (compiled on a GPU, interpreted on CPU)")
if not torch.cuda.is_available() and not triton.knobs.runtime.interpret:
    pytest.skip("triton was imported before conftest could select its interpreter", allow_module_level=True)

from sgl_kvc.kernels.fp8 import Fp8Rows  # noqa: E402
from sgl_kvc.kernels.per_head_attention import HeadTables, per_head_decode  # noqa: E402
from sgl_kvc.kernels.triton_per_head import supports, triton_per_head_decode  # noqa: E402

# Where Triton runs in this process: compiled on CUDA where there is a GPU, under its interpreter
# on the CPU where there is none. On the other device of a GPU machine it has nothing to run on.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _runs_triton(device: torch.device) -> None:
    if device.type != DEVICE:
        pytest.skip(f"Triton runs on {DEVICE} here (compiled on a GPU, interpreted without one)")


def _case(b: int, h_kv: int, group: int, d: int, n: int, seed: int, fp8: str | None,
          device: torch.device | str = DEVICE):
    """(q, K and V unit pools, per-head tables) on `device`, drawn on the CPU."""
    g = torch.Generator().manual_seed(seed)
    units = 4 * b * h_kv * n + 8
    k = torch.randn(units, d, generator=g) * 2
    v = torch.randn(units, d, generator=g)
    if fp8 is None:
        k_pool, v_pool = k.to(torch.bfloat16).to(device), v.to(torch.bfloat16).to(device)
    else:
        k_pool = Fp8Rows.empty(units, 1, d, fp8=fp8, dtype=torch.bfloat16, device=device)
        v_pool = Fp8Rows.empty(units, 1, d, fp8=fp8, dtype=torch.bfloat16, device=device)
        everything = torch.arange(units, device=device)
        k_pool[everything] = k[:, None].to(device)
        v_pool[everything] = v[:, None].to(device)
        # the flat unit view the FP8 unit pool gives: codes [U, d], scales [U]
        k_pool = Fp8Rows(k_pool.codes[:, 0], k_pool.scales[:, 0], fp8, k_pool.scale_format, torch.bfloat16)
        v_pool = Fp8Rows(v_pool.codes[:, 0], v_pool.scales[:, 0], fp8, v_pool.scale_format, torch.bfloat16)
    lens = torch.randint(0, n + 1, (b, h_kv), generator=g)
    lens.view(-1)[0] = n  # the widest head fills the table
    slots = torch.stack([torch.randperm(units, generator=g)[:n] for _ in range(b * h_kv)]).reshape(b, h_kv, n)
    slots *= torch.arange(n) < lens[..., None]  # padding reads unit 0
    q = torch.randn(b, h_kv * group, d, generator=g).to(torch.bfloat16).to(device)
    return q, k_pool, v_pool, HeadTables(slots.to(device), lens.to(device))


@pytest.mark.parametrize(
    "b, h_kv, group, d, n, fp8",
    [
        (3, 2, 2, 16, 40, None),  # several splits of 16 columns, ragged heads
        (2, 3, 3, 32, 23, None),  # a group that is not a power of two (SmolLM2: 9 / 3)
        (1, 1, 1, 16, 5, None),
        (2, 2, 4, 16, 33, "fp8_e4m3"),
        (2, 1, 2, 16, 17, "fp8_e5m2"),
    ],
)
def test_triton_decode_matches_the_torch_version(device, b, h_kv, group, d, n, fp8) -> None:
    _runs_triton(device)
    q, k_pool, v_pool, tables = _case(b, h_kv, group, d, n, seed=b * 100 + n, fp8=fp8, device=device)
    want, want_probs = per_head_decode(q, k_pool, v_pool, tables, 0.3, return_probs=True)
    got, probs = triton_per_head_decode(q, k_pool, v_pool, tables, 0.3, return_probs=True, split_n=16, block_n=16)
    assert got.dtype == q.dtype and got.shape == want.shape and got.device == probs.device == device
    assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)  # bf16 outputs
    # float32 on both sides; from an FP8 pool the torch version reads keys rounded to bf16 (the
    # model dtype `Fp8Rows` returns) while the kernel keeps code x scale in float32
    assert torch.allclose(probs, want_probs, atol=1e-5, rtol=1e-5 if fp8 is None else 2e-2)
    alone = triton_per_head_decode(q, k_pool, v_pool, tables, 0.3, split_n=16, block_n=16)
    assert torch.equal(alone, got)
    # the probabilities of some requests only (those that keep statistics), in the order asked
    rows = torch.tensor([b - 1, 0][: b], device=device)
    some, some_probs = triton_per_head_decode(q, k_pool, v_pool, tables, 0.3, probs_rows=rows, split_n=16,
                                              block_n=16)
    assert torch.equal(some, got) and torch.equal(some_probs, probs[rows])


def test_an_empty_head_reads_zeros_and_a_split_past_its_length_adds_nothing(device: torch.device) -> None:
    _runs_triton(device)
    q, k_pool, v_pool, tables = _case(2, 2, 2, 16, 30, seed=7, fp8=None, device=device)
    lens = tables.lengths.clone()
    lens[1, 1] = 0
    lens[0, 1] = 3  # one block of its first split; its other splits are empty
    tables = HeadTables(tables.units, lens)
    want, want_probs = per_head_decode(q, k_pool, v_pool, tables, None, return_probs=True)
    for split_n in (16, 32):  # two splits merged by the second kernel; one, normalized in place
        got, probs = triton_per_head_decode(q, k_pool, v_pool, tables, None, return_probs=True, split_n=split_n,
                                            block_n=16)
        assert float(got[1, 2:].float().abs().max()) == 0.0 and float(probs[1, 1].abs().max()) == 0.0
        assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        assert torch.allclose(probs, want_probs, atol=1e-5)


def test_supported_operands(device: torch.device) -> None:
    """A check of shapes and formats that launches nothing: it runs on every device."""
    q, k_pool, v_pool, _ = _case(1, 1, 2, 16, 4, seed=1, fp8="fp8_e4m3", device=device)
    assert supports(q, k_pool, v_pool)
    e8m0 = Fp8Rows(k_pool.codes, k_pool.scales.to(torch.uint8), "fp8_e4m3", "e8m0", torch.bfloat16)
    assert not supports(q, e8m0, v_pool)  # the torch version dequantizes e8m0 scales
    odd = torch.zeros(8, 12, device=device)
    assert not supports(torch.zeros(1, 2, 12, device=device), odd, odd)  # head dim 12: not a power of two


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [None, "fp8_e4m3"])  # each pool's default block (64 / 128 units)
def test_fast_decode_runs_the_kernel_on_cuda(monkeypatch, fp8: str | None) -> None:
    from sgl_kvc.kernels import per_head_attention, triton_per_head

    calls = []
    real = triton_per_head.triton_per_head_decode
    monkeypatch.setattr(triton_per_head, "triton_per_head_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    q, k_pool, v_pool, tables = _case(2, 2, 2, 64, 300, seed=3, fp8=fp8)
    got = per_head_attention.fast_per_head_decode(q, k_pool, v_pool, tables)
    assert calls and torch.allclose(got.float(), per_head_decode(q, k_pool, v_pool, tables).float(), atol=2e-2)


@pytest.mark.parametrize("fp8", [None, "fp8_e4m3"])
def test_slot_tables_and_logit_rows_match_the_torch_version(device: torch.device, fp8: str | None) -> None:
    """A slot cache read through one slot table per request (`row_tables`), the logits of some
    requests and every request's log-sum-exp (what a decode step's statistics read)."""
    _runs_triton(device)
    from sgl_kvc.kernels.per_head_attention import LogitRows, row_tables

    b, h_kv, group, d, n = 3, 2, 3, 16, 37
    q, k_pool, v_pool, _ = _case(b, h_kv, group, d, n, seed=11, fp8=fp8, device=device)
    slots_total = int((k_pool.codes if fp8 else k_pool).shape[0]) // h_kv
    g = torch.Generator().manual_seed(12)
    slots = torch.stack([torch.randperm(slots_total, generator=g)[:n] for _ in range(b)]).to(device)
    tables = row_tables(slots, torch.tensor([n, 5, 20], device=device), h_kv)
    rows = LogitRows(slots=torch.tensor([0, -1, 1], device=device), rows=torch.tensor([0, 2], device=device), count=2,
                     width=n)
    # the reference reads code x scale unrounded (float32, exact), as the kernel does
    exact = [p if fp8 is None else Fp8Rows(p.codes, p.scales, fp8, p.scale_format, torch.float32)
             for p in (k_pool, v_pool)]
    want, want_logits = per_head_decode(q, *exact, tables, 0.3, logit_rows=rows)
    got, logits = triton_per_head_decode(q, k_pool, v_pool, tables, 0.3, logit_rows=rows, split_n=16, block_n=16)
    assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)  # bf16 outputs
    assert torch.allclose(logits.lse, want_logits.lse, atol=1e-4, rtol=1e-4)
    valid = tables.valid()[rows.rows][:, :, None, :].expand_as(logits.logits)
    assert torch.allclose(logits.logits[valid], want_logits.logits[valid], atol=1e-4, rtol=1e-4)


def test_fp8_codes_widened_to_float16_read_as_bfloat16(device: torch.device) -> None:
    """The two widths an FP8 pool's codes can be multiplied in (`FP8_DOT`) agree within the
    rounding of a bf16 output."""
    _runs_triton(device)
    q, k_pool, v_pool, tables = _case(2, 2, 4, 32, 50, seed=13, fp8="fp8_e4m3", device=device)
    want = per_head_decode(q, k_pool, v_pool, tables, 0.3)
    for dot in ("bfloat16", "float16"):
        got = triton_per_head_decode(q, k_pool, v_pool, tables, 0.3, split_n=32, block_n=16, fp8_dot=dot)
        assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("policy", ["h2o", "kvcompress"])
def test_the_statistics_kernel_adds_what_the_torch_version_adds(device: torch.device, policy: str) -> None:
    """`kernels/triton_stats.py` against `stat_slab.add_attention`'s torch version: the same
    contribution in the same columns of the slab, nothing elsewhere."""
    _runs_triton(device)
    from sgl_kvc.core.stat_slab import add_attention, plan_group
    from sgl_kvc.kernels import triton_stats
    from sgl_kvc.kernels.per_head_attention import DecodeLogits
    from sgl_kvc.policies import get_policy

    g = torch.Generator().manual_seed(14)
    k, b, h_kv, group, n, layers = 3, 5, 2, 3, 150, 2
    logits = DecodeLogits(logits=torch.randn(k, h_kv, group, n, generator=g).to(device),
                          lse=(torch.randn(b, h_kv, group, generator=g) + 6).to(device))
    lens = [150, 17, 140]
    plan = plan_group(get_policy(policy), rows=[0, 1, 2], lse_rows=[4, 0, 2], starts=[0, 150, 167], lens=lens,
                      device=device)
    base = torch.rand(h_kv, layers, 320, generator=g).to(device)
    want, got = base.clone(), base.clone()
    add_attention(want, 1, plan, logits=logits)
    triton_stats.add_contribution(got, 1, plan, logits)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)
    assert torch.equal(got[:, 0], base[:, 0]) and torch.equal(got[:, 1, 307:], base[:, 1, 307:])
    assert not torch.equal(got[:, 1, :307], base[:, 1, :307])


def test_rows_read_in_place_with_splits_per_request(device: torch.device) -> None:
    """Slot tables read as rows of a `req_to_token`-like table (no table made), and a split plan
    per request (`split_plan`): a long request's splits merged, short ones written directly,
    the workspace holding only the long one's parts."""
    _runs_triton(device)
    from sgl_kvc.kernels.per_head_attention import row_tables
    from sgl_kvc.core.decode import split_plan

    b, h_kv, group, d = 4, 2, 3, 16
    q, k_pool, v_pool, _ = _case(b, h_kv, group, d, 8, seed=15, fp8=None, device=device)
    slots_total = int(k_pool.shape[0]) // h_kv
    g = torch.Generator().manual_seed(16)
    r2t = torch.randint(1, slots_total, (7, 80), generator=g, dtype=torch.int32).to(device)
    rows, lens = [5, 0, 3, 6], [70, 9, 1, 33]
    tables = row_tables(r2t, torch.tensor(lens, device=device), h_kv,
                        rows=torch.tensor(rows, device=device), columns=max(lens))
    plan = split_plan(lens, device, split_n=16)
    assert plan.most == 5 and plan.total == 5 + 3
    want = per_head_decode(q, k_pool, v_pool, tables, 0.3)
    got = triton_per_head_decode(q, k_pool, v_pool, tables, 0.3, split_n=16, block_n=16, splits=plan)
    assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(got, triton_per_head_decode(q, k_pool, v_pool, tables, 0.3, split_n=16, block_n=16))
