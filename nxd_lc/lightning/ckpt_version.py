"""``exp_manager.ckpt_ptl_version``: the PyTorch-Lightning version of a checkpoint that does not record one.

Lightning stores its version in every checkpoint it writes (``checkpoint["pytorch-lightning_version"]``; nxd_lc
keeps it in the NxD ``user_content.pt``), and on resume upgrades older checkpoints with its own migrations
(:func:`pytorch_lightning.utilities.migration.utils._pl_migrate_checkpoint`, run by the Trainer right after
``strategy.load_checkpoint``). A checkpoint written by other tools (an NxD checkpoint without user content, or
one whose user content lacks the key) records no version, and Lightning cannot resume it (``KeyError``).

NxDT's ``NLPCheckpointIO.load_checkpoint`` fills the missing version with ``ckpt_ptl_version`` ("Set this only if
your checkpoint does not contain the pytorch-lightning version"), so Lightning then applies the migrations from
that version on. nxd_lc does the same, with two differences: without ``ckpt_ptl_version`` such a checkpoint is an
error naming the key (NxDT silently assumes 2.5.0), and a recorded version that differs from ``ckpt_ptl_version``
is kept (the checkpoint knows best) with a warning naming both.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from packaging.version import Version

log = logging.getLogger(__name__)

#: Lightning's own key for the version a checkpoint was saved with.
PTL_VERSION_KEY = "pytorch-lightning_version"


def apply_ckpt_ptl_version(checkpoint: dict[str, Any], ckpt_ptl_version: Optional[str], path: str) -> dict[str, Any]:
    """Make sure a loaded checkpoint records the Lightning version it was saved with (in place; returned).

    Args:
        checkpoint: the checkpoint dict as loaded (user content + model/optimizer state).
        ckpt_ptl_version: ``exp_manager.ckpt_ptl_version`` (None: unset).
        path: the checkpoint directory, for messages.

    Returns:
        ``checkpoint``, with ``pytorch-lightning_version`` set to ``ckpt_ptl_version`` when it recorded none.
        Lightning's migration then upgrades it from that version.

    Raises:
        ValueError: the checkpoint records no version and ``ckpt_ptl_version`` is unset (names the key).
    """
    recorded = checkpoint.get(PTL_VERSION_KEY)
    if recorded:
        if ckpt_ptl_version is not None and Version(str(recorded)) != Version(str(ckpt_ptl_version)):
            log.warning("exp_manager.ckpt_ptl_version %s is not used: checkpoint %s records pytorch-lightning %s "
                        "(ckpt_ptl_version only fills in a missing version)", ckpt_ptl_version, path, recorded)
        return checkpoint
    if ckpt_ptl_version is None:
        raise ValueError(f"checkpoint {path} records no pytorch-lightning version ('{PTL_VERSION_KEY}' is missing "
                         f"from its user content), so Lightning cannot migrate its trainer state; set "
                         f"exp_manager.ckpt_ptl_version to the version it was saved with (NxDT's examples: 1.8.6)")
    log.info("checkpoint %s records no pytorch-lightning version: read as %s (exp_manager.ckpt_ptl_version); "
             "Lightning migrates it from there", path, ckpt_ptl_version)
    checkpoint[PTL_VERSION_KEY] = str(ckpt_ptl_version)
    return checkpoint
