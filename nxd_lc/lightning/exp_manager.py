"""``exp_manager``: log directory, loggers, text log files, checkpoint callback and resume (NeMo/NxDT semantics).

Layout of a run directory (``explicit_log_dir``, else ``exp_dir/name``, default ``./nxd_lc_runs/<name>``)::

    <log_dir>/
      checkpoints/<tag>/{model,optim}/dp_rank_XX_tp_rank_XX_pp_rank_XX.pt[.tensors/]  done  user_content.pt
      tensorboard/events.out.tfevents.*           (create_tensorboard_logger)
      tensorboard/hparams.yaml                    (the resolved config of the latest launch)
      nxd_lc_log_globalrank-<r>_localrank-<l>.txt (rank 0 only when log_local_rank_0_only, else every rank)
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import Optional

from omegaconf import OmegaConf
from pytorch_lightning.loggers import Logger

from nxd_lc.checkpoint import integrity, sharded
from nxd_lc.config.access import resolve_path
from nxd_lc.config.errors import ConfigError
from nxd_lc.config.run_record import resolved_config_yaml
from nxd_lc.config.schema import NxdConfig
from nxd_lc.distributed import collectives
from nxd_lc.lightning.callbacks import NxDModelCheckpoint, NxDTensorBoardLogger
from nxd_lc.lightning.run_lock import RunLock

log = logging.getLogger(__name__)


@dataclass
class ExpPaths:
    """Directories of a run."""

    log_dir: str  # run directory
    checkpoint_dir: str  # <log_dir>/checkpoints


def experiment_paths(cfg: NxdConfig) -> ExpPaths:
    """The run's log and checkpoint directories from ``exp_manager`` (not created here)."""
    em = cfg.exp_manager
    if em.explicit_log_dir:
        log_dir = resolve_path(em.explicit_log_dir)
    else:
        log_dir = os.path.join(resolve_path(em.exp_dir or "nxd_lc_runs"), em.name)
    return ExpPaths(log_dir=log_dir, checkpoint_dir=os.path.join(log_dir, "checkpoints"))


_file_handler: Optional[logging.FileHandler] = None  # the run's text log handler (setup_log_files)


def setup_log_files(cfg: NxdConfig, paths: ExpPaths, global_rank: int, local_rank: int) -> Optional[str]:
    """Attach a file handler to the ``nxd_lc`` logger (``log_local_rank_0_only`` decides which ranks write), in place
    of the one an earlier run of this process attached (runs in one process, e.g. tests, would otherwise write each
    line once per earlier run, into the earlier runs' files too).

    Returns:
        The log file path of this rank, or None when this rank writes no file.
    """
    global _file_handler
    root = logging.getLogger("nxd_lc")
    if _file_handler is not None:
        root.removeHandler(_file_handler)
        _file_handler.close()
        _file_handler = None
    if cfg.exp_manager.log_local_rank_0_only and local_rank != 0:
        return None
    os.makedirs(paths.log_dir, exist_ok=True)
    path = os.path.join(paths.log_dir, f"nxd_lc_log_globalrank-{global_rank}_localrank-{local_rank}.txt")
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    _file_handler = handler
    root.setLevel(logging.INFO)
    return path


def build_loggers(cfg: NxdConfig, paths: ExpPaths) -> list[Logger]:
    """TensorBoard logger when ``create_tensorboard_logger`` (Lightning writes it from global rank 0; one point per
    metric and step, see :class:`~nxd_lc.lightning.callbacks.NxDTensorBoardLogger`), with the resolved config as its
    hyperparameters (``tensorboard/hparams.yaml``, :func:`~nxd_lc.config.run_record.resolved_config_yaml`)."""
    if not cfg.exp_manager.create_tensorboard_logger:
        return []
    logger = NxDTensorBoardLogger(save_dir=paths.log_dir, name="tensorboard", version="", default_hp_metric=False)
    logger.log_hyperparams(OmegaConf.create(resolved_config_yaml(cfg)))
    return [logger]


def build_checkpoint_callback(cfg: NxdConfig, paths: ExpPaths) -> Optional[NxDModelCheckpoint]:
    """The checkpoint callback from ``checkpoint_callback_params`` (None when create_checkpoint_callback is off)."""
    if not cfg.exp_manager.create_checkpoint_callback:
        return None
    return NxDModelCheckpoint.from_config(cfg.exp_manager.checkpoint_callback_params, paths.checkpoint_dir)


_held_lock: Optional[RunLock] = None


def lock_run_dir(paths: ExpPaths, is_global_zero: bool) -> None:
    """Collective: global rank 0 takes ``<log_dir>/.nxd_lc.lock`` (:mod:`nxd_lc.lightning.run_lock`), all ranks
    learn whether it succeeded. Released by :func:`release_run_dir`.

    Raises:
        ConfigError: another job holds the run directory (on rank 0 with the owner; on the others a pointer to
            rank 0's message).
    """
    global _held_lock
    error: Optional[ConfigError] = None
    if is_global_zero:
        lock = RunLock(paths.log_dir)
        try:
            lock.acquire()
            _held_lock = lock
        except ConfigError as e:
            error = e
    if not sharded.all_ranks_ok(error is None):
        raise error or ConfigError([f"exp_manager: global rank 0 could not lock the run directory {paths.log_dir} "
                                    f"(another job uses it; see rank 0's message)"])


def release_run_dir() -> None:
    """Release the run-directory lock taken by :func:`lock_run_dir` in this process (no-op if none)."""
    global _held_lock
    if _held_lock is not None:
        _held_lock.release()
        _held_lock = None


def unfinished_nxd_lc_save(path: str) -> bool:
    """True when directory ``path`` is provably an nxd_lc checkpoint save that was never published: no ``done``, and
    the per-rank checksum lists ``manifest.d/`` (:mod:`nxd_lc.checkpoint.integrity`), which only nxd_lc's staging
    writes and its commit removes before writing ``done``. NxD writes neither, so its checkpoints never qualify."""
    return (os.path.isdir(path) and not sharded.is_complete(path)
            and os.path.isdir(os.path.join(path, integrity.RANK_MANIFEST_DIR)))


def cleanup_interrupted_saves(paths: ExpPaths, is_global_zero: bool) -> None:
    """Before training, with the run-directory lock held (no other job can be writing here): rank 0 removes
    staging and trash directories left by a crashed save or removal (a staging directory that was fully written
    and marked ``done`` is published instead), then looks at the visible checkpoint directories without ``done``.
    nxd_lc publishes only by renaming a complete staging directory, so such a directory was made visible by
    something else (a rename or copy of a staging directory, an NxD save that crashed in place): one that is
    provably an unfinished nxd_lc save (:func:`unfinished_nxd_lc_save`) can never be loaded and is deleted; any
    other (an NxD-written checkpoint without markers may be complete) is named in a warning and ignored, never
    deleted. All ranks wait for it."""
    if is_global_zero and os.path.isdir(paths.checkpoint_dir):
        for name in sharded.cleanup_partial(paths.checkpoint_dir):
            log.warning("removed the leftover of an interrupted checkpoint save: %s", name)
        for name in sorted(os.listdir(paths.checkpoint_dir)):
            path = os.path.join(paths.checkpoint_dir, name)
            if (name.startswith(".") or os.path.islink(path) or not os.path.isdir(path)
                    or sharded.is_complete(path)):
                continue  # a symbolic link is reported by sharded.list_checkpoints and never followed
            if unfinished_nxd_lc_save(path):
                shutil.rmtree(path)
                log.warning("removed %s: an unfinished nxd_lc checkpoint save (per-rank checksum lists in %s/, no "
                            "'%s' marker)", path, integrity.RANK_MANIFEST_DIR, sharded.DONE_FILE)
            else:
                log.warning("%s has no '%s' marker: it is never picked as the newest checkpoint (delete it; if NxD "
                            "wrote it, its converter writes no marker: name it in exp_manager.resume_from_checkpoint,"
                            " which loads it with a warning)", path, sharded.DONE_FILE)
    collectives.barrier()


def _verify_everywhere(cfg: NxdConfig, tag_dir: str) -> Optional[str]:
    """Collective: every rank verifies the files it will load from ``tag_dir``
    (:func:`nxd_lc.checkpoint.sharded.verify_checkpoint`). Returns None when all ranks passed, else this rank's
    problem (or a note that another rank failed; that rank logs its own)."""
    from nxd_lc.lightning.strategy import checkpoint_ranks

    problem: Optional[str] = None
    try:
        sharded.verify_checkpoint(os.path.dirname(tag_dir), os.path.basename(tag_dir),
                                  **checkpoint_ranks(cfg.distributed_strategy.zero1))
    except (integrity.CheckpointIntegrityError, FileNotFoundError) as e:
        problem = str(e)
    if sharded.all_ranks_ok(problem is None):
        return None
    return problem or "a file that another rank loads failed verification (see that rank's log)"


def _explicit_checkpoint(cfg: NxdConfig) -> Optional[str]:
    em = cfg.exp_manager
    if not em.resume_from_checkpoint:
        return None
    path = resolve_path(em.resume_from_checkpoint)
    if not sharded.is_complete(path) and not sharded.is_unmarked_nxd_checkpoint(path):
        raise ConfigError([f"exp_manager.resume_from_checkpoint: {path} is not a complete checkpoint (no "
                           f"'done' marker); pick another tag under {os.path.dirname(path)}"])
    if not cfg.model.weight_init_only and not os.path.isdir(os.path.join(path, sharded.OPTIM_DIR)):
        raise ConfigError([f"exp_manager.resume_from_checkpoint: {path} holds model weights only (no "
                           f"'{sharded.OPTIM_DIR}/' shards: NxD's converter and nxd_lc.cli.convert write none), so "
                           f"the training state cannot be resumed from it; set model.weight_init_only: true to "
                           f"start from its weights with a fresh optimizer"])
    problem = _verify_everywhere(cfg, path)
    if problem:
        raise ConfigError([f"exp_manager.resume_from_checkpoint: {path} failed verification: {problem}; pick "
                           f"another tag under {os.path.dirname(path)}"])
    return path


def _quarantine(checkpoint_dir: str, tag: str) -> None:
    """Move a checkpoint that failed verification aside to the hidden ``.<tag>.corrupt-<time>`` (kept for
    inspection, never listed, loaded or counted by ``save_top_k`` again; a new save may reuse ``<tag>``)."""
    aside = os.path.join(checkpoint_dir, f".{tag}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
    os.replace(os.path.join(checkpoint_dir, tag), aside)
    log.warning("moved the damaged checkpoint aside to %s; delete it when it is no longer needed", aside)


def _own_latest(cfg: NxdConfig, paths: ExpPaths) -> Optional[str]:
    """The newest checkpoint under ``<log_dir>/checkpoints`` that verifies on every rank; newer ones that do not
    are skipped with a warning naming them (and the failing file) and, once a good one is found, moved aside
    (:func:`_quarantine`). When none verifies nothing is moved and the run stops (a fresh start would need the
    user's decision)."""
    if not cfg.exp_manager.resume_if_exists or not os.path.isdir(paths.checkpoint_dir):
        return None
    skipped: list[str] = []
    bad_tags: list[str] = []
    for tag in reversed(sharded.list_checkpoints(paths.checkpoint_dir)):
        tag_dir = os.path.join(paths.checkpoint_dir, tag)
        problem = _verify_everywhere(cfg, tag_dir)
        if problem is None:
            if collectives.get_global_rank() == 0:  # every rank has voted: nobody reads the damaged ones any more
                for bad in bad_tags:
                    _quarantine(paths.checkpoint_dir, bad)
            return tag_dir
        log.warning("skipping checkpoint %s: %s; trying the previous one", tag_dir, problem)
        skipped.append(f"{tag}: {problem}")
        bad_tags.append(tag)
    if skipped:
        raise ConfigError([f"exp_manager.resume_if_exists: no checkpoint under {paths.checkpoint_dir} passed "
                           f"verification ({'; '.join(skipped)}); move the damaged ones away to start fresh"])
    return None


def _layout_problem(cfg: NxdConfig, tag_dir: str, key: str) -> Optional[str]:
    """A message when ``tag_dir`` was saved at another TP / PP size and cannot be re-sharded to this run's (a LoRA
    run); None when the sizes match or the checkpoint is re-sharded on load (:mod:`nxd_lc.checkpoint.reshard`,
    logged here)."""
    from nxd_lc.checkpoint.reshard import saved_layout
    from nxd_lc.config.access import peft_config

    saved = saved_layout(tag_dir)
    ds = cfg.distributed_strategy
    if (saved.tp, saved.pp) == (ds.tensor_model_parallel_size, ds.pipeline_model_parallel_size):
        return None
    if peft_config(cfg) is not None:
        return (f"{key}: checkpoint {tag_dir} was saved with tensor_model_parallel_size {saved.tp} and "
                f"pipeline_model_parallel_size {saved.pp}, this run has {ds.tensor_model_parallel_size} and "
                f"{ds.pipeline_model_parallel_size}; re-sharding a LoRA run (model_alignment_strategy.peft) is not "
                f"supported: resume with distributed_strategy.tensor_model_parallel_size={saved.tp} "
                f"distributed_strategy.pipeline_model_parallel_size={saved.pp}, or merge the adapters into an HF "
                f"model (python -m nxd_lc.cli.convert) and start from model.hf_weights_dir")
    log.warning("%s: checkpoint %s was saved with TP %d x PP %d; this run (TP %d x PP %d) re-shards its weights "
                "and optimizer state on load", key, tag_dir, saved.tp, saved.pp, ds.tensor_model_parallel_size,
                ds.pipeline_model_parallel_size)
    return None


def resume_plan(cfg: NxdConfig, paths: ExpPaths) -> tuple[Optional[str], Optional[str]]:
    """What to restore: ``(trainer checkpoint, weights-only checkpoint)``, at most one of them set.

    * ``resume_from_checkpoint`` restores everything (weights, optimizer, step, consumed samples) — unless
      ``model.weight_init_only``, where it only initialises the weights (NxDT semantics), and a run that already
      has its own checkpoints resumes from those instead (so a restarted continuation does not start over).
    * otherwise, with ``resume_if_exists``, the newest *complete* checkpoint (``done`` marker) under
      ``<log_dir>/checkpoints`` whose files pass verification on every rank (SHA-256 manifest,
      :mod:`nxd_lc.checkpoint.integrity`); a newer one that fails is skipped with a warning naming it and the
      file, and the previous one is used. Staging directories of interrupted saves are never picked.

    Collective (every rank verifies what it will load, then all ranks vote) when torch.distributed is up.

    Raises:
        ConfigError: an explicit checkpoint is incomplete or fails verification; checkpoints exist but none
            verifies; the chosen checkpoint was saved at another TP / PP size by a LoRA run (not re-shardable;
            names the ways on); or none exists and ``resume_ignore_no_checkpoint`` is false.
    """
    em = cfg.exp_manager
    explicit, own = _explicit_checkpoint(cfg), _own_latest(cfg, paths)
    plan: tuple[Optional[str], Optional[str]] = (None, None)
    if cfg.model.weight_init_only:
        plan = (own, None) if own else (None, explicit)
    elif explicit or own:
        plan = (explicit or own, None)
    chosen = plan[0] or plan[1]
    if chosen:
        problem = _layout_problem(cfg, chosen, "exp_manager.resume_from_checkpoint" if chosen == explicit
                                  else "exp_manager.resume_if_exists")
        if problem:
            raise ConfigError([problem])
        return plan
    if em.resume_if_exists and not em.resume_ignore_no_checkpoint:
        raise ConfigError([f"exp_manager.resume_if_exists: no complete checkpoint under {paths.checkpoint_dir};"
                           f" set resume_ignore_no_checkpoint: true to start fresh"])
    return None, None
