"""The tokenizer a run trained with, saved in its run directory (``<log_dir>/tokenizer/``) so that what is made
from its checkpoints (the HF export, :mod:`nxd_lc.app.convert`) uses that tokenizer, not one rebuilt from a config
that may differ (a byte-level BPE trained on another corpus, another vocabulary size).

The checkpoints of a run live in ``<log_dir>/checkpoints`` (:func:`~nxd_lc.lightning.exp_manager.experiment_paths`),
so a checkpoint's run tokenizer is ``<checkpoint root>/../tokenizer`` (:func:`run_tokenizer_dir`).
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from typing import Any

import pytorch_lightning as pl

__all__ = ["RUN_TOKENIZER_DIR", "SaveRunTokenizer", "copy_tokenizer_files", "run_tokenizer_dir", "save_run_tokenizer"]

log = logging.getLogger(__name__)

#: the run tokenizer's directory name inside the run directory
RUN_TOKENIZER_DIR = "tokenizer"


def run_tokenizer_dir(checkpoint_root: str) -> str:
    """Where the run whose checkpoints are in ``checkpoint_root`` (``<log_dir>/checkpoints``) saved its tokenizer."""
    return os.path.join(os.path.dirname(os.path.abspath(checkpoint_root)), RUN_TOKENIZER_DIR)


def copy_tokenizer_files(src: str, dst: str) -> None:
    """Copy the tokenizer files of directory ``src`` (a saved run tokenizer: regular files, links skipped) into the
    existing directory ``dst``."""
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if os.path.isfile(path) and not os.path.islink(path):
            shutil.copyfile(path, os.path.join(dst, name))


def _same_files(a: str, b: str) -> bool:
    """Whether directories ``a`` and ``b`` hold the same file names with the same bytes."""
    names = sorted(os.listdir(a))
    if names != sorted(os.listdir(b)):
        return False
    for name in names:
        with open(os.path.join(a, name), "rb") as fa, open(os.path.join(b, name), "rb") as fb:
            if fa.read() != fb.read():
                return False
    return True


def save_run_tokenizer(tokenizer: Any, log_dir: str) -> str:
    """Save ``tokenizer`` (``save_pretrained``) as ``<log_dir>/tokenizer``, atomically (a hidden sibling renamed
    into place). An identical saved tokenizer is kept; a different one (a resumed run whose ``data.tokenizer``
    changed) is replaced with a warning, since the checkpoints saved from now on are trained with the new one.

    Returns:
        The tokenizer directory.
    """
    final = os.path.join(log_dir, RUN_TOKENIZER_DIR)
    staging = os.path.join(log_dir, f".{RUN_TOKENIZER_DIR}.partial-{uuid.uuid4().hex[:8]}")
    tokenizer.save_pretrained(staging)
    if os.path.isdir(final) and not os.path.islink(final):
        if _same_files(staging, final):
            shutil.rmtree(staging)
            return final
        log.warning("%s holds another tokenizer than this run's data.tokenizer: replaced (checkpoints saved "
                    "before this start were trained with the old one)", final)
        old = os.path.join(log_dir, f".{RUN_TOKENIZER_DIR}.old-{uuid.uuid4().hex[:8]}")
        os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, final)
    return final


class SaveRunTokenizer(pl.Callback):
    """On global rank 0, save the data module's tokenizer into the run directory once it is set up (Lightning's
    ``setup`` hook runs after the data module's), before any step or checkpoint.

    Args:
        log_dir: the run directory (``ExpPaths.log_dir``).
    """

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Save ``trainer.datamodule.tokenizer`` (fit only; rank 0 only)."""
        if stage != "fit" or not trainer.is_global_zero or trainer.datamodule is None:
            return
        path = save_run_tokenizer(trainer.datamodule.tokenizer, self.log_dir)
        log.info("saved the run's tokenizer as %s", path)
