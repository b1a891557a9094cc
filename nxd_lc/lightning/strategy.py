"""Lightning strategy for tensor/sequence-parallel models: no DDP wrapper, NxD-layout sharded checkpoints.

``NxDStrategy`` is Lightning's ``DDPStrategy`` with two changes:

* the module is not wrapped in ``DistributedDataParallel``: TP ranks hold different shards, so gradients are
  reduced over the data-parallel group only (and sequence-parallel norm grads over TP) by the LightningModule's
  ``on_before_optimizer_step`` (see :mod:`nxd_lc.distributed.grads`);
* checkpoints are written by every rank in NxD's layout (``<root>/<tag>/model/dp_rank_00_tp_rank_XX_pp_rank_XX.pt``,
  ``optim/...``, ``done``) through :mod:`nxd_lc.checkpoint.sharded`, atomically: a checkpoint appears under its tag
  only once every rank has written its files.

The process group and ``parallel_state`` are initialised before the Trainer exists (train.py); Lightning finds the
group already initialised and leaves it alone.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from pytorch_lightning.strategies import DDPStrategy

from nxd_lc.checkpoint import sharded
from nxd_lc.distributed import parallel_state as ps

MODEL_KEY = "state_dict"
OPTIM_KEYS = ("optimizer_states", "lr_schedulers")


class NxDStrategy(DDPStrategy):
    """DDPStrategy without the DDP wrapper and with NxD sharded (optionally xser) checkpoints.

    Args:
        save_xser: write model/optim shards in xser format (``exp_manager.save_xser``).
        load_xser: expect xser shards when loading (``exp_manager.load_xser``); the format is also auto-detected.
        save_bf16: cast floating model weights to bf16 on save (``exp_manager.save_bf16``).
        **kwargs: passed to ``DDPStrategy`` (accelerator, parallel_devices, cluster_environment, ...).
    """

    strategy_name = "nxd"

    def __init__(self, *, save_xser: bool = True, load_xser: bool = True, save_bf16: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.save_xser = save_xser
        self.load_xser = load_xser
        self.save_bf16 = save_bf16

    def configure_ddp(self) -> None:
        """Keep the LightningModule unwrapped; gradient reduction is explicit (see module docstring)."""

    def _ranks(self) -> dict[str, int]:
        return {"dp_rank": ps.get_data_parallel_rank(), "tp_rank": ps.get_tensor_model_parallel_rank(),
                "pp_rank": ps.get_pipeline_model_parallel_rank()}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Optional[Any] = None) -> None:
        """Write ``checkpoint`` as ``<dirname(filepath)>/<basename(filepath)>`` in NxD's layout, from all ranks.

        The model shard is written by DP rank 0 / CP rank 0 of each (TP, PP) position; optimizer shards likewise
        (without ZeRO-1 every DP and CP rank holds the same optimizer state); trainer state goes to the
        user-content file.
        """
        if storage_options is not None:
            raise TypeError("NxDStrategy.save_checkpoint: storage_options are not supported")
        root, tag = os.path.split(os.path.abspath(str(filepath)))
        content = dict(checkpoint)
        model_state = content.pop(MODEL_KEY)
        optim_state = {k: content.pop(k) for k in OPTIM_KEYS if k in content}
        ranks = self._ranks()
        # model and (unsharded) optimizer state are identical over DP and CP: one writer per (TP, PP) position
        writer = ranks["dp_rank"] == 0 and ps.get_context_parallel_rank() == 0
        sharded.save_checkpoint(
            root, tag, model_state=model_state, optim_state=optim_state or None, user_content=content,
            is_global_zero=self.is_global_zero, write_model=writer,
            write_optim=writer and bool(optim_state), use_xser=self.save_xser,
            save_bf16=self.save_bf16, **ranks)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Read this rank's shards of ``<root>/<tag>`` back into one Lightning checkpoint dict."""
        root, tag = os.path.split(os.path.abspath(str(checkpoint_path)))
        model_state, optim_state, content = sharded.load_checkpoint(root, tag, load_optim=True,
                                                                    use_xser=self.load_xser, **self._ranks())
        checkpoint = dict(content)
        checkpoint[MODEL_KEY] = model_state
        if optim_state:
            checkpoint.update(optim_state)
        return checkpoint

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load the local shard; bf16-saved weights (save_bf16) are cast back to the parameters' dtype."""
        assert self.lightning_module is not None
        self.lightning_module.load_state_dict(checkpoint[MODEL_KEY], strict=strict)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove ``<root>/<tag>`` (rank 0, atomically: renamed away before deletion)."""
        if self.is_global_zero:
            root, tag = os.path.split(os.path.abspath(str(filepath)))
            sharded.remove_checkpoint(root, tag)
        self.barrier("remove_checkpoint")
