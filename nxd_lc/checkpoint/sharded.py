"""Sharded checkpoints in NeuronX Distributed's layout, saved atomically across ranks.

Layout (NxD ``neuronx_distributed.trainer.checkpoint``)::

    <ckpt_root>/
      newest                                   # complete tags, one per line, oldest -> newest
      <tag>/
        checkpoint                             # "1": marks the directory as a checkpoint (NxD)
        model/dp_rank_00_tp_rank_XX_pp_rank_XX.pt   # model shard, written by DP rank 0 only
        optim/dp_rank_XX_tp_rank_XX_pp_rank_XX.pt   # optimizer shard (every DP rank under zero1)
        user_content.pt                        # trainer/user state, written by global rank 0
        manifest.json                          # SHA-256 and size of every file above (nxd_lc.checkpoint.integrity)
        done                                   # completion marker (JSON: tag, step, time, manifest), last

With xser each shard ``<f>.pt`` is a structure file plus ``<f>.pt.tensors/tensor_<i>.pt``
(:mod:`nxd_lc.checkpoint.xser`). With expert parallelism (EP > 1) each EP rank holds other experts, so model
shards (and optimizer shards saved without zero1) carry the EP rank as NxD names them,
``dp_rank_00_ep_rank_XX_tp_rank_XX_pp_rank_XX.pt``, written by expert-data-parallel rank 0 of each
(EP, TP, PP) position; ZeRO-1 optimizer shards stay ``dp_rank_<DP x CP rank>_tp_rank_XX_pp_rank_XX.pt``.
``newest`` follows NxD 2.16 (the last line is the newest tag);
later NxD releases find checkpoints by their ``done`` file instead, which we also write.

Atomicity (our addition; NxD writes in place): every rank writes into the hidden staging
directory ``<ckpt_root>/.<tag>.partial``; after all ranks agree that their writes succeeded,
global rank 0 writes ``done`` there and renames the directory to ``<ckpt_root>/<tag>`` (moving an
older ``<tag>`` aside first and deleting it only after the rename), then rewrites ``newest`` via a
temporary file and ``os.replace``. Files and directories are fsynced. Hidden (dot) directories
are never listed, so a crashed save is invisible to :func:`latest_checkpoint`;
:func:`cleanup_partial` removes its leftovers. The root must be one filesystem visible to all
ranks (as in NxD). Checkpoint files are read with the restricted unpickler
(:func:`~nxd_lc.checkpoint.xser.safe_torch_load`): a file that names a global outside the allowed set is refused
(:class:`~nxd_lc.checkpoint.xser.UnsafeCheckpointError`), never run.

This module is the layout's public face; the work is done in :mod:`~nxd_lc.checkpoint.layout` (names, tags, shard
files), :mod:`~nxd_lc.checkpoint.save` (stage, write, vote, publish), :mod:`~nxd_lc.checkpoint.load` (verify and
read this rank's files) and :mod:`~nxd_lc.checkpoint.retention` (list, ``newest``, remove, clean up).
"""

from __future__ import annotations

from nxd_lc.checkpoint.layout import (
    CHECKPOINT_MARKER,
    DONE_FILE,
    MODEL_DIR,
    NEWEST_FILE,
    OPTIM_DIR,
    USER_CONTENT_FILE,
    checkpoint_file_name,
    ep_ranks_found,
    is_complete,
)
from nxd_lc.checkpoint.load import is_unmarked_nxd_checkpoint, load_checkpoint, rank_files, verify_checkpoint
from nxd_lc.checkpoint.retention import cleanup_partial, latest_checkpoint, list_checkpoints, remove_checkpoint
from nxd_lc.checkpoint.save import (
    NonFiniteCheckpointError,
    StagedSave,
    all_ranks_ok,
    check_finite,
    save_checkpoint,
    stage_checkpoint,
)

__all__ = ["CHECKPOINT_MARKER", "DONE_FILE", "MODEL_DIR", "NEWEST_FILE", "OPTIM_DIR", "USER_CONTENT_FILE",
           "NonFiniteCheckpointError", "StagedSave", "all_ranks_ok", "check_finite", "checkpoint_file_name",
           "cleanup_partial", "ep_ranks_found", "is_complete", "is_unmarked_nxd_checkpoint", "latest_checkpoint",
           "list_checkpoints",
           "load_checkpoint", "rank_files", "remove_checkpoint", "save_checkpoint", "stage_checkpoint",
           "verify_checkpoint"]
