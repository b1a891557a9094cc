"""DPO-family and ORPO losses against their formulas written out independently (math on Python floats)."""

from __future__ import annotations

import math

import pytest
import torch

from nxd_lc.alignment import (
    dpo_loss,
    log1mexp,
    orpo_loss,
    parse_dpo_loss_type,
    uses_length_normalised_log_probs,
)

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _reference_dpo(pc: list[float], pr: list[float], rc: list[float], rr: list[float], beta: float, kind: str,
                   smoothing: float = 0.0) -> float:
    """Mean per-pair loss from the papers' formulas, one pair at a time in float64."""
    losses = []
    for a, b, c, d in zip(pc, pr, rc, rr):
        h = (a - c) - (b - d)
        if kind == "sigmoid":
            losses.append(-(1 - smoothing) * _log_sigmoid(beta * h) - smoothing * _log_sigmoid(-beta * h))
        elif kind == "hinge":
            losses.append(max(0.0, 1.0 - beta * h))
        else:
            losses.append((h - 1.0 / (2.0 * beta)) ** 2)
    return sum(losses) / len(losses)


def _random_logps(pairs: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [-(torch.rand(pairs, generator=g, dtype=torch.float64) * 40.0 + 1.0) for _ in range(4)]


def test_dpo_hand_values() -> None:
    t = lambda v: torch.tensor([v], dtype=torch.float64)  # noqa: E731
    # h = (-1 - -2) - (-3 - -2) = 2, beta = 0.5 -> beta h = 1
    args = (t(-1.0), t(-3.0), t(-2.0), t(-2.0), 0.5)
    assert dpo_loss(*args, loss_type="sigmoid")[0].item() == pytest.approx(math.log(1 + math.exp(-1.0)), abs=1e-6)
    cdpo = 0.9 * math.log(1 + math.exp(-1.0)) + 0.1 * math.log(1 + math.exp(1.0))
    assert dpo_loss(*args, loss_type="sigmoid", label_smoothing=0.1)[0].item() == pytest.approx(cdpo, abs=1e-6)
    assert dpo_loss(*args, loss_type="hinge")[0].item() == pytest.approx(0.0, abs=1e-7)  # 1 - 1 clipped at 0
    assert dpo_loss(*args, loss_type="ipo")[0].item() == pytest.approx((2.0 - 1.0) ** 2, abs=1e-6)
    _, metrics = dpo_loss(*args)
    assert metrics["rewards/chosen"].item() == pytest.approx(0.5)
    assert metrics["rewards/rejected"].item() == pytest.approx(-0.5)
    assert metrics["rewards/margins"].item() == pytest.approx(1.0)
    assert metrics["rewards/accuracies"].item() == 1.0


@pytest.mark.parametrize("kind", ["sigmoid", "hinge", "ipo"])
@pytest.mark.parametrize("beta", [0.01, 0.1, 1.0])
def test_dpo_random_matches_formula(kind: str, beta: float) -> None:
    tensors = _random_logps(7, seed=int(beta * 100) + len(kind))
    loss, _ = dpo_loss(*tensors, beta=beta, loss_type=kind)
    expected = _reference_dpo(*[x.tolist() for x in tensors], beta=beta, kind=kind)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    if kind == "sigmoid":
        smoothed, _ = dpo_loss(*tensors, beta=beta, loss_type=kind, label_smoothing=0.25)
        expected = _reference_dpo(*[x.tolist() for x in tensors], beta=beta, kind=kind, smoothing=0.25)
        assert smoothed.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_dpo_metrics_random() -> None:
    pc, pr, rc, rr = _random_logps(9, seed=3)
    beta = 0.2
    _, m = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type="sigmoid")
    chosen = [beta * (a - c) for a, c in zip(pc.tolist(), rc.tolist())]
    rejected = [beta * (b - d) for b, d in zip(pr.tolist(), rr.tolist())]
    assert m["rewards/chosen"].item() == pytest.approx(sum(chosen) / 9, rel=1e-5)
    assert m["rewards/rejected"].item() == pytest.approx(sum(rejected) / 9, rel=1e-5)
    assert m["rewards/margins"].item() == pytest.approx((sum(chosen) - sum(rejected)) / 9, rel=1e-5, abs=1e-6)
    assert m["rewards/accuracies"].item() == pytest.approx(sum(c > r for c, r in zip(chosen, rejected)) / 9)
    assert m["logps/chosen"].item() == pytest.approx(pc.mean().item(), rel=1e-6)
    assert all(not v.requires_grad for v in m.values())


def test_dpo_gradients_analytic_finite_and_reference_frozen() -> None:
    pc, pr, rc, rr = _random_logps(5, seed=11)
    pc.requires_grad_()
    pr.requires_grad_()
    rc.requires_grad_()
    beta = 0.3
    loss, _ = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type="sigmoid")
    loss.backward()
    h = (pc - rc - pr + rr).detach()
    expected = -beta * torch.sigmoid(-beta * h) / 5  # d/d pi_w of -mean log sigmoid(beta h)
    torch.testing.assert_close(pc.grad, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(pr.grad, -expected, rtol=1e-5, atol=1e-7)
    assert rc.grad is None  # the reference model is not trained
    for kind in ("hinge", "ipo"):
        x = pc.detach().clone().requires_grad_()
        loss, _ = dpo_loss(x, pr.detach(), rc.detach(), rr, beta=beta, loss_type=kind)
        loss.backward()
        assert torch.isfinite(x.grad).all()
    x = pc.detach().clone().requires_grad_()
    dpo_loss(x, pr.detach(), rc.detach(), rr, beta=beta, loss_type="ipo")[0].backward()
    torch.testing.assert_close(x.grad, 2 * (h - 1 / (2 * beta)) / 5, rtol=1e-5, atol=1e-7)


def test_dpo_sft_term() -> None:
    pc, pr, rc, rr = _random_logps(4, seed=5)
    nll = torch.tensor([1.5, 2.0, 0.5, 3.0], requires_grad=True)
    base, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid")
    both, m = dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type=["sigmoid", "sft"], chosen_nll=nll, sft_loss_weight=0.5)
    assert both.item() == pytest.approx(base.item() + 0.5 * 1.75, rel=1e-6)
    assert m["nll_loss"].item() == pytest.approx(1.75)
    both.backward()
    torch.testing.assert_close(nll.grad, torch.full((4,), 0.5 / 4))
    # the config's spelling: a plain loss_type with sft_loss_weight > 0 adds the same term
    weighted, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid", chosen_nll=nll, sft_loss_weight=0.5)
    assert weighted.item() == pytest.approx(both.item(), rel=1e-6)
    only, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type="sft", chosen_nll=torch.tensor(2.5))
    assert only.item() == pytest.approx(2.5)  # listed without a weight: weight 1
    # without "sft" the NLL is only logged
    logged, m = dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid", chosen_nll=nll)
    assert logged.item() == pytest.approx(base.item()) and m["nll_loss"].item() == pytest.approx(1.75)


def test_dpo_loss_type_parsing_and_errors() -> None:
    assert parse_dpo_loss_type("hinge") == ("hinge", False)
    assert parse_dpo_loss_type(["ipo", "sft"]) == ("ipo", True)
    assert parse_dpo_loss_type(["sft"]) == (None, True)
    assert uses_length_normalised_log_probs("ipo") and not uses_length_normalised_log_probs(["sigmoid", "sft"])
    pc, pr, rc, rr = _random_logps(3, seed=1)
    with pytest.raises(ValueError, match=r"model_alignment_strategy\.dpo\.loss_type.*'sigmoid', 'hinge', 'ipo'"):
        dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type="kto")
    with pytest.raises(ValueError, match="at most one"):
        parse_dpo_loss_type(["sigmoid", "ipo"])
    with pytest.raises(ValueError, match="loss_type"):
        parse_dpo_loss_type([])
    with pytest.raises(ValueError, match="kl_beta"):
        dpo_loss(pc, pr, rc, rr, beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing.*only defined"):
        dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type="hinge", label_smoothing=0.1)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(pc, pr, rc, rr, beta=0.1, label_smoothing=0.7)
    with pytest.raises(ValueError, match="chosen_nll"):
        dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type=["sigmoid", "sft"])
    with pytest.raises(ValueError, match="chosen_nll"):
        dpo_loss(pc, pr, rc, rr, beta=0.1, sft_loss_weight=0.3)
    with pytest.raises(ValueError, match="sft_loss_weight"):
        dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type=["sigmoid", "sft"], chosen_nll=pc, sft_loss_weight=-1.0)
    with pytest.raises(ValueError, match="lists 'sft'.*sft_loss_weight is 0"):
        dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type=["sigmoid", "sft"], chosen_nll=pc, sft_loss_weight=0.0)
    with pytest.raises(ValueError, match="same shape"):
        dpo_loss(pc, pr[:2], rc, rr, beta=0.1)


def _reference_orpo(cm: list[float], rm: list[float], nll: list[float], beta: float) -> float:
    """ORPO from Hong et al. eqs. 4-7 in float64: mean NLL - beta * mean log sigmoid(log odds ratio)."""
    def log_odds(m: float) -> float:
        return m - math.log(-math.expm1(m))

    ratios = [_log_sigmoid(log_odds(a) - log_odds(b)) for a, b in zip(cm, rm)]
    return sum(nll) / len(nll) - beta * sum(ratios) / len(ratios)


def test_orpo_matches_formula_and_metrics() -> None:
    g = torch.Generator().manual_seed(7)
    cm = -(torch.rand(6, generator=g, dtype=torch.float64) * 3 + 0.05)
    rm = -(torch.rand(6, generator=g, dtype=torch.float64) * 3 + 0.05)
    nll = -cm
    loss, m = orpo_loss(cm, rm, nll, beta=0.1)
    assert loss.item() == pytest.approx(_reference_orpo(cm.tolist(), rm.tolist(), nll.tolist(), 0.1), rel=1e-5)
    # hand value: m_w = log 0.5 -> odds 1, m_l = log 0.2 -> odds 0.25; log odds ratio = log 4
    hand, hm = orpo_loss(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.2)]), torch.tensor(0.7), 0.5)
    assert hm["log_odds_chosen"].item() == pytest.approx(math.log(4.0), rel=1e-5)
    assert hand.item() == pytest.approx(0.7 + 0.5 * math.log1p(0.25), rel=1e-5)  # -log sigmoid(log 4) = log(1.25)
    assert m["rewards/chosen"].item() == pytest.approx(0.1 * cm.mean().item(), rel=1e-5)
    assert m["rewards/accuracies"].item() == pytest.approx((cm > rm).double().mean().item())
    assert m["rewards/margins"].item() == pytest.approx(0.1 * (cm - rm).mean().item(), rel=1e-4, abs=1e-7)
    assert m["nll_loss"].item() == pytest.approx(nll.mean().item(), rel=1e-6)
    with pytest.raises(ValueError, match=r"model_alignment_strategy\.orpo\.beta"):
        orpo_loss(cm, rm, nll, beta=-1.0)
    assert orpo_loss(cm, rm, nll, beta=0.0)[0].item() == pytest.approx(nll.mean().item())  # beta 0: plain SFT


def test_orpo_gradient_matches_formula() -> None:
    cm = torch.tensor([-0.3, -1.2, -2.0], dtype=torch.float64, requires_grad=True)
    rm = torch.tensor([-0.9, -0.4, -5.0], dtype=torch.float64)
    orpo_loss(cm, rm, -cm, beta=0.2)[0].backward()
    # d log_odds / d m = 1 / (1 - exp(m)); d/dm [-beta log sigmoid(z)] = -beta sigmoid(-z) dz/dm; nll term -1/P
    x = cm.detach()
    z = (x - torch.log1p(-x.exp())) - (rm - torch.log1p(-rm.exp()))
    expected = (-1.0 - 0.2 * torch.sigmoid(-z) / (1 - x.exp())) / 3
    torch.testing.assert_close(cm.grad, expected.float(), rtol=1e-5, atol=1e-7, check_dtype=False)


def test_log1mexp_accuracy_fp32() -> None:
    mpmath = pytest.importorskip("mpmath")  # a dependency of sympy, hence of torch
    mpmath.mp.dps = 50
    x = -torch.logspace(-7, 2.5, 200, dtype=torch.float64).float()
    reference = torch.tensor([float(mpmath.log(1 - mpmath.exp(mpmath.mpf(v)))) for v in x.tolist()],
                             dtype=torch.float64)
    torch.testing.assert_close(log1mexp(x).double(), reference, rtol=2e-6, atol=1e-44)
    assert torch.isinf(torch.log1p(-torch.exp(torch.tensor(-1e-8)))).item()  # the naive fp32 form fails here


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_orpo_stable_near_zero_and_very_negative(dtype: torch.dtype) -> None:
    cm = torch.tensor([0.0, -1e-9, -1e-30, -1e-3, -300.0, -1e4], dtype=dtype, requires_grad=True)
    rm = torch.tensor([-1e4, 0.0, -1e-12, -400.0, -1e-7, -50.0], dtype=dtype, requires_grad=True)
    loss, m = orpo_loss(cm, rm, -cm, beta=0.1)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in m.values())
    assert torch.isfinite(cm.grad).all() and torch.isfinite(rm.grad).all()
    # pairs 1 and 2 have both log-probs above the clamp (equal odds): the straight-through clamp keeps gradients
    assert (cm.grad[1:3].float() != 0).all() and (rm.grad[1:3].float() != 0).all()
    # very negative mean log-probs: log odds ~= m, so the ratio is ~ log sigmoid(m_w - m_l)
    far, fm = orpo_loss(torch.tensor([-300.0]), torch.tensor([-400.0]), torch.tensor(0.0), beta=1.0)
    assert fm["log_odds_chosen"].item() == pytest.approx(100.0, rel=1e-6)
    assert far.item() == pytest.approx(math.log1p(math.exp(-100.0)), abs=1e-30)
