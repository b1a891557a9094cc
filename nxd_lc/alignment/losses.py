"""Preference-optimisation objectives: the DPO family (sigmoid / cDPO, hinge / SLiC, IPO, + SFT term) and ORPO.

All inputs are per-example ``[P]`` tensors (``P`` preference pairs of the micro-batch), typically the CP-reduced
outputs of :func:`nxd_lc.alignment.logprobs.sequence_log_probs` split with
:func:`~nxd_lc.alignment.logprobs.split_chosen_rejected`. Losses are computed in fp32 and averaged over the
pairs; metrics are detached fp32 scalars (means over the pairs; no host synchronisation), to be averaged over
data-parallel ranks for logging.

Notation (Rafailov et al. 2023, "Direct Preference Optimization", arXiv:2305.18290):
``pi_w, pi_l`` policy log-probs of the chosen (w) and rejected (l) responses, ``ref_w, ref_l`` the reference
model's, ``beta`` the KL coefficient (``model_alignment_strategy.dpo.kl_beta``), and

    h = (pi_w - ref_w) - (pi_l - ref_l)              the implicit-reward margin (before beta)
    reward_w = beta * (pi_w - ref_w),  reward_l = beta * (pi_l - ref_l)

Log-probabilities are *summed* over the response tokens for ``sigmoid`` and ``hinge``. For ``ipo`` the caller
passes *length-normalised* (per-token mean) log-probs: Azar et al. state IPO on whole-sequence probabilities, but
with summed log-probs the target margin ``1 / (2 beta)`` is length dependent; TRL divides by the completion
length for IPO and we follow TRL (:func:`uses_length_normalised_log_probs` tells the caller which to pass).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "DPO_LOSS_TYPES",
    "DPO_PREFERENCE_LOSS_TYPES",
    "dpo_loss",
    "log1mexp",
    "orpo_loss",
    "parse_dpo_loss_type",
    "uses_length_normalised_log_probs",
]

DPO_PREFERENCE_LOSS_TYPES = ("sigmoid", "hinge", "ipo")
DPO_LOSS_TYPES = (*DPO_PREFERENCE_LOSS_TYPES, "sft")
_LOSS_TYPE_KEY = "model_alignment_strategy.dpo.loss_type"
_ORPO_MAX_LOG_PROB = -1e-6  # mean log-probs above this are clamped in value (not in gradient), see log1mexp


def parse_dpo_loss_type(loss_type: str | Sequence[str]) -> tuple[str | None, bool]:
    """``model_alignment_strategy.dpo.loss_type`` -> ``(preference_term or None, with_sft_term)``.

    ``loss_type`` is one name or a list of names from :data:`DPO_LOSS_TYPES`: at most one preference term
    (``sigmoid``, ``hinge``, ``ipo``) plus optionally ``sft`` (the NLL of the chosen response as an extra
    term, as TRL's ``loss_type: [sigmoid, sft]`` / RPO), e.g. ``sigmoid``, ``[ipo, sft]`` or ``sft``. The config's
    other spelling of the same term is ``model_alignment_strategy.dpo.sft_loss_weight > 0`` (see :func:`dpo_loss`).

    Raises:
        ValueError: an unknown name, an empty list, a repeated name or two preference terms (names the key and
            the accepted values).
    """
    names = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    unknown = [n for n in names if n not in DPO_LOSS_TYPES]
    if unknown or not names or len(set(names)) != len(names):
        raise ValueError(f"{_LOSS_TYPE_KEY}: got {loss_type!r}; expected one of {list(DPO_LOSS_TYPES)} or a list "
                         f"of one of {list(DPO_PREFERENCE_LOSS_TYPES)} plus 'sft' (e.g. [sigmoid, sft])")
    preference = [n for n in names if n in DPO_PREFERENCE_LOSS_TYPES]
    if len(preference) > 1:
        raise ValueError(f"{_LOSS_TYPE_KEY}: got {loss_type!r}; use at most one of "
                         f"{list(DPO_PREFERENCE_LOSS_TYPES)} (optionally with 'sft')")
    return (preference[0] if preference else None), "sft" in names


def uses_length_normalised_log_probs(loss_type: str | Sequence[str]) -> bool:
    """True when the DPO preference term expects per-token mean log-probs (``ipo``, as TRL), False for sums.

    Raises:
        ValueError: as :func:`parse_dpo_loss_type`.
    """
    return parse_dpo_loss_type(loss_type)[0] == "ipo"


def _check_pairs(name: str, **tensors: torch.Tensor) -> torch.Size:
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 1:
        raise ValueError(f"{name}: every per-example input must have the same shape [pairs], got {shapes}")
    return next(iter(tensors.values())).shape


def _preference_losses(h: torch.Tensor, beta: float, term: str, label_smoothing: float) -> torch.Tensor:
    """Per-pair preference loss ``[P]`` of the margin ``h`` (see :func:`dpo_loss` for the formulas)."""
    if term == "sigmoid":
        return -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    if term == "hinge":
        return torch.relu(1.0 - beta * h)
    return (h - 1.0 / (2.0 * beta)) ** 2  # ipo


def _sft_weight(listed: bool, sft_loss_weight: float | None) -> float:
    """The SFT term's weight: ``sft_loss_weight`` when given, else 1.0 if ``sft`` is listed in loss_type, else 0."""
    if sft_loss_weight is None:
        return 1.0 if listed else 0.0
    if not (math.isfinite(sft_loss_weight) and sft_loss_weight >= 0):
        raise ValueError(f"model_alignment_strategy.dpo.sft_loss_weight: must be >= 0, got {sft_loss_weight}")
    if listed and sft_loss_weight == 0:
        raise ValueError(f"{_LOSS_TYPE_KEY} lists 'sft' but model_alignment_strategy.dpo.sft_loss_weight is 0; "
                         f"remove 'sft' or set a positive weight")
    return float(sft_loss_weight)


def _check_dpo_args(beta: float, term: str | None, label_smoothing: float, sft_weight: float,
                    chosen_nll: torch.Tensor | None) -> None:
    if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta > 0):
        raise ValueError(f"model_alignment_strategy.dpo.kl_beta: must be a positive number, got {beta!r}")
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"model_alignment_strategy.dpo.label_smoothing: must be in [0, 0.5], got {label_smoothing}")
    if label_smoothing > 0 and term != "sigmoid":
        raise ValueError(f"model_alignment_strategy.dpo.label_smoothing: {label_smoothing} is only defined for "
                         f"loss_type sigmoid (cDPO), not {term!r}; set it to 0")
    if sft_weight > 0 and chosen_nll is None:
        raise ValueError("dpo_loss: the SFT term (model_alignment_strategy.dpo.sft_loss_weight > 0 or 'sft' in "
                         "loss_type) needs chosen_nll, the NLL of the chosen responses")


def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
             ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor, beta: float,
             loss_type: str | Sequence[str] = "sigmoid", label_smoothing: float = 0.0,
             chosen_nll: torch.Tensor | None = None,
             sft_loss_weight: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO-family loss of a micro-batch of preference pairs, and its reward metrics.

    Per pair, with ``h`` and the rewards as in the module docstring (``s = label_smoothing``):

    * ``sigmoid`` -- DPO (Rafailov et al. 2023, arXiv:2305.18290, eq. 7); with ``s > 0`` conservative DPO
      (cDPO, Mitchell 2023, "A note on DPO with noisy preferences"; TRL's ``label_smoothing``):
      ``-(1 - s) log sigmoid(beta h) - s log sigmoid(-beta h)``.
    * ``hinge`` -- SLiC's calibration loss (Zhao et al. 2023, "SLiC-HF", arXiv:2305.10425, with ``delta = 1`` and
      ``beta`` scaling the margin as in TRL): ``max(0, 1 - beta h)``.
    * ``ipo`` -- IPO (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
      Preferences", arXiv:2310.12036, eq. 17 with ``tau = beta``): ``(h - 1 / (2 beta))^2``; pass length-normalised
      log-probs (module docstring).
    * SFT (extra term) -- ``sft_loss_weight * mean(chosen_nll)``, the NLL of the chosen response (RPO, Pang
      et al. 2024, arXiv:2404.19733; TRL's ``loss_type: [..., sft]``). Added when ``sft_loss_weight > 0``
      (the config's convention) or when ``sft`` is listed in ``loss_type`` (weight 1.0 unless given).

    Args:
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps: ``[P]`` float
            (summed, or per-token mean for ``ipo``); the reference ones are used without gradient.
        beta: ``kl_beta`` > 0.
        loss_type: a name or list of names, see :func:`parse_dpo_loss_type`.
        label_smoothing: cDPO's ``s`` in ``[0, 0.5]``, sigmoid only.
        chosen_nll: ``[P]`` or scalar NLL of the chosen responses (e.g. ``-mean_log_probs`` of them); needed for
            the SFT term, otherwise only logged as ``nll_loss`` when given.
        sft_loss_weight: weight of the SFT term (>= 0); ``None``: 1.0 if ``sft`` is in ``loss_type``, else 0.

    Returns:
        ``(loss, metrics)``: ``loss`` fp32 scalar (mean over pairs, plus the SFT term); ``metrics`` detached fp32
        scalars ``rewards/chosen``, ``rewards/rejected`` (mean rewards), ``rewards/accuracies`` (fraction of pairs
        with ``reward_w > reward_l``), ``rewards/margins`` (mean ``reward_w - reward_l``), ``logps/chosen``,
        ``logps/rejected`` (mean policy log-probs) and ``nll_loss`` when ``chosen_nll`` is given.

    Raises:
        ValueError: unknown ``loss_type`` (names ``model_alignment_strategy.dpo.loss_type`` and the accepted
            values), ``beta <= 0``, label smoothing out of range or with a non-sigmoid loss, an SFT term without
            ``chosen_nll``, a negative ``sft_loss_weight`` (or 0 with ``sft`` listed), or inputs of different
            shapes.
    """
    term, listed_sft = parse_dpo_loss_type(loss_type)
    sft_weight = _sft_weight(listed_sft, sft_loss_weight)
    _check_dpo_args(beta, term, label_smoothing, sft_weight, chosen_nll)
    _check_pairs("dpo_loss", policy_chosen_logps=policy_chosen_logps, policy_rejected_logps=policy_rejected_logps,
                 ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps)
    chosen_ratio = policy_chosen_logps.float() - ref_chosen_logps.detach().float()  # [P]
    rejected_ratio = policy_rejected_logps.float() - ref_rejected_logps.detach().float()
    loss = policy_chosen_logps.new_zeros((), dtype=torch.float32)
    if term is not None:
        loss = _preference_losses(chosen_ratio - rejected_ratio, beta, term, label_smoothing).mean()
    if sft_weight > 0:
        loss = loss + sft_weight * chosen_nll.float().mean()
    metrics = _reward_metrics(beta * chosen_ratio, beta * rejected_ratio)
    metrics["logps/chosen"] = policy_chosen_logps.detach().float().mean()
    metrics["logps/rejected"] = policy_rejected_logps.detach().float().mean()
    if chosen_nll is not None:
        metrics["nll_loss"] = chosen_nll.detach().float().mean()
    return loss, metrics


def _reward_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> dict[str, torch.Tensor]:
    """The four ``rewards/*`` metrics (detached fp32 scalars) of ``[P]`` reward tensors."""
    chosen, rejected = chosen_rewards.detach().float(), rejected_rewards.detach().float()
    return {
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/accuracies": (chosen > rejected).float().mean(),
        "rewards/margins": (chosen - rejected).mean(),
    }


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x <= 0``, accurate everywhere (Maechler 2012, "Accurately computing
    log(1 - exp(-|a|))"): ``log(-expm1(x))`` for ``x > -log 2``, ``log1p(-exp(x))`` otherwise. ``-inf`` at 0.

    Shapes: elementwise, any shape, float. Values > 0 give NaN (not a log-probability).
    """
    near_zero = x > -math.log(2.0)
    safe_near = torch.where(near_zero, x, torch.full_like(x, -1.0))  # keep the unused branch finite for autograd
    safe_far = torch.where(near_zero, torch.full_like(x, -1.0), x)
    return torch.where(near_zero, torch.log(-torch.expm1(safe_near)), torch.log1p(-torch.exp(safe_far)))


def orpo_loss(chosen_logps_mean: torch.Tensor, rejected_logps_mean: torch.Tensor, chosen_nll: torch.Tensor,
              beta: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ORPO loss (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference Model",
    arXiv:2403.07691, eqs. 4-7): ``L = mean(chosen_nll) - beta * mean(log sigmoid(log_odds))`` with

        log odds(y) = m - log(1 - exp(m))       m = mean per-token log p(y | x) (length-normalised)
        log_odds    = log odds(y_w) - log odds(y_l)

    (``beta`` is the paper's ``lambda``; ``model_alignment_strategy.orpo.beta``). ``log(1 - exp(m))`` uses
    :func:`log1mexp`; ``m`` above ``-1e-6`` (probability ~1, where the odds diverge) is clamped in value only, the
    gradient passing through unchanged, so the loss and its gradients stay finite for any ``m <= 0``.

    Args:
        chosen_logps_mean, rejected_logps_mean: ``[P]`` float, per-token mean log-probs of the responses
            (:func:`nxd_lc.alignment.logprobs.mean_log_probs`), ``<= 0``.
        chosen_nll: ``[P]`` or scalar, the SFT NLL of the chosen responses (e.g. ``-chosen_logps_mean``).
        beta: the odds-ratio weight ``lambda`` >= 0 (0: plain SFT on the chosen responses).

    Returns:
        ``(loss, metrics)``: fp32 scalar loss; metrics (detached fp32 scalars) ``rewards/chosen`` and
        ``rewards/rejected`` (``beta * mean log-probs``, as TRL), ``rewards/accuracies``, ``rewards/margins``,
        ``log_odds_ratio`` (mean ``log sigmoid(log_odds)``), ``log_odds_chosen`` (mean ``log_odds``), ``nll_loss``.

    Raises:
        ValueError: ``beta < 0`` (names ``model_alignment_strategy.orpo.beta``) or inputs of different shapes.
    """
    if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta >= 0):
        raise ValueError(f"model_alignment_strategy.orpo.beta: must be a number >= 0, got {beta!r}")
    _check_pairs("orpo_loss", chosen_logps_mean=chosen_logps_mean, rejected_logps_mean=rejected_logps_mean)
    log_odds = _log_odds(chosen_logps_mean.float()) - _log_odds(rejected_logps_mean.float())  # [P]
    ratio = F.logsigmoid(log_odds)
    nll = chosen_nll.float().mean()
    loss = nll - beta * ratio.mean()
    metrics = _reward_metrics(beta * chosen_logps_mean.float(), beta * rejected_logps_mean.float())
    metrics.update({"log_odds_ratio": ratio.detach().mean(), "log_odds_chosen": log_odds.detach().mean(),
                    "nll_loss": nll.detach()})
    return loss, metrics


def _log_odds(mean_logps: torch.Tensor) -> torch.Tensor:
    """``m - log(1 - exp(m))`` with ``m`` clamped to ``<= -1e-6`` in value (straight-through gradient)."""
    clamped = mean_logps - (mean_logps - mean_logps.clamp(max=_ORPO_MAX_LOG_PROB)).detach()
    return clamped - log1mexp(clamped)
