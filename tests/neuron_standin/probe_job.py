"""Run ``train.py``'s job in this process on the stand-in ``neuron`` device and report, per optimizer step, the
distinct ``(op, dtypes, shapes)`` the CPU fallback ran (TorchNeuron's eager compile count's proxy: each new one is
a compile on Trainium) and the host <-> device copies the job made (``_copy_from`` calls and ``.item()`` reads
outside the fallback). Test bed only (it patches nxd_lc's Trainer builder to add its probe callback).

    python tests/neuron_standin/probe_job.py [--config-path DIR --config-name NAME] <hydra overrides ...>

(default: ``conf/cpu_tiny_llama_config``; e.g. an NxDT file with ``tests/test_nxdt_examples.py``'s shrinking
overrides)

Prints one line ``RESULT <json>``: ``{"steps": {step: {"ops": [[op, dtypes, shapes, calls], ...], "copies":
{...}}}}``; steps are the optimizer step each micro-batch belongs to (1-based, as printed). Under torchrun, with
``PROBE_RESULT_DIR`` set, each rank also writes it to ``<dir>/rank<RANK>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "neuron_standin" / "pkgs")]


def main(argv: list[str]) -> None:
    config_dir, config_name = REPO / "conf", "cpu_tiny_llama_config"
    overrides = list(argv)
    while overrides and overrides[0] in ("--config-path", "--config-name"):
        flag, value, overrides = overrides[0], overrides[1], overrides[2:]
        if flag == "--config-path":
            config_dir = Path(value).resolve()
        else:
            config_name = value
    import pytorch_lightning as pl
    import torch_neuronx  # noqa: F401  (the test bed's: installs the stand-in)
    from hydra import compose, initialize_config_dir

    import nxd_lc.lightning.trainer as trainer_module
    from nxd_lc.app.run import _shutdown_distributed, run
    from tests.neuron_standin import install

    ext = install()
    steps: dict[int, dict[str, Any]] = {}

    class Probe(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
            ext.reset_counters()  # from here on everything counts, the batch's move to the device included
            ext.record_ops(True)

        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            step = batch_idx // max(1, int(trainer.accumulate_grad_batches)) + 1  # the optimizer step, as printed
            entry = steps.setdefault(step, {"ops": {}, "copies": {}})
            for op, dtypes, shapes, calls in ext.recorded_ops():
                key = f"{op}|{dtypes}|{shapes}"
                entry["ops"][key] = entry["ops"].get(key, 0) + int(calls)
            for name, value in ext.counters().items():
                entry["copies"][name] = entry["copies"].get(name, 0) + int(value)
            ext.reset_counters()
            ext.record_ops(True)  # clears the record: the next micro-batch, its transfer included

    build = trainer_module.build_trainer

    def with_probe(*args: Any, extra_callbacks: Any = (), **kwargs: Any) -> Any:
        return build(*args, extra_callbacks=[*extra_callbacks, Probe()], **kwargs)

    trainer_module.build_trainer = with_probe
    os.environ.setdefault("RANK", "0")
    for key, value in {"LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": os.environ.get("MASTER_PORT", "29617")}.items():
        os.environ.setdefault(key, value)
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        raw = compose(config_name=config_name, overrides=overrides)
    try:
        run(raw)
    finally:
        _shutdown_distributed()
    result = json.dumps({"steps": {str(k): v for k, v in sorted(steps.items())}})
    if os.environ.get("PROBE_RESULT_DIR"):  # under torchrun: one file per rank (lines of ranks would interleave)
        Path(os.environ["PROBE_RESULT_DIR"], f"rank{os.environ['RANK']}.json").write_text(result)
    print("RESULT " + result)


if __name__ == "__main__":
    main(sys.argv[1:])
