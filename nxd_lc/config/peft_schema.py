"""``model_alignment_strategy.peft:`` — LoRA fine-tuning settings (NxDT / NxD ``LoraConfig`` key names).

LoRA (Hu et al. 2021, arXiv:2106.09685) adds a trainable low-rank update to a frozen linear layer,
``y = W x + (lora_alpha / lora_rank) * B A dropout(x)``, with ``A [r, in]`` Kaiming-uniform and ``B [out, r]``
zero at the start (so training starts from the base model). nxd_lc applies it to the tensor-parallel
projections named in ``target_modules`` (see :mod:`nxd_lc.layers.lora`); no ``peft`` section: no LoRA.
NxDT puts the section beside the alignment algorithm (``model_alignment_strategy: {sft: ..., peft: ...}``, its
``hf_llama3_8B_SFT_lora_config.yaml``); nxd_lc's earlier place ``model.peft`` is still read as that key.

NxDT's keys (``lora_rank``, ``lora_alpha``, ``lora_dropout``, ``lora_bias``, ``target_modules``,
``load_lora_from_ckpt``, ``save_lora_base``, ``merge_lora``, ``lora_verbose``, ``save_lora_config_adapter``,
``merge_sharded_lora``) keep their names. This module holds no torch code:
the schema imports it, and :func:`peft_problems` lists every invalid value at once for ``validate.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

#: The projections LoRA can adapt, by their module names in nxd_lc's Llama (``qkv_proj`` also covers the
#: separate ``q_proj`` / ``k_proj`` / ``v_proj`` of ``model.qkv_linear: false``).
LORA_TARGET_MODULES: tuple[str, ...] = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

#: Accepted ``lora_bias`` values: only ``none`` (biases stay frozen, as NxD's and PEFT's default).
LORA_BIAS_CHOICES: tuple[str, ...] = ("none",)


@dataclass
class PeftConfig:
    """``model_alignment_strategy.peft:`` — LoRA adapters on the TP projections; only the adapters are trained."""

    lora_rank: int = 16  # r: inner dim of the adapters A [r, in] and B [out, r]
    lora_alpha: float = 32.0  # scaling numerator: the update is (lora_alpha / lora_rank) * B @ A
    lora_dropout: float = 0.05  # dropout probability on the adapter input (training only), in [0, 1)
    lora_bias: str = "none"  # none: biases stay frozen (the only supported value)
    target_modules: List[str] = field(default_factory=lambda: ["qkv_proj"])  # of qkv/o/gate_up/down_proj
    merge_lora: bool = False  # at the end of training fold B @ A into the base weights and save the merged model
    save_lora_base: bool = False  # checkpoints hold base weights too (true) or the adapters alone (false)
    load_lora_from_ckpt: bool = False  # load adapters from lora_ckpt_path after wrapping (resume / continue)
    lora_ckpt_path: Optional[str] = None  # lora/adapters.pt of a run, or its lora/ dir of shard files
    lora_verbose: bool = False  # also log the name of every module that gets adapters (NxD)
    save_lora_config_adapter: bool = True  # adapter file holds these settings; false: adapter_config.json beside
    merge_sharded_lora: bool = True  # one adapter file gathered over TP; false: one shard file per TP/PP rank


#: The canonical dotted key of the LoRA section (named in messages).
PEFT_KEY = "model_alignment_strategy.peft"


def peft_problems(peft: Optional[PeftConfig], prefix: str = PEFT_KEY) -> list[str]:
    """Every invalid value of a ``model_alignment_strategy.peft`` section (empty when valid or ``peft`` is None).

    Each message names the key (``prefix.<key>``) and the fix. Checks: ``lora_rank >= 1``,
    ``lora_alpha > 0``, ``0 <= lora_dropout < 1``, ``lora_bias`` in :data:`LORA_BIAS_CHOICES`,
    ``target_modules`` a non-empty, duplicate-free subset of :data:`LORA_TARGET_MODULES`, and
    ``lora_ckpt_path`` given exactly when ``load_lora_from_ckpt`` is true.
    """
    if peft is None:
        return []
    p: list[str] = []
    if isinstance(peft.lora_rank, bool) or not isinstance(peft.lora_rank, int) or peft.lora_rank < 1:
        p.append(f"{prefix}.lora_rank: must be an integer >= 1, got {peft.lora_rank!r}")
    if not isinstance(peft.lora_alpha, (int, float)) or peft.lora_alpha <= 0:
        p.append(f"{prefix}.lora_alpha: must be > 0 (the update is scaled by lora_alpha / lora_rank), "
                 f"got {peft.lora_alpha!r}")
    if not isinstance(peft.lora_dropout, (int, float)) or not 0.0 <= peft.lora_dropout < 1.0:
        p.append(f"{prefix}.lora_dropout: must be in [0, 1), got {peft.lora_dropout!r}")
    if peft.lora_bias not in LORA_BIAS_CHOICES:
        p.append(f"{prefix}.lora_bias: {peft.lora_bias!r} is not supported; use none (biases stay frozen)")
    p.extend(target_module_problems(peft.target_modules, f"{prefix}.target_modules"))
    if peft.load_lora_from_ckpt and not peft.lora_ckpt_path:
        p.append(f"{prefix}.lora_ckpt_path: required when {prefix}.load_lora_from_ckpt is true")
    if peft.lora_ckpt_path and not peft.load_lora_from_ckpt:
        p.append(f"{prefix}.lora_ckpt_path: set {prefix}.load_lora_from_ckpt: true to load it, or remove it")
    return p


def target_module_problems(target_modules: object, key: str = f"{PEFT_KEY}.target_modules") -> list[str]:
    """Problems of a ``target_modules`` list: not a list of names, empty, duplicates or unknown names."""
    valid = ", ".join(LORA_TARGET_MODULES)
    if isinstance(target_modules, str) or not isinstance(target_modules, (list, tuple)):
        return [f"{key}: must be a list of module names (a subset of {valid}), got {target_modules!r}"]
    if not target_modules:
        return [f"{key}: must name at least one module; choose from {valid}"]
    p: list[str] = []
    unknown = [t for t in target_modules if t not in LORA_TARGET_MODULES]
    if unknown:
        p.append(f"{key}: unknown module name(s) {unknown}; valid names: {valid}")
    dupes = sorted({t for t in target_modules if list(target_modules).count(t) > 1})
    if dupes:
        p.append(f"{key}: {dupes} listed more than once; list each module once")
    return p
