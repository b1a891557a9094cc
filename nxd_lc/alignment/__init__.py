"""Alignment objectives: sequence log-probs from vocab-parallel logits (TP- and CP-aware) and the DPO / ORPO
losses with their reward metrics.

A DPO step: concatenate the chosen and rejected sequences on the batch dim, shard over CP, run the policy once,
``sequence_log_probs`` -> ``split_chosen_rejected`` -> ``dpo_loss`` (see :mod:`nxd_lc.alignment.logprobs` for the
``cp`` factor the training step applies before backward). :class:`NxDPreferenceModel`
(:mod:`nxd_lc.alignment.module`) is that step as a LightningModule; :mod:`nxd_lc.alignment.reference` holds the
DPO reference (frozen copy, or log-probs precomputed once and cached beside the dataset). Both are imported on
first use, so importing the losses does not import Lightning.
"""

from typing import Any

from nxd_lc.alignment.logprobs import (
    all_reduce_context_parallel,
    mean_log_probs,
    sequence_log_probs,
    split_chosen_rejected,
)
from nxd_lc.alignment.losses import (
    DPO_LOSS_TYPES,
    DPO_PREFERENCE_LOSS_TYPES,
    dpo_loss,
    log1mexp,
    orpo_loss,
    parse_dpo_loss_type,
    uses_length_normalised_log_probs,
)

__all__ = [
    "DPO_LOSS_TYPES",
    "NxDPreferenceModel",
    "DPO_PREFERENCE_LOSS_TYPES",
    "all_reduce_context_parallel",
    "dpo_loss",
    "log1mexp",
    "mean_log_probs",
    "orpo_loss",
    "parse_dpo_loss_type",
    "sequence_log_probs",
    "split_chosen_rejected",
    "uses_length_normalised_log_probs",
]


def __getattr__(name: str) -> Any:
    """Lazy export of :class:`~nxd_lc.alignment.module.NxDPreferenceModel` (it imports Lightning)."""
    if name == "NxDPreferenceModel":
        from nxd_lc.alignment.module import NxDPreferenceModel

        return NxDPreferenceModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
