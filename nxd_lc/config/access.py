"""Accessors of a typed :class:`~nxd_lc.config.schema.NxdConfig` that several packages need: paths, the
training sequence length, the data-parallel size, the LoRA block. Nothing here reads files or validates.
"""

from __future__ import annotations

import os

from nxd_lc.config.peft_schema import PeftConfig
from nxd_lc.config.schema import NxdConfig


def resolve_path(path: str) -> str:
    """Absolute path of ``path``; relative paths are taken from the launch directory (Hydra keeps the cwd)."""
    return os.path.abspath(os.path.expanduser(path))


def seq_length(cfg: NxdConfig) -> int | None:
    """The training sequence length: ``data.seq_length``, else ``model.encoder_seq_length``."""
    return cfg.data.seq_length if cfg.data.seq_length is not None else cfg.model.encoder_seq_length


def model_seq_length(cfg: NxdConfig) -> int | None:
    """The model's sequence length (what its RoPE scaling is judged by): ``model.encoder_seq_length``, else
    ``data.seq_length``. Training may use shorter sequences (``data.seq_length <= model.encoder_seq_length``)."""
    return cfg.model.encoder_seq_length if cfg.model.encoder_seq_length is not None else cfg.data.seq_length


def peft_config(cfg: NxdConfig) -> PeftConfig | None:
    """The LoRA settings, ``model_alignment_strategy.peft`` (None: no LoRA)."""
    return None if cfg.model_alignment_strategy is None else cfg.model_alignment_strategy.peft


def data_parallel_size(cfg: NxdConfig) -> int:
    """DP = world / (TP * PP * CP), with world = trainer.devices * trainer.num_nodes."""
    ds = cfg.distributed_strategy
    mp = ds.tensor_model_parallel_size * ds.pipeline_model_parallel_size * ds.context_parallel_size
    return max(1, (cfg.trainer.devices * cfg.trainer.num_nodes) // max(mp, 1))
