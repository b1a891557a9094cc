"""Test-bed scenario (:mod:`xla_testbed`): what a training step of a whole job sends back to the host on N XLA devices.

:func:`host_reads_job` runs ``train.py``'s code path (:func:`nxd_lc.app.run.run` on the composed
``cpu_tiny_llama_config``, ``trainer.accelerator=xla``, ``trainer.devices=world``) with the run's default
``exp_manager.preemption_signals`` (unless ``signals`` says otherwise) and records, for every optimizer step (from
the start of its first micro-batch to the start of the next step's, so that a step's window holds its preemption
vote and Lightning's logging after ``on_train_batch_end``), torch-xla's counters
(:func:`nxd_lc.runtime.xla.graph_stats`: graph executions, device-to-host transfers, compiles) and the calls of
``xm.rendezvous`` (``xm.mesh_reduce``), which the test bed replaces by a host exchange and counts because in
production each is device work and host reads (``rendezvous_calls``).

torch-xla's metrics are per process, so on the test bed they sum every device thread: the ranks meet at a host
barrier (the test bed's exchange, no device work) before rank 0 takes the snapshot and again after it, and rank 0
waits for the device and for the counters to settle (:func:`_settled_stats`), so that each step's difference holds
exactly that step's executions and transfers of every rank (executions finish asynchronously: without the wait a
step's count varies). The recorder itself reads nothing from the device. Used by ``tests/test_xla_host_reads.py``.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

_LOCK = threading.Lock()  # Hydra's compose and the trainer-builder wrapper are process-global
_THREAD = threading.local()
_BUILD_LOCK = threading.Lock()  # the CPU generator that initialises the weights is process-wide here


def _settled_stats(xm: Any, graph_stats: Any) -> dict[str, int]:
    """torch-xla's counters once every launched graph has finished and the counters stopped moving: a transfer's
    ``TransferFromDeviceTime`` sample can land shortly after the read returned (measured: a logging step's last
    transfer counted in the next step's window without this), so poll until two reads 50 ms apart agree (at most
    2 s)."""
    xm.wait_device_ops()
    stats = vars(graph_stats())
    for _ in range(40):
        time.sleep(0.05)
        again = vars(graph_stats())
        if again == stats:
            break
        stats = again
    return stats


def _recorder(rank: int) -> Any:
    import pytorch_lightning as pl
    import torch_xla.core.xla_model as xm
    from xla_testbed import current_bed

    from nxd_lc.runtime.xla import graph_stats

    class HostReadRecorder(pl.Callback):
        """Cumulative counters when every optimizer step starts and when training ends (rank 0's snapshot of the
        process's metrics; ``before_step``: the step about to run, ``max_steps + 1`` at the end)."""

        def __init__(self) -> None:
            self.steps: list[dict[str, int]] = []
            self.loop = ""
            self._last = -1

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.loop = type(trainer.fit_loop.epoch_loop).__name__

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step != self._last:  # the first micro-batch of a step
                self._last = trainer.global_step
                self._snapshot(trainer.global_step + 1)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self._snapshot(trainer.global_step + 1)

        def _snapshot(self, before_step: int) -> None:
            bed = current_bed()
            if bed is not None:
                bed.exchange(("hostreads_before", before_step), rank)  # every rank is here
            stats = _settled_stats(xm, graph_stats) if rank == 0 else {}
            if bed is not None:
                bed.exchange(("hostreads_after", before_step), rank)  # nobody goes on before the snapshot
            calls = bed.rendezvous_calls[rank] if bed is not None else 0
            self.steps.append({"before_step": before_step, "rendezvous": calls, **stats})

    return HostReadRecorder()


def host_reads_job(rank: int, world: int, run_dir: str, corpus: str, tokenizer_dir: str, max_steps: int = 10,
                   log_every_n_steps: int = 5, signals: list[str] | None = None,
                   extra: list[str] | None = None) -> dict[str, Any]:
    """``max_steps`` optimizer steps of 2 micro-batches each (micro-batch 2, data parallel over ``world``), metrics
    printed every ``log_every_n_steps`` steps, no validation and no checkpoint callback (the steps measured are
    ordinary or logging steps). ``signals``: ``exp_manager.preemption_signals`` (None: the default, which names
    SIGTERM); ``extra``: more overrides, applied last. Returns ``{"steps": [{"before_step", "executions",
    "transfers_from_device", "compiles", "rendezvous", ...}], "loop": the training-epoch loop's class name,
    "micro_batches": 2}`` (counters cumulative; the device counters only on rank 0)."""
    import torch
    from hydra import compose, initialize_config_dir

    import nxd_lc.app.run as run_module
    import nxd_lc.lightning.trainer as trainer_module

    overrides = [
        "trainer.accelerator=xla", f"trainer.devices={world}", f"trainer.max_steps={max_steps}",
        f"trainer.log_every_n_steps={log_every_n_steps}", "+trainer.enable_progress_bar=false",
        "trainer.limit_val_batches=0", "exp_manager.create_checkpoint_callback=false",
        "distributed_strategy.tensor_model_parallel_size=1", "distributed_strategy.sequence_parallel=false",
        "data.micro_batch_size=2", f"data.global_batch_size={2 * 2 * world}",
        "~data.builtin_corpus", f"+data.train_dir={corpus}", "+data.file_glob=*.py", "data.val_fraction=0.1",
        "data.tokenizer.vocab_size=300", f"+data.tokenizer.cache_dir={tokenizer_dir}",
        "model.encoder_seq_length=32", "+model.num_layers=1", "+model.hidden_size=64",
        "model.optim.sched.warmup_steps=1", f"exp_manager.explicit_log_dir={run_dir}/run",
        "exp_manager.create_tensorboard_logger=false",
    ]
    if signals is not None:
        overrides.append(f"+exp_manager.preemption_signals=[{','.join(signals)}]")
    overrides += extra or []  # e.g. a pipeline layout (docs/experiments/xla_host_reads.md measures PP 2 with it)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with _LOCK:
        with initialize_config_dir(config_dir=f"{repo}/conf", version_base=None):
            raw = compose(config_name="cpu_tiny_llama_config", overrides=overrides)
        if not hasattr(trainer_module.build_trainer, "_hostreads"):
            build = trainer_module.build_trainer

            def build_with_recorder(*args: Any, **kwargs: Any) -> Any:
                trainer = build(*args, **kwargs)
                trainer.callbacks.append(_THREAD.recorder)  # last: after the preemption callback's vote
                return trainer

            build_with_recorder._hostreads = True  # type: ignore[attr-defined]
            trainer_module.build_trainer = build_with_recorder
            build_model = run_module.build_model

            def build_model_alone(cfg: Any, *args: Any, **kwargs: Any) -> Any:
                with _BUILD_LOCK:  # one thread at a time, from the run's seed, as each process would
                    torch.manual_seed(cfg.seed)
                    return build_model(cfg, *args, **kwargs)

            run_module.build_model = build_model_alone
    recorder = _recorder(rank)
    _THREAD.recorder = recorder
    trainer = run_module.run(raw)
    return {"steps": recorder.steps, "loop": recorder.loop, "micro_batches": 2,
            "global_step": int(trainer.global_step)}
