"""Tests for software stochastic rounding fp32 -> bf16 (nxd_lc.precision)."""

from __future__ import annotations

import math

import pytest
import torch

from nxd_lc.precision import sr_add_, stochastic_round_to_bf16

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

BF16_MAX = torch.finfo(torch.bfloat16).max


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _neighbours(lo: float, ulp: float, fracs: torch.Tensor, sign: float) -> torch.Tensor:
    """fp32 values sign * (|lo| + frac * ulp), strictly between two bf16 neighbours."""
    return (sign * (abs(lo) + fracs.double() * ulp)).float()


@pytest.mark.parametrize(
    ("lo", "ulp", "sign"),
    [
        (1.0, 2.0**-7, 1.0),  # binade [1, 2)
        (1.0, 2.0**-7, -1.0),  # negatives
        (1.9921875, 2.0**-7, 1.0),  # upper neighbour 2.0 is across the exponent boundary
        (3.0e-3, None, 1.0),  # small binade
        (2.0**-133, 2.0**-133, 1.0),  # bf16 subnormal range
    ],
)
def test_unbiased_and_two_neighbours(lo: float, ulp: float | None, sign: float) -> None:
    lo_bf = torch.tensor(lo).to(torch.bfloat16).float().item()
    if ulp is None:
        ulp = 2.0 ** (math.frexp(lo_bf)[1] - 8)  # bf16 has 8 significand bits (7 stored)
    hi_bf = lo_bf + ulp
    fracs = torch.linspace(0.05, 0.95, 19)
    x = _neighbours(lo_bf, ulp, fracs, sign)
    n = 20_000
    samples = stochastic_round_to_bf16(x[:, None].expand(-1, n).contiguous(), _gen(0)).float()
    lo_s, hi_s = sign * lo_bf, sign * hi_bf
    assert bool(((samples == lo_s) | (samples == hi_s)).all()), "sample outside bf16 neighbours"
    p = (x.double() - lo_s) / (hi_s - lo_s)
    stderr = abs(hi_s - lo_s) * torch.sqrt(p * (1 - p) / n)
    err = (samples.double().mean(dim=1) - x.double()).abs()
    assert bool((err < 5 * stderr).all()), f"bias: max z = {(err / stderr).max().item():.2f}"


def test_small_updates_track_fp32_while_nearest_stalls() -> None:
    steps, update = 10_000, 1.0e-5  # bf16 half ulp at 1.0 is 2**-8 ~ 3.9e-3 >> 1e-5
    param_sr = torch.ones(256, dtype=torch.bfloat16)
    param_rn = torch.ones(256, dtype=torch.bfloat16)
    ref = torch.ones(256, dtype=torch.float64)
    upd = torch.full((256,), update, dtype=torch.float32)
    g = _gen(1234)
    for _ in range(steps):
        sr_add_(param_sr, upd, g)
        param_rn.copy_((param_rn.float() + upd).to(torch.bfloat16))
        ref += update
    expected = 1.0 + steps * update
    assert ref[0].item() == pytest.approx(expected)
    assert bool((param_rn == 1.0).all()), "round-to-nearest should stall at 1.0"
    rel = (param_sr.double() - ref) / ref
    assert abs(rel.mean().item()) < 0.01, rel.mean()
    assert rel.abs().max().item() < 0.15, rel.abs().max()


def _from_bits(pattern: int) -> torch.Tensor:
    signed = pattern - (1 << 32) if pattern >= 1 << 31 else pattern
    return torch.tensor([signed], dtype=torch.int32).view(torch.float32)


def test_special_values() -> None:
    exact = torch.tensor(
        [0.0, -0.0, 1.0, -3.5, 2.0**-133, -(2.0**100), BF16_MAX, float("inf"), float("-inf")]
    )
    xs = exact[:, None].expand(-1, 1000).contiguous()
    out = stochastic_round_to_bf16(xs, _gen(3))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out.float(), xs)
    assert bool((torch.signbit(out[1].float())).all()), "-0.0 must keep its sign"
    # NaN patterns, including ones whose low bits would carry into inf or wrap to +0.
    nans = torch.cat(
        [torch.tensor([float("nan")]), _from_bits(0x7F800001), _from_bits(0xFFFFFFFF)]
    )
    nan_out = stochastic_round_to_bf16(nans[:, None].expand(-1, 1000).contiguous(), _gen(4))
    assert bool(torch.isnan(nan_out).all())
    # Between bf16 max and 2**128: the upper neighbour is +inf.
    big = stochastic_round_to_bf16(_from_bits(0x7F7F8000).expand(2000).contiguous(), _gen(5))
    assert set(big.float().unique().tolist()) == {BF16_MAX, float("inf")}


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="float32"):
        stochastic_round_to_bf16(torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="bfloat16"):
        sr_add_(torch.ones(2), torch.ones(2))
    with pytest.raises(ValueError, match="update must be float32"):
        sr_add_(torch.ones(2, dtype=torch.bfloat16), torch.ones(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="shape"):
        sr_add_(torch.ones(2, dtype=torch.bfloat16), torch.ones(3))


def test_deterministic_with_seeded_generator() -> None:
    x = torch.randn(4096, generator=_gen(7))
    a = stochastic_round_to_bf16(x, _gen(11))
    b = stochastic_round_to_bf16(x, _gen(11))
    c = stochastic_round_to_bf16(x, _gen(12))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    p1 = torch.ones(64, dtype=torch.bfloat16)
    p2 = torch.ones(64, dtype=torch.bfloat16)
    upd = torch.full((64,), 1.0e-3)
    g1, g2 = _gen(21), _gen(21)
    for _ in range(10):
        sr_add_(p1, upd, g1)
        sr_add_(p2, upd, g2)
    assert torch.equal(p1, p2)


def test_sr_add_on_leaf_parameter_requiring_grad() -> None:
    p = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    out = sr_add_(p, torch.full((8,), 0.5), _gen(0))
    assert out is p
    assert torch.equal(p.detach().float(), torch.full((8,), 1.5))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_bounds() -> None:
    x = torch.full((100_000,), 1.0 + 2.0**-9, device="cuda")
    g = torch.Generator(device="cuda")
    g.manual_seed(0)
    out = stochastic_round_to_bf16(x, g).float()
    assert set(out.unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    assert abs(out.mean().item() - x[0].item()) < 5 * 2.0**-7 * math.sqrt(0.1875 / 100_000)


@pytest.mark.xla
def test_xla_rounds_in_the_graph_without_a_host_round_trip() -> None:
    """On XLA the bit cast is XLA's BitcastConvert (``Tensor.view(dtype)`` is a CPU fallback there: the tensor
    went to the host and back, 3 transfers per rounded tensor, on every optimizer step of bf16SR): no fallback,
    no transfer; the bits equal the CPU view; samples are the two bf16 neighbours, unbiased; specials kept."""
    pytest.importorskip("torch_xla")
    import torch_xla.debug.metrics as met

    from nxd_lc.runtime import xla as xla_runtime

    device = xla_runtime.xla_device()
    x_cpu = _neighbours(1.0, 2.0**-7, torch.linspace(0.05, 0.95, 19), -1.0)
    n = 4000
    specials = torch.tensor([0.0, -0.0, 1.0, float("inf"), float("-inf"), float("nan"), 2.0**-133])
    x = x_cpu[:, None].expand(-1, n).contiguous().to(device)
    s = specials[:, None].expand(-1, 8).contiguous().to(device)
    xla_runtime.sync()
    met.clear_all()
    bits = xla_runtime.bitcast_float32_int32(x)
    samples, special_out = stochastic_round_to_bf16(x), stochastic_round_to_bf16(s)
    xla_runtime.sync()
    assert [k for k in met.counter_names() if k.startswith("aten::")] == []  # no CPU fallback op
    assert met.metric_data("TransferFromDeviceTime") is None  # nothing read back by the rounding itself
    assert torch.equal(bits.cpu(), x.cpu().view(torch.int32))
    out = samples.cpu().float()
    lo, hi = -1.0, -(1.0 + 2.0**-7)
    assert bool(((out == lo) | (out == hi)).all()), "sample outside the bf16 neighbours"
    p = (x_cpu.double() - lo) / (hi - lo)
    stderr = abs(hi - lo) * torch.sqrt(p * (1 - p) / n)
    assert bool(((out.double().mean(dim=1) - x_cpu.double()).abs() < 5 * stderr).all())
    got = special_out.cpu().float()
    assert torch.equal(got[[0, 1, 2, 3, 4, 6]], s.cpu()[[0, 1, 2, 3, 4, 6]]) and bool(got[5].isnan().all())
    assert bool(torch.signbit(got[1]).all())
