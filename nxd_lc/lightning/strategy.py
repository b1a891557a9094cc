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

import copy
import logging
import os
import threading
import time
from typing import Any, Mapping, Optional

import torch
from pytorch_lightning.strategies import DDPStrategy

from nxd_lc.checkpoint import reshard, sharded
from nxd_lc.checkpoint.nxd_format import key_mismatch_message
from nxd_lc.checkpoint.xser import map_tensors
from nxd_lc.distributed import parallel_state as ps
from nxd_lc.layers.lora import is_lora_key, load_lora_state_dict
from nxd_lc.layers.param_attrs import check_parallel_attributes, move_module, preserving_parallel_attributes
from nxd_lc.lightning.callbacks import flush_loggers
from nxd_lc.lightning.ckpt_version import apply_ckpt_ptl_version

log = logging.getLogger(__name__)

MODEL_KEY = "state_dict"
OPTIM_KEYS = ("optimizer_states", "lr_schedulers")
RESHARD_KEY = "nxd_lc_reshard_from"  # placeholder optimizer state: re-shard it from this checkpoint directory


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``t`` that training can no longer change (async saves)."""
    return t.detach().to("cpu", copy=True)


def checkpoint_ranks(zero1: bool) -> dict[str, Any]:
    """This rank's checkpoint file coordinates ``{"dp_rank", "tp_rank", "pp_rank", "ep_rank"}`` from
    ``parallel_state``.

    Under ZeRO-1 ``dp_rank`` is the rank in the DP x CP group (one optimizer shard each; DP rank 0 / CP rank 0 is 0
    there too, so the model file name is unchanged). Without it, the rank in the expert-data-parallel group (the DP
    rank when EP is 1). ``ep_rank`` is the EP rank under expert parallelism (model files carry it, NxD's
    ``dp_rank_00_ep_rank_XX_...``), None without.
    """
    dp = ps.get_data_parallel_rank(with_context_parallel=True) if zero1 else ps.get_expert_data_parallel_rank()
    ep = ps.get_expert_model_parallel_rank() if ps.get_expert_model_parallel_world_size() > 1 else None
    return {"dp_rank": dp, "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(), "ep_rank": ep}


class NxDStrategy(DDPStrategy):
    """DDPStrategy without the DDP wrapper and with NxD sharded (optionally xser) checkpoints.

    Args:
        save_xser: write model/optim shards in xser format (``exp_manager.save_xser``).
        load_xser: expect xser shards when loading (``exp_manager.load_xser``); the format is also auto-detected.
        save_bf16: cast floating model weights to bf16 on save (``exp_manager.save_bf16``).
        zero1: optimizer state is sharded over DP x CP (``distributed_strategy.zero1``): every DP x CP rank
            writes and reads its own ``optim/dp_rank_<r>_...`` file, ``r`` its rank in the DP x CP group.
        use_master_weights_in_ckpt: write the optimizer's fp32 master weights as the model weights
            (``exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt``; needs master weights).
        lora_only: model shards hold the LoRA adapters alone (``model_alignment_strategy.peft.save_lora_base:
            false``); the frozen base weights come from ``model.hf_weights_dir`` on resume.
        ckpt_ptl_version: ``exp_manager.ckpt_ptl_version``: the Lightning version of a loaded checkpoint that
            records none (:func:`nxd_lc.lightning.ckpt_version.apply_ckpt_ptl_version`).
        async_checkpointing: ``exp_manager.async_checkpointing``: a save only takes host copies of the state
            (one extra host copy of this rank's model + optimizer shards in memory) and prepares the staging
            directory; a background thread writes the files and their checksums, and the checkpoint is
            published (manifest, ``done``, rename) at the first step boundary at which every rank has finished
            writing (:mod:`nxd_lc.lightning.preemption`). At most one save is in flight: the next save, the end
            of training and a preemption save wait for it. Removals of older checkpoints wait for publication.
        run_files: text files every checkpoint holds, name -> text, written by global rank 0: the run's record
            (:func:`nxd_lc.config.run_record.run_record_files`, which the HF export builds its model from).
        **kwargs: passed to ``DDPStrategy`` (accelerator, parallel_devices, cluster_environment, ...).
    """

    strategy_name = "nxd"

    def __init__(self, *, save_xser: bool = True, load_xser: bool = True, save_bf16: bool = False,
                 zero1: bool = False, use_master_weights_in_ckpt: bool = False, lora_only: bool = False,
                 ckpt_ptl_version: Optional[str] = None, async_checkpointing: bool = False,
                 run_files: Optional[Mapping[str, str]] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.run_files = dict(run_files or {})
        self.ckpt_ptl_version = ckpt_ptl_version
        self.lora_only = lora_only
        self.save_xser = save_xser
        self.load_xser = load_xser
        self.save_bf16 = save_bf16
        self.zero1 = zero1
        self.use_master_weights_in_ckpt = use_master_weights_in_ckpt
        self.async_checkpointing = async_checkpointing
        self._async_save: Optional[sharded.StagedSave] = None
        self._async_thread: Optional[threading.Thread] = None
        self._async_path, self._async_started = "", 0.0  # the pending asynchronous save's path and start time
        self._deferred_removals: list[Any] = []
        self._loaded_tag_dir: Optional[str] = None  # the checkpoint load_checkpoint read (optimizer re-sharding)

    def configure_ddp(self) -> None:
        """Keep the LightningModule unwrapped; gradient reduction is explicit (see module docstring)."""

    def model_to_device(self) -> None:
        """Move the module to ``root_device`` keeping what the parallel layers attached to its parameters and the
        ties between shared parameters (:func:`nxd_lc.layers.param_attrs.move_module`; DESIGN.md principle 17): on
        XLA and PrivateUse1 devices ``.to()`` creates new Parameter objects without them. Then an nxd_lc model
        (the LightningModule's ``model``, a :class:`~nxd_lc.models.llama.LlamaForCausalLM` or subclass) is checked:
        every parameter must carry the layout flag its layer set
        (:func:`nxd_lc.layers.param_attrs.check_parallel_attributes`), so flags lost before this move (a plain
        ``.to()`` or a deep copy elsewhere) fail here, not as a wrong gradient norm.

        Raises:
            RuntimeError: a parameter of the nxd_lc model carries no parallel attribute (names the parameter).
        """
        from nxd_lc.models.llama.model import LlamaForCausalLM

        assert self.model is not None
        self.model = move_module(self.model, self.root_device)
        inner = getattr(self.lightning_module, "model", None)
        if isinstance(inner, LlamaForCausalLM):
            check_parallel_attributes(inner)

    def teardown(self) -> None:
        """Lightning's teardown, with the module moved to the CPU keeping its parameters' parallel attributes and
        ties (:func:`nxd_lc.layers.param_attrs.preserving_parallel_attributes`): Lightning moves it with ``.cpu()``,
        which on XLA and PrivateUse1 devices makes new Parameter objects without them, and what runs after fit
        (LoRA's merged HF export) gathers each parameter by them (on XLA a vocab-parallel embedding without its flag
        was exported as its local half)."""
        module = self.lightning_module
        if module is None:
            super().teardown()
            return
        with preserving_parallel_attributes(module):
            super().teardown()

    def _ranks(self) -> dict[str, Any]:
        """This rank's checkpoint file coordinates (:func:`checkpoint_ranks`)."""
        return checkpoint_ranks(self.zero1)

    def _master_weight_state(self, model_state: dict[str, Any]) -> dict[str, Any]:
        """``model_state`` with each parameter replaced by its fp32 master weight (collective under ZeRO-1).

        Raises:
            ValueError: the optimizer keeps no master weights (the precision mode has none).
        """
        from nxd_lc.optim.wrapper import NxDOptimizer

        opt = self.optimizers[0] if self.optimizers else None
        opt = getattr(opt, "_optimizer", opt)  # LightningOptimizer wraps it
        masters = opt.full_master_weights() if isinstance(opt, NxDOptimizer) else []
        if not masters:
            raise ValueError("exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt: the optimizer keeps "
                             "no fp32 master weights in this precision mode; use precision.type mixed_precision / "
                             "mixed_precisionSR (or manual with master_weights) or set it false")
        assert self.lightning_module is not None
        names = {id(p): n for n, p in self.lightning_module.named_parameters()}
        out = dict(model_state)
        for p, w in masters:
            out[names[id(p)]] = w.detach().cpu() if w.device.type == "xla" else w.detach().clone()
        return out

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Optional[Any] = None) -> None:
        """Write ``checkpoint`` as ``<dirname(filepath)>/<basename(filepath)>`` in NxD's layout, from all ranks.

        The model shard is written by DP rank 0 / CP rank 0 of each (TP, PP) position; optimizer shards likewise
        without ZeRO-1 (every DP and CP rank holds the same optimizer state), by every DP x CP rank with it;
        trainer state goes to the user-content file.
        """
        if storage_options is not None:
            raise TypeError("NxDStrategy.save_checkpoint: storage_options are not supported")
        root, tag = os.path.split(os.path.abspath(str(filepath)))
        content = dict(checkpoint)
        model_state = content.pop(MODEL_KEY)
        optim_state = {k: content.pop(k) for k in OPTIM_KEYS if k in content}
        if self.use_master_weights_in_ckpt and optim_state:
            model_state = self._master_weight_state(model_state)
        if self.lora_only:
            model_state = {k: v for k, v in model_state.items() if is_lora_key(k)}
        ranks = self._ranks()
        # model (and unsharded optimizer) state is identical over expert-DP and CP: one writer per (EP, TP, PP)
        writer = ps.get_expert_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
        if self.async_checkpointing:
            self.finish_async_save()  # at most one save in flight
        started = time.perf_counter()
        if self.async_checkpointing:
            model_state, optim_state = map_tensors(model_state, _host_copy), map_tensors(optim_state, _host_copy)
            content = map_tensors(copy.deepcopy(content), _host_copy)
        staged = sharded.stage_checkpoint(
            root, tag, model_state=model_state, optim_state=optim_state or None, user_content=content,
            is_global_zero=self.is_global_zero, write_model=writer,
            write_optim=(writer or self.zero1) and bool(optim_state), use_xser=self.save_xser,
            save_bf16=self.save_bf16, optim_sharded=self.zero1, text_files=self.run_files, **ranks)
        if not self.async_checkpointing:
            staged.write()
            self._flush_loggers()  # before publishing: the checkpoint's own step is logged and on disk first
            staged.publish()
            self._log_saved(os.path.join(root, tag), started, "saved")
            return
        self._async_save, self._async_started = staged, started
        self._async_path = os.path.join(root, tag)
        self._async_thread = threading.Thread(target=staged.write, name=f"nxd_lc-save-{tag}", daemon=True)
        self._async_thread.start()
        if self.is_global_zero:
            log.info("checkpoint %s: state copied to host memory in %.2f s, written in the background",
                     self._async_path, time.perf_counter() - started)

    def _log_saved(self, path: str, started: float, how: str) -> None:
        """One line on global rank 0 for a published checkpoint: its path and the seconds since its save began
        (``time.perf_counter`` of :meth:`save_checkpoint`'s start)."""
        if self.is_global_zero:
            log.info("checkpoint %s %s in %.2f s", path, how, time.perf_counter() - started)

    # ---------------------------------------------------------------- asynchronous saves
    def async_write_running(self) -> bool:
        """True while this rank's background write of an asynchronous save is still running (local)."""
        return self._async_thread is not None and self._async_thread.is_alive()

    def async_save_pending(self) -> bool:
        """True when an asynchronous save was started and is not yet published (same value on every rank)."""
        return self._async_save is not None

    def wait_async_write(self) -> None:
        """Block until this rank's background write has finished (local, no collective)."""
        if self._async_thread is not None:
            self._async_thread.join()

    def publish_async_save(self) -> None:
        """Collective: vote on every rank's background write and publish the checkpoint (manifest, ``done``,
        atomic rename), then carry out the checkpoint removals Lightning asked for meanwhile. Waits for this rank's
        write first. Nothing to do when no asynchronous save is pending.

        Raises:
            RuntimeError: the write failed on some rank; nothing was published, the previous checkpoints (whose
                removal was deferred) are kept.
        """
        staged = self._async_save
        if staged is None:
            return
        self.wait_async_write()
        self._async_save, self._async_thread = None, None
        removals, self._deferred_removals = self._deferred_removals, []
        self._flush_loggers()
        staged.publish()
        self._log_saved(self._async_path, self._async_started, "published (asynchronous save)")
        for path in removals:
            self.remove_checkpoint(path)

    def _flush_loggers(self) -> None:
        """Just before a checkpoint is published: write and flush what was logged up to its step
        (:func:`nxd_lc.lightning.callbacks.flush_loggers`), so that a crash right after the publication cannot lose
        a logged value of a step the checkpoint covers."""
        flush_loggers(self.lightning_module.trainer if self.lightning_module is not None else None)

    def finish_async_save(self) -> None:
        """Collective: wait for an asynchronous save in flight and publish it (:meth:`publish_async_save`)."""
        self.publish_async_save()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Read this rank's shards of ``<root>/<tag>`` back into one Lightning checkpoint dict (with its Lightning
        version, from ``ckpt_ptl_version`` when it records none; Lightning migrates it next)."""
        root, tag = os.path.split(os.path.abspath(str(checkpoint_path)))
        tag_dir = os.path.join(root, tag)
        self._loaded_tag_dir = tag_dir
        model_moves, optim_moves = self._layout_changes(tag_dir)
        if not (model_moves or optim_moves):
            model_state, optim_state, content = sharded.load_checkpoint(root, tag, load_optim=True,
                                                                        use_xser=self.load_xser, **self._ranks())
        else:  # saved at another TP / PP / ZeRO-1 layout: this rank's shards are rebuilt from the saved ones
            ranks = self._ranks()
            model_state, _, content = sharded.load_checkpoint(root, tag, load_optim=False, use_xser=self.load_xser,
                                                              read_model=not model_moves, **ranks)
            if model_moves:
                assert self.lightning_module is not None
                model_state = reshard.reshard_model_state(self.lightning_module.model,
                                                          self.lightning_module.state_dict(), tag_dir,
                                                          use_xser=self.load_xser)
            # the optimizer does not exist yet: load_optimizer_state_dict re-shards its state from the files
            optim_state = {"optimizer_states": [{RESHARD_KEY: tag_dir}], "lr_schedulers": []} if optim_moves else None
        checkpoint = apply_ckpt_ptl_version(dict(content or {}), self.ckpt_ptl_version, tag_dir)
        checkpoint[MODEL_KEY] = model_state
        if optim_state:
            checkpoint.update(optim_state)
        return checkpoint

    def _layout_changes(self, tag_dir: str) -> tuple[bool, bool]:
        """Whether the model shards / the optimizer shards of ``tag_dir`` must be re-sharded for this run (saved
        at another TP or PP size, pipeline split or KV-replica layout: :func:`nxd_lc.checkpoint.reshard.reshard_reason`;
        saved with ZeRO-1 over another number of DP x CP ranks)."""
        saved = reshard.saved_layout(tag_dir)
        ep = ps.get_expert_model_parallel_world_size()
        model = getattr(self.lightning_module, "model", None)
        reason = reshard.reshard_reason(model, tag_dir, saved, self.load_xser)
        if saved.ep != ep:
            raise ValueError(f"checkpoint {tag_dir} was saved with expert_model_parallel_size {saved.ep} but this run "
                             f"uses {ep}: re-sharding experts over another EP size is not supported yet; resume "
                             f"with distributed_strategy.expert_model_parallel_size={saved.ep}")
        model_moves = reason is not None
        if model_moves:
            log.warning("checkpoint %s is re-sharded for this run: %s", tag_dir, reason)
        files_now = ps.get_data_parallel_world_size(with_context_parallel=True) if self.zero1 else 1
        optim_moves = saved.optim_dp > 0 and (model_moves or (saved.optim_dp > 1 and saved.optim_dp != files_now))
        why = reason or f"{saved.optim_dp} optimizer shard(s), this run's ZeRO-1 has {files_now}"
        if ep > 1 and (model_moves or optim_moves):
            raise ValueError(f"checkpoint {tag_dir} was saved at another layout ({why}); re-sharding checkpoints "
                             "with expert parallelism is not supported yet: resume at the saved sizes, "
                             "distributed_strategy.zero1 and model.pipeline_cuts")
        if self.lora_only and (model_moves or optim_moves):
            raise ValueError(f"checkpoint {tag_dir} holds LoRA adapters only and was saved at another layout "
                             f"({why}); re-sharding adapter checkpoints is not supported: resume at the saved "
                             "sizes and model.pipeline_cuts")
        return model_moves, optim_moves

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Restore the optimizer; its state (and the LR-scheduler state) is re-sharded from the checkpoint's files
        when it was saved at another TP / PP / ZeRO-1 layout (:func:`nxd_lc.checkpoint.reshard.reshard_optimizer_state`;
        also one optimizer shard saved with ZeRO-1 on and restored with it off, or the reverse). Updates
        ``checkpoint`` (Lightning's loaded checkpoint) in place.

        Raises:
            ValueError: the state cannot be re-sharded (names what and the way on).
        """
        states = checkpoint.get("optimizer_states") or [{}]
        opt = self.optimizers[0] if self.optimizers else None
        opt = getattr(opt, "_optimizer", opt)  # LightningOptimizer wraps it
        tag_dir = states[0].get(RESHARD_KEY) if isinstance(states[0], Mapping) else None
        if tag_dir is None and opt is not None and isinstance(states[0], Mapping):
            saved_zero1 = (states[0].get("nxd") or {}).get("zero1_world", 0)
            current = getattr(opt, "_world", 1) if getattr(opt, "zero1", False) else 0
            if saved_zero1 != current and self._loaded_tag_dir is not None:
                tag_dir = self._loaded_tag_dir
        if tag_dir is not None:
            assert self.lightning_module is not None and opt is not None and isinstance(checkpoint, dict)
            state, schedulers = reshard.reshard_optimizer_state(self.lightning_module.model, opt, tag_dir,
                                                                use_xser=self.load_xser)
            checkpoint["optimizer_states"] = [state]
            if schedulers is not None:
                checkpoint["lr_schedulers"] = schedulers
        super().load_optimizer_state_dict(checkpoint)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load the local shard; bf16-saved weights (save_bf16) are cast back to the parameters' dtype.

        Raises:
            ValueError: an adapter-only shard (``lora_only``) whose adapters do not match the model's (keys or
                shapes; see :func:`nxd_lc.layers.lora.load_lora_state_dict`).
        """
        assert self.lightning_module is not None
        if not self.lora_only:
            try:
                self.lightning_module.load_state_dict(checkpoint[MODEL_KEY], strict=strict)
            except RuntimeError as e:
                raise ValueError(key_mismatch_message(self._loaded_tag_dir or "the checkpoint",
                                                      self.lightning_module.state_dict(), checkpoint[MODEL_KEY],
                                                      e)) from e
            return
        # adapter-only shard: every adapter must be there, nothing else (keys and shapes checked by the loader)
        load_lora_state_dict(self.lightning_module, checkpoint[MODEL_KEY])

    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove ``<root>/<tag>`` (rank 0, atomically: renamed away before deletion).

        While an asynchronous save is not yet published the removal is deferred until it is: the checkpoint
        being replaced stays the newest complete one until then. A checkpoint that no longer exists is skipped
        (the top-k list restored from an older checkpoint can name one removed after that checkpoint was saved).
        """
        if self._async_save is not None:
            self._deferred_removals.append(filepath)
            return
        if self.is_global_zero:
            root, tag = os.path.split(os.path.abspath(str(filepath)))
            path = os.path.join(root, tag)
            if os.path.islink(path) or os.path.isdir(path):  # the restored top-k list may name one already gone
                sharded.remove_checkpoint(root, tag)
        self.barrier("remove_checkpoint")
