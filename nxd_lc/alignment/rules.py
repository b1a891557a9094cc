"""Validation rules of ``model_alignment_strategy`` (SFT / DPO / ORPO) and the alignment ``data.*`` keys.

:func:`validate_alignment` is called by :func:`nxd_lc.app.validation.load_config`; its messages join the collected
errors. DPO's ``loss_type`` is checked by the losses' own parser (:func:`nxd_lc.alignment.losses.parse_dpo_loss_type`),
so there is one list of names.
"""

from __future__ import annotations

from typing import Any, List, Optional

from nxd_lc.alignment.losses import parse_dpo_loss_type
from nxd_lc.config.alignment_schema import (
    PRETRAINING_ONLY_DATA_KEYS,
    TRUNCATION_MODES,
    DPOConfig,
    ModelAlignmentStrategyConfig,
)


def _check_truncation(key: str, value: str, errors: List[str]) -> None:
    if value not in TRUNCATION_MODES:
        errors.append(f"{key}: {value!r} is not one of {list(TRUNCATION_MODES)}")


def _check_prompt_length(key: str, value: Optional[int], seq_length: Optional[int], errors: List[str]) -> None:
    if value is None:
        return
    if value < 1:
        errors.append(f"{key}: must be >= 1, got {value}")
    elif seq_length is not None and value >= seq_length:
        errors.append(f"{key}: {value} leaves no room for the response in data.seq_length {seq_length}; "
                      f"lower it below {seq_length}")


def _check_dpo(dpo: DPOConfig, prefix: str, errors: List[str]) -> None:
    term, loss_type = None, dpo.loss_type
    if not isinstance(loss_type, (str, list, tuple)):
        errors.append(f"{prefix}.loss_type: must be a loss name or a list of names (e.g. sigmoid or [sigmoid, sft]), "
                      f"got {loss_type!r}")
    else:
        try:
            term, _ = parse_dpo_loss_type(loss_type if isinstance(loss_type, str) else list(loss_type))
        except ValueError as e:
            errors.append(str(e))
    if dpo.kl_beta <= 0:
        errors.append(f"{prefix}.kl_beta: must be > 0, got {dpo.kl_beta}")
    if dpo.sft_loss_weight is not None and dpo.sft_loss_weight < 0:
        errors.append(f"{prefix}.sft_loss_weight: must be >= 0, got {dpo.sft_loss_weight}")
    if not 0.0 <= dpo.label_smoothing <= 0.5:
        errors.append(f"{prefix}.label_smoothing: must be in [0, 0.5], got {dpo.label_smoothing}")
    elif dpo.label_smoothing > 0 and term not in (None, "sigmoid"):
        errors.append(f"{prefix}.label_smoothing: only defined for loss_type sigmoid (cDPO), not {term!r}")


def validate_alignment(strategy: Optional[ModelAlignmentStrategyConfig], data: Any,
                       seq_length: Optional[int]) -> List[str]:
    """Problems with ``model_alignment_strategy`` and the alignment ``data.*`` keys, each naming key and fix.

    Args:
        strategy: the section (None: not an alignment run; nothing is checked).
        data: the ``data:`` section (``DataConfig`` with the alignment fields).
        seq_length: the effective sequence length (``data.seq_length`` or ``model.encoder_seq_length``).
    Returns:
        Error messages (empty when valid); the validator raises them together.
    """
    if strategy is None:
        return []
    errors: List[str] = []
    try:
        algorithm = strategy.algorithm
    except ValueError as e:
        return [str(e)]
    if data.train_dir is None:
        errors.append(f"data.train_dir: model_alignment_strategy.{algorithm} needs a .jsonl file, a directory of "
                      ".jsonl files or a datasets save_to_disk directory")
    if getattr(data, "dev_choose_samples", None) is not None and data.dev_choose_samples < 1:
        errors.append(f"data.dev_choose_samples: must be >= 1 or null, got {data.dev_choose_samples}")
    errors += [f"data.{key}: {why}; remove it" for key, why in PRETRAINING_ONLY_DATA_KEYS.items()
               if getattr(data, key, None) is not None]
    prefix = f"model_alignment_strategy.{algorithm}"
    sub = getattr(strategy, algorithm)
    _check_truncation(f"{prefix}.truncation_mode", sub.truncation_mode, errors)
    if algorithm == "dpo":
        _check_dpo(sub, prefix, errors)
    if algorithm == "orpo" and sub.beta < 0:
        errors.append(f"{prefix}.beta: must be >= 0, got {sub.beta}")
    if algorithm in ("dpo", "orpo"):
        _check_prompt_length(f"{prefix}.max_prompt_length", sub.max_prompt_length, seq_length, errors)
    return errors
