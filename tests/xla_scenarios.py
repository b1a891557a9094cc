"""Scenarios run on the multi-device XLA test bed (:mod:`xla_testbed`), one thread per XLA device.

Each is ``fn(rank, world_size, **kwargs) -> JSON-able`` and is run by ``tests/test_xla_multidevice.py`` through
:func:`xla_testbed.run_on_xla_devices`, on N devices and on one device, and the results compared there.

:func:`train` runs nxd_lc's own training-step code (``NxDLanguageModel.training_step`` for each micro-batch,
``on_before_optimizer_step`` for the gradient reductions and the global norm, ``configure_gradient_clipping``, the
optimizer of ``configure_optimizers``) on a tiny Llama whose vocabulary (200) is padded at TP > 1, so the padded-
vocabulary mask, the vocabulary offsets, the sequence-parallel norms and the KV replicas all take part. The data of
a step is a fixed global batch split over the DP ranks; the one-device run sees all of it.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from typing import Any

VOCAB = 200
SEQ = 16
GLOBAL_MICRO_ROWS = 4  # rows of one micro-batch over all DP ranks
MICRO_BATCHES = 2
_BUILD_LOCK = threading.Lock()  # model construction draws from the process-global CPU generator: one at a time


def _llama_config(layers: int = 2) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       rms_norm_eps=1e-5)


def _param_attrs(model: Any) -> dict[str, dict[str, Any]]:
    from nxd_lc.layers.param_attrs import record_parallel_attributes

    return record_parallel_attributes(model)


def _mixtral_config(aux: float = 0.0) -> Any:
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=64, output_router_logits=True, router_aux_loss_coef=aux,
                         tie_word_embeddings=False)


def train(rank: int, world: int, tp: int = 1, sp: bool = False, kv: int = 1, cp: int = 1, algo: str = "ulysses",
          zero1: bool = False, steps: int = 3, move: str = "nxd", ep: int = 1, model: str = "llama", pp: int = 1,
          vpp: int = 1, layers: int = 2, aux: float = 0.0) -> dict[str, Any]:
    """``steps`` optimizer steps of :data:`MICRO_BATCHES` micro-batches each; returns the DP-averaged loss
    and the global gradient norm of every step (read after the step's cut), a digest of the norm weights'
    bytes (to compare between TP ranks) and whether every parameter kept its parallel attributes
    through the device move.

    ``model``: ``'llama'`` or ``'mixtral'`` (4 experts, top 2, capacity factor 4: static shapes and no token
    dropped, so the result cannot depend on how tokens are split over ranks; the load-balancing coefficient ``aux``
    is 0 by default because that loss is per rank's tokens by definition (Megatron / NxD) and differs from one
    device's over the union under DP / EP; ``ep``: the experts split over that many DP ranks). ``move``:
    ``'nxd'`` moves the module with :func:`nxd_lc.layers.param_attrs.move_module` (production), ``'plain'`` with
    ``module.to(device)`` (what loses the attributes on XLA). ``pp`` / ``vpp``: pipeline parallelism (``vpp``
    virtual stages per rank) over a ``layers``-layer Llama (Mixtral: always 2 layers); the step's micro-batches
    then go through the pipeline schedule in one ``training_step`` (the lockstep schedule of
    :mod:`nxd_lc.pipeline.lockstep` on XLA).
    """
    import torch
    import torch_xla

    from nxd_lc.config.schema import NxdConfig
    from nxd_lc.context.attention import set_context_parallel_algo
    from nxd_lc.distributed import collectives
    from nxd_lc.distributed import parallel_state as ps
    from nxd_lc.layers.param_attrs import move_module
    from nxd_lc.lightning.module import NxDLanguageModel
    from nxd_lc.models.llama import LlamaForCausalLM

    cfg = NxdConfig()
    ds = cfg.distributed_strategy
    ds.tensor_model_parallel_size, ds.sequence_parallel, ds.kv_replicator = tp, sp, kv
    ds.context_parallel_size, ds.context_parallel_algo, ds.zero1 = cp, algo, zero1
    cfg.model.optim.lr = 3e-3
    cfg.trainer.gradient_clip_val = 0.5
    cfg.exp_manager.log_gradient_norm = True
    ds.expert_model_parallel_size = ep
    ds.pipeline_model_parallel_size, ds.virtual_pipeline_model_parallel_size = pp, vpp
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp, kv_replicator=kv,
                                 expert_model_parallel_size=ep, pipeline_model_parallel_size=pp)
    part: dict[str, Any] = {}
    if pp > 1:
        from nxd_lc.pipeline import rank_model_part

        part = rank_model_part(layers, pp, ps.get_pipeline_model_parallel_rank(), vpp)
    if cp > 1:
        set_context_parallel_algo(algo)
    device = torch_xla.device()
    with _BUILD_LOCK:
        torch.manual_seed(0)
        if model == "mixtral":
            from nxd_lc.models.mixtral import MixtralForCausalLM
            from nxd_lc.moe.config import MoEOptions

            built = MixtralForCausalLM(_mixtral_config(aux), moe=MoEOptions(capacity_factor=4.0, dropless=False),
                                       sequence_parallel=sp, **part)
        else:
            built = LlamaForCausalLM(_llama_config(layers), sequence_parallel=sp, kv_replicator=kv, **part)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = GLOBAL_MICRO_ROWS // dp
    cfg.data.micro_batch_size = rows  # one pipeline micro-batch
    module = NxDLanguageModel(cfg, built)
    before = _param_attrs(module.model)
    if move == "nxd":
        module = move_module(module, device)
    else:
        module = module.to(device)
    attrs_kept = _param_attrs(module.model) == before
    opt = module.configure_optimizers()["optimizer"]
    losses, norms = [], []
    for step in range(steps):
        opt.zero_grad()
        step_loss = torch.zeros(1, device=device)
        micro_ids = []
        for micro in range(MICRO_BATCHES):
            gen = torch.Generator().manual_seed(1000 * step + micro)
            ids = torch.randint(0, VOCAB, (GLOBAL_MICRO_ROWS, SEQ + 1), generator=gen)
            micro_ids.append(ids[dp_rank * rows:(dp_rank + 1) * rows])
        if pp > 1:  # the whole step in one training_step: the schedule runs every micro-batch's backward
            ids = torch.cat(micro_ids)
            batch = {"input_ids": ids[:, :-1].to(device), "labels": ids[:, 1:].to(device)}
            step_loss = step_loss + module.training_step(batch, 0).detach()
        for micro, ids in enumerate(micro_ids if pp == 1 else []):
            batch = {"input_ids": ids[:, :-1].to(device), "labels": ids[:, 1:].to(device)}
            loss = module.training_step(batch, micro)
            (loss / MICRO_BATCHES).backward()
            step_loss = step_loss + loss.detach() / MICRO_BATCHES
        module.on_before_optimizer_step(opt)
        module.configure_gradient_clipping(opt, cfg.trainer.gradient_clip_val)
        opt.step()
        step_loss = collectives.all_reduce(step_loss, ps.get_data_parallel_group(with_context_parallel=True), op="avg")
        torch_xla.sync()
        losses.append(float(step_loss[0]))
        norms.append(float(module._grad_norm))
    norm_weights = {n: hashlib.sha1(p.detach().cpu().numpy().tobytes()).hexdigest()
                    for n, p in module.model.named_parameters() if n.endswith("norm.weight")}
    return {"losses": losses, "norms": norms, "attrs_kept": attrs_kept, "norm_weights": norm_weights,
            "tp_rank": ps.get_tensor_model_parallel_rank(), "dp_rank": dp_rank,
            "pp_rank": ps.get_pipeline_model_parallel_rank(), "grads": _grad_digest(module.model)}


def _grad_digest(model: Any) -> dict[str, list[float]]:
    """Per parameter of this rank (name as in the full model), the sum and the sum of squares of its last step's
    gradient: to compare gradients between layouts that hold the same full (TP = 1) tensors."""
    import torch

    grads = {}
    for name, p in model.named_parameters():
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        if g is not None:
            grads[name] = g
    # one read of all of them (the stages hold different numbers of parameters: reads one by one would take
    # different numbers of graph cuts on different ranks)
    host = torch.cat([g.reshape(-1).float() for g in grads.values()]).cpu().split([g.numel() for g in grads.values()])
    return {name: [float(h.sum()), float(h.pow(2).sum())] for name, h in zip(grads, host)}


def barrier_late_rank(rank: int, world: int, delay_s: float = 2.0) -> dict[str, float]:
    """Rank ``world - 1`` reaches :func:`nxd_lc.distributed.collectives.barrier` ``delay_s`` late; every rank
    returns how long it waited inside the barrier (s)."""
    import torch_xla  # noqa: F401 -- the device thread's runtime

    from nxd_lc.distributed import collectives

    if rank == world - 1:
        time.sleep(delay_s)
    t0 = time.monotonic()
    collectives.barrier()
    return {"waited_s": time.monotonic() - t0}


def rank_dependent_graph(rank: int, world: int) -> list[float]:
    """A graph whose constant depends on the rank before a collective: the test bed must report a divergence
    (the stock multi-device set-up would deadlock, then abort)."""
    import torch
    import torch_xla

    from nxd_lc.distributed import collectives

    t = torch.ones(4, device=torch_xla.device()) * (rank + 1)  # a Python number baked into each rank's graph
    collectives.all_reduce(t, None if world == 1 else _world_group())
    return t.cpu().tolist()


def _world_group() -> Any:
    import torch.distributed as dist

    return dist.group.WORLD


_JOB_LOCK = threading.Lock()  # Hydra's compose and the trainer-builder wrapper are process-global


def _job_recorder() -> Any:
    import pytorch_lightning as pl

    class Recorder(pl.Callback):
        """Per-step loss and gradient norm (read back on every step: a test recording) and the graph counts."""

        def __init__(self) -> None:
            self.steps: dict[int, dict[str, float]] = {}

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            m = trainer.callback_metrics
            if "reduced_train_loss" in m and trainer.global_step not in self.steps:
                opt = trainer.optimizers[0]
                self.steps[trainer.global_step] = {"loss": float(m["reduced_train_loss"]),
                                                   "norm": float(m["gradient_norm"]),
                                                   "lr": float(opt.param_groups[0]["lr"])}
            if self.stop_after is not None and trainer.global_step >= self.stop_after:
                trainer.should_stop = True  # after this step's checkpoint (saved in an earlier callback)

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            if "val_loss" in trainer.callback_metrics and not trainer.sanity_checking:
                self.vals[trainer.global_step] = float(trainer.callback_metrics["val_loss"])

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            self.resumed_from = trainer.ckpt_path

    recorder = Recorder()
    recorder.vals, recorder.resumed_from = {}, None
    return recorder


def nxdt_job(rank: int, world: int, config_dir: str, config_name: str, overrides: list[str]) -> dict[str, Any]:
    """An NxDT example file (``config_dir/config_name.yaml``, unchanged) composed with ``overrides`` (the shrinking
    ones of ``tests/test_nxdt_examples.py``) and ``trainer.accelerator=xla``, run through ``train.py``'s code path
    (:func:`nxd_lc.app.run.run`) in this device thread. Returns the recorded steps (loss, gradient norm, learning
    rate), the validation losses and the step reached."""
    from hydra import compose, initialize_config_dir

    from nxd_lc.app.run import run
    from nxd_lc.config.resolvers import register_resolvers

    _install_job_hooks()
    recorder = _job_recorder()
    recorder.stop_after = None
    with _JOB_LOCK:
        register_resolvers()  # ${multiply:...} in NxDT's files
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            raw = compose(config_name=config_name, overrides=[*overrides, "+trainer.accelerator=xla"])
    _THREAD.recorder = recorder
    trainer = run(raw)
    return {"steps": {str(k): v for k, v in sorted(recorder.steps.items())},
            "vals": {str(k): v for k, v in sorted(recorder.vals.items())}, "global_step": int(trainer.global_step)}


def _install_job_hooks() -> None:
    """Once per process: the trainer gets this thread's recorder, and model construction takes the process-global
    CPU generator one thread at a time, seeded from the run's seed (as each process of a real node would)."""
    import torch

    import nxd_lc.app.run as run_module
    import nxd_lc.lightning.trainer as trainer_module

    with _JOB_LOCK:
        if hasattr(trainer_module.build_trainer, "_testbed"):
            return
        build = trainer_module.build_trainer

        def build_with_recorder(*args: Any, **kwargs: Any) -> Any:
            trainer = build(*args, **kwargs)
            trainer.callbacks.append(_THREAD.recorder)
            return trainer

        build_with_recorder._testbed = True  # type: ignore[attr-defined]
        trainer_module.build_trainer = build_with_recorder
        build_model = run_module.build_model

        def build_model_alone(cfg: Any, *args: Any, **kwargs: Any) -> Any:
            with _BUILD_LOCK:
                torch.manual_seed(cfg.seed)
                return build_model(cfg, *args, **kwargs)

        run_module.build_model = build_model_alone


def run_job(rank: int, world: int, run_dir: str, corpus: str, tokenizer_dir: str, max_steps: int,
            overrides: list[str], stop_after: int | None = None) -> dict[str, Any]:
    """``train.py``'s code path (:func:`nxd_lc.app.run.run` on the composed ``cpu_tiny_llama_config``) in this
    device thread, ``trainer.accelerator=xla``, ``trainer.devices=world``, on the text files of ``corpus``:
    validation and a checkpoint every 2 steps; a second call with the same ``run_dir`` resumes from its last
    checkpoint. ``stop_after``: the run stops after that optimizer step (an interruption: the schedule is still
    that of ``max_steps``). Returns the recorded steps (loss, gradient norm, learning rate), the validation losses,
    a digest of this rank's final weights (sum of squares per parameter) and the checkpoint the run resumed from
    (None: a fresh start)."""
    from hydra import compose, initialize_config_dir

    from nxd_lc.app.run import run

    recorder = _job_recorder()
    recorder.stop_after = stop_after
    base = [
        "trainer.accelerator=xla", f"trainer.devices={world}", f"trainer.max_steps={max_steps}",
        "trainer.log_every_n_steps=1", "+trainer.enable_progress_bar=false", "+exp_manager.preemption_signals=[]",
        "data.micro_batch_size=2", f"data.global_batch_size={2 * 2 * world // _model_parallel(overrides)}",
        "~data.builtin_corpus", f"+data.train_dir={corpus}", "+data.file_glob=*.py", "data.val_fraction=0.1",
        "data.tokenizer.vocab_size=300", f"+data.tokenizer.cache_dir={tokenizer_dir}",
        "trainer.val_check_interval=2", "trainer.limit_val_batches=2",
        "exp_manager.checkpoint_callback_params.every_n_train_steps=2",
        "model.encoder_seq_length=32", "+model.num_layers=1", "+model.hidden_size=64",
        "model.optim.sched.warmup_steps=1", f"exp_manager.explicit_log_dir={run_dir}/run",
        "exp_manager.create_tensorboard_logger=false", "exp_manager.log_gradient_norm=true",
    ]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _install_job_hooks()
    with _JOB_LOCK:
        with initialize_config_dir(config_dir=f"{repo}/conf", version_base=None):
            raw = compose(config_name="cpu_tiny_llama_config", overrides=base + overrides)
    _THREAD.recorder = recorder
    trainer = run(raw)
    model = trainer.lightning_module.model
    weights = {n: float(p.detach().float().pow(2).sum().cpu()) for n, p in model.named_parameters()}
    return {"steps": {str(k): v for k, v in sorted(recorder.steps.items())}, "weights": weights,
            "vals": {str(k): v for k, v in sorted(recorder.vals.items())}, "global_step": int(trainer.global_step),
            "resumed_from": recorder.resumed_from}


_THREAD = threading.local()


def _model_parallel(overrides: list[str]) -> int:
    """TP x PP of the overrides: DP = world / that, and the global batch is 2 micro-batches of 2 samples per DP
    rank (4 samples with one DP rank, as on one device, so that the runs compare equal)."""
    size = 1
    for o in overrides:
        if o.startswith(("distributed_strategy.tensor_model_parallel_size=",
                         "distributed_strategy.pipeline_model_parallel_size=")):
            size *= int(o.split("=")[1])
    return size


def checkpointing_on_xla(rank: int, world: int) -> dict[str, Any]:
    """Activation checkpointing on one XLA device (torch-xla's reentrant checkpoint): the 2-layer test Llama's
    loss and every gradient with ``selective`` ([CoreAttention, LlamaMLP]) granularity against the same model
    without checkpointing, and ``full`` with a frozen embedding (the layers' inputs then need no grad:
    the LoRA case) against no checkpointing with the same frozen embedding. Returns per case the largest absolute
    differences of loss and gradients, and whether every trainable parameter got a gradient."""
    import copy

    import torch
    import torch_xla

    from nxd_lc.distributed import parallel_state as ps
    from nxd_lc.layers.param_attrs import move_module
    from nxd_lc.models.common.checkpointing import apply_activation_checkpointing
    from nxd_lc.models.llama import LlamaForCausalLM

    ps.initialize_model_parallel()
    device = torch_xla.device()
    with _BUILD_LOCK:
        torch.manual_seed(0)
        base = LlamaForCausalLM(_llama_config())
    ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    batch = (ids[:, :-1].to(device), ids[:, 1:].to(device))

    def grads(granularity: str | None, recompute: list[str] | None, frozen_embedding: bool) -> tuple[Any, dict]:
        model = move_module(copy.deepcopy(base), device)
        if frozen_embedding:
            model.embed_tokens.weight.requires_grad_(False)
        if granularity is not None:
            apply_activation_checkpointing(model, granularity, recompute)
        loss_sum, count = model.loss(*batch)
        (loss_sum / count).backward()
        torch_xla.sync()
        return float(loss_sum / count), {n: p.grad.cpu() for n, p in model.named_parameters()
                                         if p.requires_grad and p.grad is not None}

    out = {}
    for name, gran, rec, frozen in (("selective", "selective", ["CoreAttention", "LlamaMLP"], False),
                                    ("full_frozen_embedding", "full", None, True)):
        ref_loss, ref = grads(None, None, frozen)
        loss, got = grads(gran, rec, frozen)
        out[name] = {"loss": abs(loss - ref_loss), "same_params": sorted(got) == sorted(ref) and len(ref) > 0,
                     "grad": max(float((got[n] - ref[n]).abs().max()) for n in ref)}
    return out
