"""Saving a checkpoint in the NxD layout (:mod:`nxd_lc.checkpoint.sharded`), atomically across ranks: stage,
write (with SHA-256 manifests, never a state holding NaN / inf), vote, commit and publish.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from nxd_lc.checkpoint import integrity
from nxd_lc.checkpoint.layout import (
    CHECKPOINT_MARKER,
    DONE_FILE,
    MODEL_DIR,
    OPTIM_DIR,
    USER_CONTENT_FILE,
    check_tag,
    checkpoint_file_name,
    is_complete,
    staging_dir,
    trash_dir,
)
from nxd_lc.checkpoint.nxd_format import layout_metadata, to_nxd_names
from nxd_lc.checkpoint.retention import write_newest
from nxd_lc.checkpoint.xser import compact_cpu, fsync_dir, map_tensors, save_xser, tensor_paths, torch_save_file
from nxd_lc.distributed import collectives
from nxd_lc.distributed import parallel_state as ps
from nxd_lc.runtime import faults

__all__ = ["NonFiniteCheckpointError", "StagedSave", "all_ranks_ok", "check_finite", "save_checkpoint",
           "stage_checkpoint"]

_BF16_SOURCE_DTYPES = (torch.float16, torch.float32, torch.float64)


def all_ranks_ok(ok: bool) -> bool:
    """Collective over the world group: True iff ``ok`` on every rank (a barrier with a vote,
    :func:`nxd_lc.distributed.collectives.world_max`). Without torch.distributed it returns ``ok``."""
    return collectives.world_max([0 if ok else 1], tag="nxd_lc_all_ranks_ok")[0] == 0


def _collective_phase(phase: str, tag: str, fn: Callable[[], None]) -> None:
    """Run ``fn`` on this rank, then vote; every rank raises if any rank's ``fn`` raised."""
    err: Exception | None = None
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - re-raised below, once the other ranks have voted
        err = e
    all_ok = all_ranks_ok(err is None)
    if err is not None:
        raise err
    if not all_ok:
        raise RuntimeError(f"saving checkpoint {tag!r} failed on another rank during {phase} (see that "
                           f"rank's error); no checkpoint was published and the previous one is intact")


def _is_expert_tensor(key: str) -> bool:
    """An expert-parallel tensor of a model shard (NxD's ``expert_model_parallel`` in the xser info file)."""
    return ".experts." in key


def _write_shard(state: Any, path: str, use_xser: bool, experts: bool = False) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if use_xser:
        save_xser(state, path, fsync=True, expert_parallel=_is_expert_tensor if experts else None)
    else:
        torch_save_file(map_tensors(state, compact_cpu), path, fsync=True)
        fsync_dir(os.path.dirname(path))


def _write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` (UTF-8) and fsync it."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _to_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16) if t.dtype in _BF16_SOURCE_DTYPES else t


def _step_of(step: int | None, user_content: Any) -> int | None:
    if step is not None:
        return int(step)
    if isinstance(user_content, Mapping):
        for key in ("global_step", "step"):
            v = user_content.get(key)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    return None


def _prepare_staging(ckpt_root: str, staging: str) -> None:
    os.makedirs(ckpt_root, exist_ok=True)
    if os.path.lexists(staging):  # leftover of a crashed save of the same tag
        shutil.rmtree(staging)
    os.mkdir(staging)
    with open(os.path.join(staging, CHECKPOINT_MARKER), "w") as f:
        f.write("1")
    fsync_dir(ckpt_root)


def _commit(ckpt_root: str, tag: str, staging: str, step: int | None, layout: Any = None) -> None:
    """Rank 0: write ``manifest.json``, mark ``staging`` done (with the run's ``layout`` metadata,
    :func:`nxd_lc.checkpoint.nxd_format.layout_metadata`) and publish it as ``<ckpt_root>/<tag>``."""
    n_files = integrity.merge_rank_manifests(staging)
    done = {"tag": tag, "step": step, "saved_at": time.time(), "writer": "nxd_lc",
            "manifest": integrity.MANIFEST_FILE, "algorithm": integrity.ALGORITHM, "files": n_files}
    if layout is not None:
        done["layout"] = layout
    with open(os.path.join(staging, DONE_FILE), "w") as f:
        json.dump(done, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(staging)
    final = os.path.join(ckpt_root, tag)
    trash = None
    if os.path.lexists(final):  # keep the old copy until the new one is in place
        trash = trash_dir(ckpt_root, tag)
        os.replace(final, trash)
    try:
        os.replace(staging, final)
    except OSError:
        if trash is not None:  # put the old checkpoint back
            os.replace(trash, final)
        raise
    fsync_dir(ckpt_root)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    write_newest(ckpt_root)


@dataclass
class StagedSave:
    """One rank's part of a checkpoint save whose staging directory exists (see :func:`stage_checkpoint`).

    :meth:`write` is local (no collectives: it may run in a background thread); :meth:`publish` is collective
    and must be called by every rank, after :meth:`write` returned or raised on this rank.
    """

    ckpt_root: str
    tag: str
    staging: str
    is_global_zero: bool
    step: int | None
    files: list[tuple[str, Any, bool]]  # (path relative to staging, state, xser) to write
    user_content: Any
    layout: Any = None  # the done file's layout metadata (rank 0)
    text_files: Mapping[str, str] | None = None  # name -> text, written by rank 0 (the run's record)
    error: BaseException | None = None
    written: bool = False

    def write(self) -> None:
        """Write this rank's files and their checksums (``manifest.d/rank_<r>.json``) into the staging dir.

        Never raises: an error is kept in :attr:`error` and reported by :meth:`publish` on every rank. A state
        holding a NaN or an infinity is an error (:func:`check_finite`): such a checkpoint is never published.
        """
        try:
            relpaths: list[str] = []
            for rel, state, _ in self.files:  # nothing of a checkpoint holding NaN / inf is written
                check_finite(state, f"checkpoint {self.tag!r} (step {self.step}), {rel}")
            for rel, state, xser in self.files:
                model_file = rel.startswith(MODEL_DIR + "/")
                if model_file and isinstance(state, Mapping):
                    state = to_nxd_names(state)  # the head as NxD names it
                _write_shard(state, os.path.join(self.staging, rel), xser, model_file and "_ep_rank_" in rel)
                relpaths += integrity.files_under(self.staging, rel)
                faults.inject("mid_save", self.step if self.step is not None else -1)
            if self.is_global_zero and self.user_content is not None:
                torch_save_file(self.user_content, os.path.join(self.staging, USER_CONTENT_FILE), fsync=True)
                relpaths.append(USER_CONTENT_FILE)
            if self.is_global_zero:
                for name, text in sorted((self.text_files or {}).items()):
                    _write_text(os.path.join(self.staging, name), text)
                    relpaths.append(name)
            integrity.write_rank_manifest(self.staging, collectives.get_global_rank(), relpaths)
        except BaseException as e:  # noqa: BLE001 - reported collectively by publish()
            self.error = e
        finally:
            self.written = True
            self.files = []  # drop the state (host copies under async saves) as soon as it is on disk

    def publish(self) -> str:
        """Collective: vote on every rank's write; rank 0 merges the manifests, writes ``done`` and publishes.

        Returns:
            The published checkpoint directory ``<ckpt_root>/<tag>``.

        Raises:
            RuntimeError: a write failed on some rank (this rank re-raises its own error); nothing is published
                and the previous checkpoints are intact.
        """
        def failed_write() -> None:
            if self.error is not None:
                raise self.error
            if not self.written:
                raise RuntimeError(f"checkpoint {self.tag!r}: publish() called before write()")

        try:
            _collective_phase("shard writing", self.tag, failed_write)
            _collective_phase("commit", self.tag,
                              (lambda: _commit(self.ckpt_root, self.tag, self.staging, self.step, self.layout))
                              if self.is_global_zero else _noop)
            faults.inject("after_publish", self.step if self.step is not None else -1)
        except Exception:
            if self.is_global_zero and not is_complete(self.staging):  # a complete one is kept for cleanup_partial
                shutil.rmtree(self.staging, ignore_errors=True)
            raise
        return os.path.join(self.ckpt_root, self.tag)


def _noop() -> None:
    return None


class NonFiniteCheckpointError(ValueError):
    """A checkpoint's state holds NaN or infinite values: it is not published (the previous one stays newest)."""


def _float_tensors(obj: Any) -> list[tuple[str, torch.Tensor]]:
    """``(key path, tensor)`` of every floating-point tensor in a nested dict / list / tuple (``a.b.0``; a bare
    tensor: ``<root>``)."""
    return [(path or "<root>", t) for path, t in tensor_paths(obj) if t.is_floating_point() or t.is_complex()]


def check_finite(state: Any, where: str) -> None:
    """Raise when a floating-point tensor of ``state`` holds NaN or an infinity.

    One flag per tensor, reduced on each tensor's device and read once per device (not once per tensor); only when
    one is false are the tensors searched for the first offending key.

    Raises:
        NonFiniteCheckpointError: naming ``where`` and the tensor's key path (e.g. ``state.0.exp_avg``).
    """
    tensors = _float_tensors(state)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for _, t in tensors:
        if t.numel():
            by_device.setdefault(t.device, []).append(torch.isfinite(t).all())
    if all(bool(torch.stack(flags).all()) for flags in by_device.values()):
        return
    bad = next(key for key, t in tensors if t.numel() and not bool(torch.isfinite(t).all()))
    raise NonFiniteCheckpointError(
        f"{where}: tensor '{bad}' holds NaN or infinite values, so this checkpoint is not published (the previous "
        "one stays the newest); the training diverged before this save: resume from the previous checkpoint with a "
        "lower model.optim.lr or with gradient clipping (trainer.gradient_clip_val)")


def stage_checkpoint(ckpt_root: str, tag: str, *, model_state: Any, optim_state: Any, user_content: Any,
                     dp_rank: int, tp_rank: int, pp_rank: int, is_global_zero: bool, write_model: bool,
                     write_optim: bool, use_xser: bool, save_bf16: bool = False,
                     step: int | None = None, ep_rank: int | None = None,
                     optim_sharded: bool = False, layout: Any = None,
                     text_files: Mapping[str, str] | None = None) -> StagedSave:
    """Collective first phase of a save: rank 0 creates the staging directory ``<ckpt_root>/.<tag>.partial``.

    Arguments as :func:`save_checkpoint`. The returned :class:`StagedSave` holds references to the given
    states: pass host copies when training goes on before :meth:`StagedSave.write` (async saves).

    Raises:
        ValueError: see :func:`save_checkpoint`.
        RuntimeError: preparing the staging directory failed on another rank.
    """
    check_tag(tag)
    checkpoint_file_name(dp_rank, tp_rank, pp_rank, ep_rank)
    if write_model and model_state is None:
        raise ValueError("save_checkpoint: write_model=True but model_state is None")
    if write_optim and optim_state is None:
        raise ValueError("save_checkpoint: write_optim=True but optim_state is None")
    if write_model and dp_rank != 0 and not (optim_sharded and ep_rank is not None):
        raise ValueError(f"save_checkpoint: model shards are written by DP rank 0 only (NxD layout), got "
                         f"write_model=True on dp_rank={dp_rank}; pass write_model=(dp_rank == 0)")
    staging = staging_dir(ckpt_root, tag)
    files: list[tuple[str, Any, bool]] = []
    if write_model:
        state = map_tensors(model_state, _to_bf16) if save_bf16 else model_state
        files.append((f"{MODEL_DIR}/{checkpoint_file_name(0, tp_rank, pp_rank, ep_rank)}", state, use_xser))
    if write_optim:
        name = checkpoint_file_name(dp_rank, tp_rank, pp_rank, None if optim_sharded else ep_rank)
        files.append((f"{OPTIM_DIR}/{name}", optim_state, use_xser))
    _collective_phase("preparation", tag, (lambda: _prepare_staging(ckpt_root, staging)) if is_global_zero else _noop)
    return StagedSave(ckpt_root=ckpt_root, tag=tag, staging=staging, is_global_zero=is_global_zero,
                      step=_step_of(step, user_content), files=files,
                      user_content=user_content if is_global_zero else None,
                      text_files=text_files if is_global_zero else None,
                      layout=layout if layout is not None or not ps.model_parallel_is_initialized()
                      else layout_metadata(ps.get_kv_replica_layout()))


def save_checkpoint(ckpt_root: str, tag: str, *, model_state: Any, optim_state: Any, user_content: Any,
                    dp_rank: int, tp_rank: int, pp_rank: int, is_global_zero: bool, write_model: bool,
                    write_optim: bool, use_xser: bool, save_bf16: bool = False,
                    step: int | None = None, ep_rank: int | None = None, optim_sharded: bool = False,
                    layout: Any = None, text_files: Mapping[str, str] | None = None) -> str:
    """Save this rank's shards into ``<ckpt_root>/<tag>``; collective over all ranks, atomic, checksummed.

    Every rank of the world group must call it (also ranks that write nothing): it votes three
    times (staging prepared, shards written, commit done) so that a failure on any rank makes
    every rank raise and nothing is published. Each rank records the SHA-256 of the files it
    wrote; rank 0 merges them into ``manifest.json`` before writing ``done``
    (:mod:`nxd_lc.checkpoint.integrity`). Equivalent to :func:`stage_checkpoint`, then
    :meth:`StagedSave.write` and :meth:`StagedSave.publish`.

    Args:
        ckpt_root: checkpoint directory shared by all ranks (created if missing).
        tag: checkpoint name (e.g. ``"step_100"``); an existing ``<tag>`` is replaced only once
            the new one is complete.
        model_state: this rank's model shard (nested dict of tensors), used when ``write_model``.
        optim_state: this rank's optimizer state, used when ``write_optim``.
        user_content: trainer state written by global rank 0 to ``user_content.pt`` (None: skip).
        dp_rank, tp_rank, pp_rank: this rank's coordinates (file names).
        is_global_zero: True on exactly one rank, which prepares, commits and updates ``newest``.
        write_model: write ``model/dp_rank_00_...`` (NxD: DP rank 0 of each TP/PP position).
        write_optim: write ``optim/dp_rank_<dp>_...`` (every DP rank under zero1, else DP rank 0).
        use_xser: xser format (``exp_manager.save_xser``) instead of one ``torch.save`` per shard.
        save_bf16: cast float16/32/64 model tensors to bf16 (``exp_manager.save_bf16``); other
            dtypes and the optimizer state are saved unchanged.
        step: training step recorded in ``done`` for ordering; default ``user_content['global_step']``
            or ``user_content['step']`` when present.
        ep_rank: this rank's EP rank under expert parallelism (None without): model files (and unsharded
            optimizer files) are ``dp_rank_00_ep_rank_<ep>_...``, one per EP rank.
        optim_sharded: the optimizer is ZeRO-1-sharded: ``dp_rank`` is the DP x CP rank, every rank writes its
            own optimizer file (without ``ep_rank``), and with an ``ep_rank`` the model writer's ``dp_rank`` (its
            DP x CP rank) need not be 0.
        layout: metadata of the run's layout written into ``done`` by rank 0
            (:func:`nxd_lc.checkpoint.nxd_format.layout_metadata`); None: this process's
            (:func:`nxd_lc.distributed.parallel_state.get_kv_replica_layout`; none without parallel state).
        text_files: text files written by global rank 0 at the checkpoint's top level and listed in its
            manifest, name -> text: the run's record (:func:`nxd_lc.config.run_record.run_record_files`:
            ``run_config.yaml``, ``model_config.json``).

    The model shard is written under NxD's tensor names (:func:`nxd_lc.checkpoint.nxd_format.to_nxd_names`: the
    head is ``lm_head.weight``); xser shards get NxD's ``.info.pt`` (:func:`nxd_lc.checkpoint.xser.save_xser`).

    Returns:
        The published checkpoint directory ``<ckpt_root>/<tag>``.

    Raises:
        ValueError: invalid tag/ranks, missing state for a requested write, or a model write
            requested on a DP rank other than 0.
        RuntimeError: the save failed on another rank (this rank re-raises its own error).
    """
    staged = stage_checkpoint(ckpt_root, tag, model_state=model_state, optim_state=optim_state,
                              user_content=user_content, dp_rank=dp_rank, tp_rank=tp_rank, pp_rank=pp_rank,
                              is_global_zero=is_global_zero, write_model=write_model, write_optim=write_optim,
                              use_xser=use_xser, save_bf16=save_bf16, step=step, ep_rank=ep_rank,
                              optim_sharded=optim_sharded, layout=layout, text_files=text_files)
    staged.write()
    return staged.publish()

