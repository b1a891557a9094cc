"""Held-out data of a run for evaluation: the retrieval haystack (held-out tokens of the run's corpus, never its
training split) and the packed held-out sequences of the loss-by-position evaluation."""

from __future__ import annotations

from typing import Any

import torch

from nxd_lc.config.access import seq_length
from nxd_lc.data.datamodule import PretrainingDataModule

Batch = dict[str, torch.Tensor]


# ------------------------------------------------------------------------------------------------ command line
def heldout_haystack(cfg: Any, model_vocab_size: int, num_tokens: int) -> tuple[Any, list[int]]:
    """``(tokenizer, token ids)``: the run's tokenizer and at least ``num_tokens`` tokens of the held-out split of
    its corpus (``data.val_dir``, else the ``data.val_fraction`` split; never training documents), in order.

    Raises:
        ValueError: the config has no held-out split (names ``data.val_fraction`` / ``data.val_dir``).
    """
    dm = PretrainingDataModule(cfg.data, seq_length=seq_length(cfg) or 0, seed=cfg.seed,
                               model_vocab_size=model_vocab_size, data_parallel_rank=0, data_parallel_size=1,
                               global_batch_size=cfg.data.micro_batch_size)
    dm.setup()
    if dm.val_dataset is None or len(dm.val_dataset) == 0:
        raise ValueError("retrieval haystack: the run's data has no held-out split; set data.val_fraction > 0 or "
                         "data.val_dir (haystacks never come from the training split)")
    tokens: list[int] = []
    for i in range(len(dm.val_dataset)):
        tokens += [int(t) for t in dm.val_dataset[i][:-1]]
        if len(tokens) >= num_tokens:
            break
    return dm.tokenizer, tokens


def heldout_batches(cfg: Any, model_vocab_size: int, num_samples: int, split: str, dp_rank: int,
                     dp_size: int) -> list[Batch]:
    """The first ``num_samples`` packed samples of ``split`` (unshuffled), this DP rank's share, one per batch."""
    dm = PretrainingDataModule(cfg.data, seq_length=seq_length(cfg) or 0, seed=cfg.seed,
                               model_vocab_size=model_vocab_size, data_parallel_rank=0, data_parallel_size=1,
                               global_batch_size=cfg.data.micro_batch_size)
    dm.setup()
    dataset = dm.val_dataset if split == "val" else dm.train_dataset
    if dataset is None or len(dataset) < num_samples:
        have = 0 if dataset is None else len(dataset)
        raise ValueError(f"--num-samples: the {split} split has {have} packed samples of length "
                         f"{seq_length(cfg)}, fewer than {num_samples}; lower --num-samples or raise "
                         + ("the validation share of data.splits_string" if cfg.data.data_prefix is not None
                            else "data.val_fraction"))
    collate = dm.collate_fn()
    return [collate([dataset[i]]) for i in range(dp_rank, num_samples, dp_size)]
