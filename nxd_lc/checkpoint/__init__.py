"""Checkpoint formats: NxD sharded layout (atomic across ranks) and torch-xla's xser format."""

from nxd_lc.checkpoint.sharded import (
    checkpoint_file_name,
    cleanup_partial,
    is_complete,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    remove_checkpoint,
    save_checkpoint,
)
from nxd_lc.checkpoint.xser import TensorReference, load_xser, save_xser

__all__ = [
    "TensorReference",
    "checkpoint_file_name",
    "cleanup_partial",
    "is_complete",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_xser",
    "remove_checkpoint",
    "save_checkpoint",
    "save_xser",
]
