"""NxDT's older SFT layout, read as ``model_alignment_strategy.sft`` (a structural key mapping, applied by
:func:`nxd_lc.config.structure.typed_config` with the other NxDT spellings, so the rest of nxd_lc sees an ordinary
SFT config).

Until its alignment data module replaced it (December 2024, before release 2.22), NxDT's ``examples/training.py``
chose its SFT data module, for either model source, with ``data.use_sft_style_data_module: true`` ("used when we
want to set the HF style dataloader for megatron model code"): NxDT ``{"input", "output"}`` records from the
``data.train_dir`` / ``data.val_dir`` jsonl files, the first ``data.dev_choose_samples`` of them, prompt tokens
masked from the loss, and with ``data.packing: true`` several records packed into one ``data.seq_length`` row (else
each padded). NxDT's ``megatron_llama2_7B_SFT_config.yaml`` still carries these keys, with no
``model_alignment_strategy``. Here they mean exactly ``model_alignment_strategy: {sft: {packing: <data.packing>}}``:

* ``use_sft_style_data_module: true`` adds ``model_alignment_strategy.sft`` (beside a LoRA ``peft`` section if one
  is given); with ``dpo`` / ``orpo`` it is an error;
* ``packing`` becomes ``model_alignment_strategy.sft.packing`` in an SFT run (also one selected by
  ``model_alignment_strategy.sft``); a different value there is an error, and so is ``packing`` in a run that is
  not SFT (pretraining packs documents regardless, DPO / ORPO pairs are never packed);
* ``use_sft_style_data_module: false`` keeps a pretraining run as it is; with ``model_alignment_strategy`` it is an
  error (alignment always reads ``data.train_dir`` records);
* in that layout the Megatron indexed-data keys the file keeps from the pretraining template (``data_impl: mmap``,
  ``skip_warmup: true``, ...), which NxDT's SFT data module never read, are dropped (logged) when they hold their
  default values; another value stays and is refused by the Megatron data rules (it would need ``data_prefix``).
"""

from __future__ import annotations

import logging
from typing import Any

from nxd_lc.config.schema import MEGATRON_DATA_KEY_DEFAULTS

log = logging.getLogger(__name__)

USE_KEY = "data.use_sft_style_data_module"
PACKING_KEY = "data.packing"
SFT_PACKING_KEY = "model_alignment_strategy.sft.packing"
_ALGORITHMS = ("sft", "dpo", "orpo")


def map_sft_style_layout(data: dict[str, Any], problems: list[str]) -> None:
    """Rewrite the raw config ``data`` (a plain dict, interpolations resolved) in place: the keys
    ``data.use_sft_style_data_module`` and ``data.packing`` are removed and read as ``model_alignment_strategy.sft``
    (module docstring). Conflicts are appended to ``problems``, each naming the keys and the fix."""
    section = data.get("data")
    if not isinstance(section, dict) or ("use_sft_style_data_module" not in section and "packing" not in section):
        return
    use, packing = section.pop("use_sft_style_data_module", None), section.pop("packing", None)
    if use is None and packing is None:
        return
    bad = [f"{key}: invalid value {value!r} (expected true or false)" for key, value in
           ((USE_KEY, use), (PACKING_KEY, packing)) if value is not None and not isinstance(value, bool)]
    if bad:
        problems.extend(bad)
        return
    strategy = data.get("model_alignment_strategy")
    algorithms = [a for a in _ALGORITHMS if isinstance(strategy, dict) and strategy.get(a) is not None]
    if use is False:
        _not_sft_style(packing, algorithms, problems)
        return
    if use is None and "sft" not in algorithms:
        if packing is not None:
            run = f"model_alignment_strategy.{algorithms[0]}" if algorithms else "pretraining"
            problems.append(f"{PACKING_KEY}: packs SFT records (NxDT's older SFT layout), but this run is {run}; "
                            f"remove it, or select SFT with {USE_KEY}: true (or model_alignment_strategy.sft)")
        return
    others = [a for a in algorithms if a != "sft"]
    if others:
        problems.append(f"{USE_KEY}: true selects SFT (NxDT's older SFT layout), but model_alignment_strategy sets "
                        f"{', '.join(others)}; remove {USE_KEY} (and {PACKING_KEY}): model_alignment_strategy "
                        "chooses the algorithm")
        return
    _read_as_sft(data, section, use, packing, problems)


def _not_sft_style(packing: bool | None, algorithms: list[str], problems: list[str]) -> None:
    """``use_sft_style_data_module: false``: a pretraining run (NxDT's Megatron / HF data module)."""
    if packing is not None:
        problems.append(f"{PACKING_KEY}: {str(packing).lower()} packs SFT records, but {USE_KEY}: false turns NxDT's "
                        f"SFT data module off; set {USE_KEY}: true for SFT on data.train_dir records, or remove "
                        f"{PACKING_KEY}")
    if algorithms:
        problems.append(f"{USE_KEY}: false, but model_alignment_strategy.{algorithms[0]} reads data.train_dir "
                        f"records with the alignment data module; remove {USE_KEY}")


def _read_as_sft(data: dict[str, Any], section: dict[str, Any], use: bool | None, packing: bool | None,
                 problems: list[str]) -> None:
    strategy = data.get("model_alignment_strategy")
    if strategy is None:
        strategy = data["model_alignment_strategy"] = {}
    sft = strategy.get("sft") if isinstance(strategy, dict) else None
    if isinstance(strategy, dict) and sft is None:
        sft = strategy["sft"] = {}
    if not isinstance(sft, dict):
        return  # not a mapping: reported by the key checks (model_alignment_strategy[.sft]: must be a mapping)
    given = sft.get("packing")
    if packing is not None and isinstance(given, bool) and given != packing:
        problems.append(f"{PACKING_KEY}: {str(packing).lower()} disagrees with {SFT_PACKING_KEY}: "
                        f"{str(given).lower()}; give it once, as {SFT_PACKING_KEY} (NxDT's current place)")
        return
    if packing is not None:
        sft["packing"] = packing
    read = [f"'{USE_KEY}: true'"] if use else []
    read += [f"'{PACKING_KEY}: {str(packing).lower()}'"] if packing is not None else []
    log.info("config: %s (NxDT's older SFT layout) is read as 'model_alignment_strategy.sft' (packing: %s)",
             " + ".join(read), str(sft.get("packing", False)).lower())
    if use:
        _drop_megatron_defaults(section)


def _drop_megatron_defaults(section: dict[str, Any]) -> None:
    """The Megatron indexed-data keys at their default values, which NxDT's SFT data module never read."""
    if section.get("data_prefix") is not None:
        return  # refused by the alignment rules (data.data_prefix is pretraining data)
    dropped = [k for k, default in MEGATRON_DATA_KEY_DEFAULTS.items()
               if section.get(k) is not None and section[k] == default and type(section[k]) is type(default)]
    for key in dropped:
        section.pop(key)
    if dropped:
        log.info("config: data.%s: Megatron indexed-data keys at their default values, not read by SFT (NxDT's "
                 "SFT data module ignores them too); dropped", ", data.".join(dropped))
