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


def microbatch_problem(global_batch_size: int, micro_batch_size: int, data_parallel_size: int) -> str | None:
    """The config problem when ``global_batch_size`` is not a whole number of ``micro_batch_size x DP`` batches
    (NxD's ``num_microbatches``, Lightning's gradient accumulation), else None: the one wording of this rule for
    validation, the data modules and the trainer."""
    if micro_batch_size < 1 or data_parallel_size < 1 or global_batch_size % (micro_batch_size * data_parallel_size):
        return (f"data.global_batch_size: {global_batch_size} is not divisible by micro_batch_size x DP = "
                f"{micro_batch_size} x {data_parallel_size}; gradient accumulation = global / (micro x DP) must be "
                "an integer")
    return None


def num_microbatches(global_batch_size: int, micro_batch_size: int, data_parallel_size: int) -> int:
    """``global_batch_size / (micro_batch_size x DP)``: micro-batches per optimizer step and DP rank (NxD).

    Raises:
        ValueError: not a whole number (:func:`microbatch_problem`'s message, naming ``data.global_batch_size``).
    """
    problem = microbatch_problem(global_batch_size, micro_batch_size, data_parallel_size)
    if problem is not None:
        raise ValueError(problem)
    return global_batch_size // (micro_batch_size * data_parallel_size)
