"""The tokenizer a run trained with, saved in its run directory (``<log_dir>/tokenizer/``) so that what is made
from its checkpoints (the HF export, :mod:`nxd_lc.app.convert`) uses that tokenizer, not one rebuilt from a config
that may differ (a byte-level BPE trained on another corpus, another vocabulary size).

The checkpoints of a run live in ``<log_dir>/checkpoints`` (:func:`~nxd_lc.lightning.exp_manager.experiment_paths`),
so a checkpoint's run tokenizer is ``<checkpoint root>/../tokenizer`` (:func:`run_tokenizer_dir`).

A resumed run keeps the tokenizer it was trained with, or stops naming what changed (:func:`check_resumed_run`):
the run records its pretraining corpus (``<log_dir>/run_data.json``: each file's relative path, size and SHA-256)
when it starts; a resume whose tokenizer differs from the saved one (a byte-level BPE retrained on an appended
corpus: training would continue the checkpoint's embeddings on other token ids) is refused, naming the changed
files and the fix (``data.tokenizer.type: <log_dir>/tokenizer``); a resume on a changed corpus with the same
tokenizer (the data is repacked, the sample order differs) is refused unless
``exp_manager.resume_allow_changed_corpus`` is true (then a warning names the files).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import uuid
from typing import Any, Optional

import pytorch_lightning as pl

from nxd_lc.config.errors import ConfigError
from nxd_lc.data import corpus
from nxd_lc.data.sources import DocumentSource
from nxd_lc.runtime.files import file_digest

__all__ = ["RUN_DATA_RECORD", "RUN_TOKENIZER_DIR", "SaveRunTokenizer", "check_resumed_run", "copy_tokenizer_files",
           "corpus_record", "corpus_record_of", "run_tokenizer_dir", "save_run_tokenizer"]

log = logging.getLogger(__name__)

#: the run tokenizer's directory name inside the run directory
RUN_TOKENIZER_DIR = "tokenizer"
#: the run's record of its training corpus, in the run directory
RUN_DATA_RECORD = "run_data.json"


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


def corpus_record(source: DocumentSource) -> dict[str, Any]:
    """``{"key": the config key, "files": {relative path: [size, sha256]}}`` of a text / jsonl / datasets source."""
    files = source._content_files()  # noqa: SLF001 - the files its fingerprint reads
    return {"key": source.key_name, "files": {corpus.relative_key(f, source.root): list(file_digest(f))
                                              for f in files}}


def _corpus_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    before, after = old.get("files", {}), new["files"]
    return ([f"added {k}" for k in sorted(set(after) - set(before))]
            + [f"changed {k}" for k in sorted(set(before) & set(after)) if list(before[k]) != list(after[k])]
            + [f"removed {k}" for k in sorted(set(before) - set(after))])


def check_resumed_run(tokenizer: Any, log_dir: str, source: Optional[DocumentSource],
                      allow_changed_corpus: bool = False) -> Optional[dict[str, Any]]:
    """On a resume: the tokenizer must be the run's saved one and the corpus the recorded one (read-only; every
    rank runs it, so all stop together).

    Args:
        tokenizer: this start's tokenizer (the data module's).
        log_dir: the run directory.
        source: the pretraining training source (None: not recorded, e.g. Megatron indexed data or alignment data).
        allow_changed_corpus: ``exp_manager.resume_allow_changed_corpus``.

    Returns:
        This start's corpus record (None without a source).

    Raises:
        ConfigError: the tokenizer differs from ``<log_dir>/tokenizer`` (names it, the changed files and the fix), or
            the corpus changed and ``allow_changed_corpus`` is false (names the files).
    """
    record = corpus_record(source) if source is not None else None
    path = os.path.join(log_dir, RUN_DATA_RECORD)
    changes: list[str] = []
    if record is not None and os.path.isfile(path):
        with open(path) as f:
            changes = _corpus_changes(json.load(f), record)
    listed = ", ".join(changes[:10]) + (f" and {len(changes) - 10} more" if len(changes) > 10 else "")
    saved = os.path.join(log_dir, RUN_TOKENIZER_DIR)
    if os.path.isdir(saved) and not _same_tokenizer(tokenizer, saved):
        why = f" (the corpus changed since the run started: {listed})" if changes else ""
        raise ConfigError([f"data.tokenizer: this resumed run's checkpoints were trained with the tokenizer saved in "
                           f"{saved}, and this start's data.tokenizer gives another one{why}; keep the run's "
                           f"tokenizer with data.tokenizer.type={saved}, or start a new run (another "
                           "exp_manager.name or exp_manager.explicit_log_dir)"])
    if changes and not allow_changed_corpus:
        raise ConfigError([f"{record['key']}: the corpus changed since this run started ({listed}): the data would "
                           "be repacked and the samples after the resume would differ from the run's order; restore "
                           "the files, start a new run, or set exp_manager.resume_allow_changed_corpus=true"])
    if changes:
        log.warning("%s: resuming on a changed corpus (%s): the data is repacked, the sample order differs from "
                    "the run's (exp_manager.resume_allow_changed_corpus)", record["key"], listed)
    return record


def _same_tokenizer(tokenizer: Any, saved: str) -> bool:
    with tempfile.TemporaryDirectory(dir=os.path.dirname(saved), prefix=".tokenizer-check-") as tmp:
        tokenizer.save_pretrained(tmp)
        return _same_files(tmp, saved)


def _train_source(datamodule: Any) -> Optional[DocumentSource]:
    """The pretraining data module's training source (None for Megatron indexed data or another data module)."""
    from nxd_lc.data.datamodule import PretrainingDataModule

    if type(datamodule) is not PretrainingDataModule or datamodule.cfg.data_prefix is not None:
        return None
    return datamodule._sources()[0]  # noqa: SLF001 - the source its setup packed


class SaveRunTokenizer(pl.Callback):
    """Save the data module's tokenizer (and record its corpus) into the run directory on global rank 0, before any
    step or checkpoint. On a resume every rank first runs :func:`check_resumed_run` at ``on_train_start``, the first
    hook that knows the checkpoint (Lightning restores it after ``setup``); a run directory without a saved tokenizer
    gets it already at ``setup``.

    Args:
        log_dir: the run directory (``ExpPaths.log_dir``).
        allow_changed_corpus: ``exp_manager.resume_allow_changed_corpus``.
    """

    def __init__(self, log_dir: str, allow_changed_corpus: bool = False) -> None:
        self.log_dir = log_dir
        self.allow_changed_corpus = allow_changed_corpus

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Save the tokenizer when the run directory holds none yet (fit only; rank 0 only)."""
        if (stage == "fit" and trainer.datamodule is not None and trainer.is_global_zero
                and not os.path.isdir(os.path.join(self.log_dir, RUN_TOKENIZER_DIR))):
            self._save(trainer, corpus_record_of(trainer.datamodule))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Check a resume (all ranks), then save the tokenizer and the corpus record (rank 0).

        Raises:
            ConfigError: from :func:`check_resumed_run`.
        """
        if trainer.datamodule is None:
            return
        if trainer.ckpt_path is not None:
            record = check_resumed_run(trainer.datamodule.tokenizer, self.log_dir, _train_source(trainer.datamodule),
                                       self.allow_changed_corpus)
        else:
            record = corpus_record_of(trainer.datamodule) if trainer.is_global_zero else None
        if trainer.is_global_zero:
            self._save(trainer, record)

    def _save(self, trainer: pl.Trainer, record: Optional[dict[str, Any]]) -> None:
        path = save_run_tokenizer(trainer.datamodule.tokenizer, self.log_dir)
        log.info("saved the run's tokenizer as %s", path)
        if record is not None:
            tmp = os.path.join(self.log_dir, f".{RUN_DATA_RECORD}.partial-{uuid.uuid4().hex[:8]}")
            with open(tmp, "w") as f:
                json.dump(record, f, indent=1, sort_keys=True)
            os.replace(tmp, os.path.join(self.log_dir, RUN_DATA_RECORD))


def corpus_record_of(datamodule: Any) -> Optional[dict[str, Any]]:
    """:func:`corpus_record` of a pretraining data module's training source (None without one)."""
    source = _train_source(datamodule)
    return corpus_record(source) if source is not None else None
