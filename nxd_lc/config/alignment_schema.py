"""Typed configuration for alignment fine-tuning (SFT, DPO, ORPO): the ``model_alignment_strategy:`` section
and the new ``data.*`` / ``data.tokenizer.*`` keys read by
:class:`nxd_lc.data.alignment_datamodule.ModelAlignmentDataModule`.

NxDT places the algorithm settings in a top-level ``model_alignment_strategy:`` section (its DPO / ORPO / LoRA
tutorials) with one sub-section per algorithm; exactly one of ``sft``, ``dpo``, ``orpo`` is set for a run. NxDT
spells the DPO prompt cap ``max_dpo_prompt_length`` in its example YAML and ``max_prompt_length`` in its docs;
both are accepted (:data:`ALIGNMENT_KEY_ALIASES`).

Hook-up (done in ``schema.py`` / ``validate.py``, which this module does not edit):

* ``NxdConfig.model_alignment_strategy: Optional[ModelAlignmentStrategyConfig] = None``;
* the fields of :class:`AlignmentDataFields` are added to ``DataConfig``, and :data:`CHAT_TEMPLATE_FIELD_DOC`'s
  field ``chat_template: Optional[str] = "default"`` to ``TokenizerConfig`` (``data.tokenizer.chat_template``:
  the issue's spelling, next to the tokenizer it belongs to). This module does not import ``schema.py``, so
  ``schema.py`` can import it without a cycle;
* :data:`ALIGNMENT_KEY_ALIASES` is appended to ``KEY_ALIASES``;
* the rules (:func:`nxd_lc.alignment.rules.validate_alignment`) live with the alignment package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

from nxd_lc.config.peft_schema import PEFT_KEY, PeftConfig

TRUNCATION_MODES = ("keep_start", "keep_end")
#: ``data.tokenizer.chat_template`` value that selects the tokenizer's own template.
DEFAULT_CHAT_TEMPLATE = "default"


@dataclass
class SFTConfig:
    """``model_alignment_strategy.sft:`` — supervised fine-tuning data layout."""

    packing: bool = False  # True: best-fit-decreasing packing of records into seq_length rows (document-masked)
    truncation_mode: str = "keep_start"  # keep_start | keep_end: which end of an over-long record is kept
    drop_overlong: bool = False  # True: drop records longer than seq_length instead of truncating (counted)


@dataclass
class DPOConfig:
    """``model_alignment_strategy.dpo:`` — Direct Preference Optimization (Rafailov et al. 2023)."""

    kl_beta: float = 0.01  # beta: strength of the implicit KL penalty towards the reference model
    loss_type: Any = "sigmoid"  # sigmoid (DPO) | hinge (SLiC) | ipo (IPO) | sft, or a list e.g. [sigmoid, sft]
    max_prompt_length: Optional[int] = None  # prompt tokens kept when prompt+response > seq_length (None: S // 2)
    truncation_mode: str = "keep_start"  # keep_start | keep_end: which end of an over-long prompt is kept
    precompute_ref_log_probs: bool = True  # True: reference log-probs computed once and cached; False: frozen copy
    sft_loss_weight: Optional[float] = None  # weight of the chosen-NLL term (None: 1 if 'sft' in loss_type, else 0)
    label_smoothing: float = 0.0  # cDPO label smoothing in [0, 0.5] (sigmoid only)


@dataclass
class ORPOConfig:
    """``model_alignment_strategy.orpo:`` — Odds Ratio Preference Optimization (Hong et al. 2024)."""

    beta: float = 0.1  # weight (lambda) of the odds-ratio term added to the chosen NLL
    max_prompt_length: Optional[int] = None  # prompt tokens kept when prompt+response > seq_length (None: S // 2)
    truncation_mode: str = "keep_start"  # keep_start | keep_end: which end of an over-long prompt is kept


@dataclass
class ModelAlignmentStrategyConfig:
    """``model_alignment_strategy:`` — exactly one of ``sft``, ``dpo``, ``orpo``, optionally LoRA (NxDT layout)."""

    sft: Optional[SFTConfig] = None  # supervised fine-tuning
    dpo: Optional[DPOConfig] = None  # direct preference optimization
    orpo: Optional[ORPOConfig] = None  # odds ratio preference optimization
    peft: Optional[PeftConfig] = None  # LoRA adapters on the TP projections (null: full fine-tuning)

    @property
    def algorithm(self) -> str:
        """``'sft'`` | ``'dpo'`` | ``'orpo'``: the one section that is set.

        Raises:
            ValueError: none or several are set (names ``model_alignment_strategy``).
        """
        chosen = [name for name in ("sft", "dpo", "orpo") if getattr(self, name) is not None]
        if not chosen and self.peft is not None:
            raise ValueError(f"{PEFT_KEY}: LoRA trains with an alignment algorithm; set one of sft, dpo, orpo beside "
                             f"it (e.g. 'model_alignment_strategy: {{sft: {{packing: true}}, peft: {{...}}}}'); "
                             "pretraining with LoRA is not supported")
        if len(chosen) != 1:
            raise ValueError(f"model_alignment_strategy: exactly one of sft, dpo, orpo must be set, got "
                             f"{chosen or 'none'}; e.g. 'model_alignment_strategy: {{sft: {{packing: true}}}}'")
        return chosen[0]


#: the ``data.tokenizer.chat_template`` field to add to ``TokenizerConfig`` (type, default, one-line doc)
CHAT_TEMPLATE_FIELD_DOC = ('chat_template: Optional[str] = "default"  # default (the tokenizer\'s own) | null '
                           '(concatenate contents) | a jinja template')


@dataclass
class AlignmentDataFields:
    """The new ``data.*`` keys (merge these fields into ``DataConfig``)."""

    dev_choose_samples: Optional[int] = None  # keep only the first N records of train_dir / val_dir (None: all)
    input_key: str = "input"  # NxDT SFT records: key of the prompt text
    output_key: str = "output"  # NxDT SFT records: key of the response text


#: Accepted spellings, as (dotted alias, dotted canonical key); append to ``schema.KEY_ALIASES``.
ALIGNMENT_KEY_ALIASES: tuple[tuple[str, str], ...] = (
    ("model_alignment_strategy.dpo.max_dpo_prompt_length", "model_alignment_strategy.dpo.max_prompt_length"),
)


#: ``data`` keys only a pretraining run reads (set = not None), with why an alignment run does not.
PRETRAINING_ONLY_DATA_KEYS: dict[str, str] = {
    "builtin_corpus": "a pretraining corpus; alignment reads records from data.train_dir",
    "val_fraction": "a pretraining key (held-out share of the corpus); alignment validates on data.val_dir only",
    "text_key": "a pretraining key (the text column); alignment records are NxDT input/output (data.input_key / "
                "data.output_key), chat messages or prompt/chosen/rejected",
    "cross_document_attention": "a pretraining key; alignment examples are always document-masked (each example "
                                "sees only itself, packed or not)",
    "mixture": "a pretraining key (weighted corpora and synthetic data); alignment reads records from data.train_dir",
    "length_upsampling": "a pretraining key (repeats long corpus documents)",
    "curriculum": "a pretraining key (staged sequence lengths); alignment examples have one data.seq_length",
}
#: ``data`` keys only an alignment run reads (set = not None), with why a pretraining run does not.
ALIGNMENT_ONLY_DATA_KEYS: dict[str, str] = {
    "input_key": "an alignment key (NxDT SFT records); pretraining reads documents with data.text_key",
    "output_key": "an alignment key (NxDT SFT records); pretraining reads documents with data.text_key",
    "dev_choose_samples": "an alignment key (first N records); pretraining reads the whole corpus",
}


def pretraining_data_problems(data: Any) -> List[str]:
    """A pretraining run (no ``model_alignment_strategy``): alignment-only ``data`` keys that are set, each an
    error naming the key (they would be ignored). ``data.tokenizer.chat_template`` counts as set when it is not
    ``default`` (null is a value of its own: concatenate the messages)."""
    errors = [f"data.{key}: {why}; remove it, or add model_alignment_strategy" for key, why in
              ALIGNMENT_ONLY_DATA_KEYS.items() if getattr(data, key, None) is not None]
    if data.tokenizer.chat_template != DEFAULT_CHAT_TEMPLATE:
        errors.append("data.tokenizer.chat_template: an alignment key; pretraining text is not rendered with a chat "
                      "template; remove it, or add model_alignment_strategy")
    return errors


def resolved_max_prompt_length(max_prompt_length: Optional[int], seq_length: int) -> int:
    """The prompt cap in tokens: ``max_prompt_length``, or ``seq_length // 2`` when None."""
    return seq_length // 2 if max_prompt_length is None else int(max_prompt_length)


