"""A step whose loss or gradients are NaN / inf is not applied, and the run stops after
``trainer.max_consecutive_nonfinite_steps`` of them (issue 32, item 2; nxd_lc.lightning.nonfinite).

Before this, a NaN step was applied: the weights became NaN and the run went on (the checkpoint save refused to
publish them, the step itself went unnoticed). Each test injects the fault where a real run gets it (a NaN /
inf loss before backward, a NaN in one rank's gradient shard) and compares the parameters and optimizer state
with their values before the step, bit for bit, and with an independent run that never saw the bad batch.
"""

from __future__ import annotations

import math
import os
import shutil
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_utils import run_distributed
from transformers import LlamaConfig

from nxd_lc.config.schema import NxdConfig
from nxd_lc.distributed import parallel_state as ps
from nxd_lc.lightning.module import NxDLanguageModel
from nxd_lc.lightning.nonfinite import NonFiniteTrainingError
from nxd_lc.models.llama import LlamaForCausalLM

VOCAB = 66


def _module(mode: str = "fp32", zero1: bool = False, limit: int = 1, clip: float | None = 1.0,
            check: bool = True, tp: int = 1, layers: int = 2) -> tuple[NxDLanguageModel, torch.optim.Optimizer]:
    cfg = NxdConfig()
    cfg.precision.type = mode
    cfg.distributed_strategy.zero1 = zero1
    cfg.distributed_strategy.tensor_model_parallel_size = tp
    cfg.model.optim.lr = 3e-3
    cfg.model.optim.weight_decay = 0.1
    cfg.trainer.gradient_clip_val = clip
    cfg.trainer.check_for_nan_in_loss_and_grad = check
    cfg.trainer.max_consecutive_nonfinite_steps = limit
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64))
    module = NxDLanguageModel(cfg, model)
    return module, module.configure_optimizers()["optimizer"]


def _step(module: NxDLanguageModel, opt: torch.optim.Optimizer, step: int, poison: float | None = None) -> None:
    """Optimizer step ``step`` (its own batch), through the module's hooks in Lightning's order; ``poison``
    multiplies the loss before backward (NaN / inf: the fault of a diverging or overflowing step)."""
    opt.zero_grad()
    gen = torch.Generator().manual_seed(1000 * step + ps.get_data_parallel_rank())
    ids = torch.randint(0, VOCAB, (2, 17), generator=gen).to(next(module.model.parameters()).device)
    loss = module.training_step({"input_ids": ids[:, :-1], "labels": ids[:, 1:]}, 0)
    if poison is not None:
        loss = loss * poison
    loss.backward()

    def closure() -> None:  # what Lightning's precision plugin runs inside optimizer.step(closure)
        module.on_before_optimizer_step(opt)
        module.configure_gradient_clipping(opt, module.cfg.trainer.gradient_clip_val)

    opt.step(closure)
    if module.nonfinite_guard is not None:
        module.nonfinite_guard.after_step(opt)


def _state(module: NxDLanguageModel, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter, master weight and optimizer-state tensor, copied."""
    out = {f"param.{n}": p.detach().clone() for n, p in module.model.named_parameters()}
    for i, (key, st) in enumerate(opt.state.items()):
        out[f"master.{i}"] = key.detach().clone()
        for k, v in st.items():
            if torch.is_tensor(v):
                out[f"state.{i}.{k}"] = v.detach().clone()
    return out


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every floating tensor inside a (nested) state."""
    if torch.is_tensor(obj):
        return [obj] if obj.is_floating_point() else []
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


MODES = [("fp32", False), ("mixed_precision", False), ("bf16SR", False), ("mixed_precision", True)]


@pytest.mark.parametrize("mode,zero1", MODES)
@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_a_non_finite_step_changes_nothing_and_training_goes_on(mode: str, zero1: bool, poison: float) -> None:
    """limit 3, one bad step: after it every parameter, master weight and state tensor (Adam's ``step`` count
    included) is bit-equal to before it; the run goes on and ends where a run that never saw that batch ends."""
    module, opt = _module(mode, zero1, limit=3)
    _step(module, opt, 1)
    before = _state(module, opt)
    _step(module, opt, 2, poison=poison)
    _assert_same(_state(module, opt), before)
    assert module.nonfinite_guard.run == 1 and module.nonfinite_guard.skipped == 1
    _step(module, opt, 3)
    after = _state(module, opt)
    assert all(torch.isfinite(v.float()).all() for v in after.values())
    assert module.nonfinite_guard.run == 0
    ref, ref_opt = _module(mode, zero1, check=False)  # the same run without step 2's batch
    _step(ref, ref_opt, 1)
    _step(ref, ref_opt, 3)
    for name, p in ref.model.named_parameters():
        assert torch.equal(after[f"param.{name}"], p.detach()), name
    assert any(not torch.equal(after[k], before[k]) for k in before if k.startswith("param."))  # step 3 applied


def test_without_the_check_a_nan_step_reaches_the_weights() -> None:
    """The fault the guard stops: the same step applied, the weights become NaN (the test's injection works)."""
    module, opt = _module(check=False)
    _step(module, opt, 1)
    _step(module, opt, 2, poison=math.nan)
    assert not all(torch.isfinite(p).all() for p in module.model.parameters())


@pytest.mark.parametrize("limit,bad,stop", [(1, [2], (2, 2)), (2, [2, 3], (2, 3)), (2, [2, 4, 5], (4, 5))])
def test_the_run_stops_after_the_limit_naming_the_steps(limit: int, bad: list[int], stop: tuple[int, int]) -> None:
    module, opt = _module(limit=limit)
    last_good: dict[str, torch.Tensor] = {}
    for step in range(1, 7):
        try:
            _step(module, opt, step, poison=math.nan if step in bad else None)
        except NonFiniteTrainingError as e:
            assert (e.first_step, e.last_step) == stop
            text = str(e)
            label = f"step {stop[1]}" if stop[0] == stop[1] else f"steps {stop[0]}-{stop[1]}"
            assert label in text and f"max_consecutive_nonfinite_steps = {limit}" in text
            _assert_same(_state(module, opt), last_good)  # the bad steps' updates were not applied
            return
        if step not in bad:
            last_good = _state(module, opt)
    pytest.fail("the run did not stop")


def _tp_worker(rank: int, world: int) -> None:
    """TP=2: one rank's gradient shard gets a NaN after backward (a local overflow); both ranks skip the update
    (the decision is the global norm's, the same on every rank) and both stop."""
    torch.set_num_threads(1)
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    module, opt = _module("fp32", limit=1, tp=2)
    _step(module, opt, 1)
    before = _state(module, opt)
    opt.zero_grad()
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(7))
    module.training_step({"input_ids": ids[:, :-1], "labels": ids[:, 1:]}, 0).backward()
    if rank == 1:
        mlp = module.model.layers[0].mlp
        weight = next(p for p in mlp.parameters() if p.grad is not None)
        weight.grad.view(-1)[3] = float("nan")
    with pytest.raises(NonFiniteTrainingError, match="optimizer step 2 "):
        module.on_before_optimizer_step(opt)
    opt.step()  # what would follow if the error were caught: nothing changes on either rank
    _assert_same(_state(module, opt), before)


@pytest.mark.distributed
def test_tensor_parallel_ranks_decide_together() -> None:
    run_distributed(_tp_worker, 2)


def test_trainer_keys_are_validated() -> None:
    from nxd_lc.app.validation.training import domain_problems

    cfg = NxdConfig()
    for bad in (0, -1, True, 1.5):
        cfg.trainer.max_consecutive_nonfinite_steps = bad
        assert any(p.startswith("trainer.max_consecutive_nonfinite_steps:") for p in domain_problems(cfg)), bad
    cfg.trainer.max_consecutive_nonfinite_steps = 4
    assert not domain_problems(cfg)


def stdlib_corpus(dst: Path) -> Path:
    """``dst`` made and filled with 40 small stdlib modules (200 B - 4 kB, in path order): real text to train on."""
    dst.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    small = sorted(p for p in stdlib.glob("*.py") if 200 <= p.stat().st_size <= 4000)[:40]
    for i, src in enumerate(small):
        shutil.copy(src, dst / f"doc_{i:03d}.py")
    return dst


def run_with_nan_step(raw: Any, nan_step: int, env: dict[str, str] | None = None) -> Any:
    """``train.py``'s path (:func:`nxd_lc.app.run.run`) on the composed config ``raw`` in this process, with one
    parameter's gradient made NaN before optimizer step ``nan_step`` and ``env`` added to the environment. The
    environment (the run sets its table; torchrun's variables and ``XLA_PERSISTENT_CACHE_PATH`` are removed) and
    ``torch.distributed`` are restored afterwards. Returns the Trainer."""
    import pytorch_lightning as pl

    import nxd_lc.lightning.trainer as trainer_module
    from nxd_lc.app.run import _shutdown_distributed, run

    class PoisonStep(pl.Callback):
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if trainer.global_step + 1 == nan_step:  # callbacks run before the module's hook: after backward
                next(p for p in pl_module.parameters() if p.grad is not None).grad.fill_(float("nan"))

    build = trainer_module.build_trainer

    def build_with_poison(*args: Any, **kwargs: Any) -> Any:
        trainer = build(*args, **kwargs)
        trainer.callbacks.insert(0, PoisonStep())
        return trainer

    trainer_module.build_trainer = build_with_poison
    saved = dict(os.environ)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "XLA_PERSISTENT_CACHE_PATH"):
        os.environ.pop(key, None)
    os.environ.update(env or {})
    try:
        return run(raw)
    finally:
        trainer_module.build_trainer = build
        _shutdown_distributed()
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.slow
def test_a_job_with_a_nan_step_exits_with_the_error_and_keeps_the_last_finite_checkpoint(tmp_path: Path) -> None:
    """``train.py``'s path (nxd_lc.app.run on the CPU demo config), a checkpoint every step, NaN gradients in
    step 3: the run raises naming step 3, the newest checkpoint is step 2's, and it is finite."""
    from hydra import compose, initialize_config_dir

    from nxd_lc.checkpoint import sharded

    repo = Path(__file__).resolve().parent.parent
    run_dir = tmp_path / "run"
    corpus = stdlib_corpus(tmp_path / "corpus")
    overrides = ["~data.builtin_corpus", f"+data.train_dir={corpus}", "+data.file_glob=*.py",
                 "data.val_fraction=0.1", "data.tokenizer.vocab_size=300",
                 f"+data.tokenizer.cache_dir={tmp_path / 'tok'}",
                 "trainer.max_steps=5", "trainer.log_every_n_steps=1", "+trainer.enable_progress_bar=false",
                 "+exp_manager.preemption_signals=[]", "data.micro_batch_size=1", "data.global_batch_size=1",
                 "model.encoder_seq_length=32", "+model.num_layers=1", "+model.hidden_size=64",
                 "trainer.val_check_interval=100", "exp_manager.checkpoint_callback_params.every_n_train_steps=1",
                 "exp_manager.checkpoint_callback_params.save_top_k=-1",
                 f"exp_manager.explicit_log_dir={run_dir}", "exp_manager.create_tensorboard_logger=false",
                 "trainer.devices=1", "distributed_strategy.tensor_model_parallel_size=1",
                 "distributed_strategy.sequence_parallel=false"]
    with initialize_config_dir(config_dir=str(repo / "conf"), version_base=None):
        raw = compose(config_name="cpu_tiny_llama_config", overrides=overrides)
    with pytest.raises(NonFiniteTrainingError, match="optimizer step 3"):
        run_with_nan_step(raw, 3)
    root = run_dir / "checkpoints"
    tags = sharded.list_checkpoints(str(root))
    assert [t.split("--")[1].split("-")[0] for t in tags] == ["step=1", "step=2"], tags
    assert sharded.latest_checkpoint(str(root)) == tags[-1]
    files = sorted((root / tags[-1] / "model").rglob("tensor_*.pt"))  # xser: one file per tensor
    assert files
    assert all(torch.isfinite(v).all() for f in files for v in _tensors(torch.load(f, weights_only=True)))


# ---- lane 2: the in-graph path on an XLA device ------------------------------------------------------------------
def xla_scenario(mode: str, zero1: bool) -> None:
    """The body of :func:`test_xla_decides_in_the_graph_without_reading_the_host`, run in a fresh process (in a
    pytest worker that already ran a CPU backward, autograd's engine has no ready queue for the XLA device and
    the backward fails with an internal assert)."""
    from nxd_lc.layers.param_attrs import move_module
    from nxd_lc.runtime import xla as xla_runtime

    device = xla_runtime.xla_device()
    module, _ = _module(mode, zero1, limit=1, layers=1)
    move_module(module.model, device)
    opt = module.configure_optimizers()["optimizer"]
    guard = module.nonfinite_guard

    def step(k: int, poison: float | None = None) -> None:
        _step(module, opt, k, poison)
        xla_runtime.sync()

    def host_state() -> dict[str, torch.Tensor]:
        return {k: v.cpu() for k, v in _state(module, opt).items() if v.device.type == "xla"}

    for k in (1, 2):  # warm-up: compiles the step graphs
        step(k)
    before = xla_runtime.graph_stats()
    for k in (3, 4):
        step(k)
    after = xla_runtime.graph_stats()
    assert after.transfers_from_device == before.transfers_from_device, (before, after)
    assert guard.in_graph
    guard.check()  # nothing non-finite yet: no error
    good = host_state()
    step(5, poison=math.nan)
    step(6)  # finite, but after the limit was reached: not applied either
    _assert_same(host_state(), good)
    with pytest.raises(NonFiniteTrainingError, match="optimizer step 5 "):
        guard.check()


@pytest.mark.xla
@pytest.mark.parametrize("mode,zero1", [("fp32", False), ("mixed_precision", True), ("bf16SR", False)])
def test_xla_decides_in_the_graph_without_reading_the_host(mode: str, zero1: bool) -> None:
    """On XLA: ordinary steps transfer nothing to the host (the decision is in the step's graph); a NaN step
    leaves every parameter, master weight and device state tensor as it was; after the limit (1) no later update
    is applied either, and the next read (:meth:`check`, a logging / checkpoint step) raises naming the step."""
    pytest.importorskip("torch_xla")
    import subprocess
    import sys

    tests = str(Path(__file__).resolve().parent)
    code = (f"import sys; sys.path.insert(0, {tests!r}); import test_nonfinite_step as t; "
            f"t.xla_scenario({mode!r}, {zero1})")
    env = {**os.environ, "PJRT_DEVICE": "CPU", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(Path(tests).parent), env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
