"""``train.py``'s job (:func:`nxd_lc.app.run.run`, the demo config) on one stand-in ``neuron`` device with one
parameter's gradient made NaN before optimizer step ``--nan-step`` (``tests/test_nonfinite_step.py``'s
``run_with_nan_step``); reports what the run raised, whether the non-finite guard decided in the step's graph, the
parameters' device while training and whether they are finite after the run, and the device-to-host reads of each
step. Test bed only.

    python tests/neuron_standin/nan_job.py --nan-step N <hydra overrides of cpu_tiny_llama_config ...>

Prints one line ``RESULT <json>``: ``{"error": str | None, "error_type": str | None, "in_graph": bool | None,
"param_device": str, "params_finite": bool, "device_to_host_per_step": {step: reads}}``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "neuron_standin" / "pkgs")]


def main(argv: list[str]) -> None:
    import pytorch_lightning as pl
    import torch_neuronx  # noqa: F401  (the test bed's: installs the stand-in)
    from hydra import compose, initialize_config_dir

    import nxd_lc.lightning.trainer as trainer_module
    from tests.neuron_standin import install
    from tests.test_nonfinite_step import run_with_nan_step

    assert argv[0] == "--nan-step", argv
    nan_step, overrides = int(argv[1]), argv[2:]
    ext = install()
    seen: dict[str, Any] = {"reads": {}}

    class Reads(pl.Callback):  # device-to-host reads per optimizer step (one micro-batch per step here)
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            ext.reset_counters()

        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
            seen["reads"][trainer.global_step] = int(ext.counters()["device_to_host"])
            seen["trainer"], seen["device"] = trainer, next(module.parameters()).device.type

    build = trainer_module.build_trainer

    def with_reads(*args: Any, extra_callbacks: Any = (), **kwargs: Any) -> Any:
        return build(*args, extra_callbacks=[*extra_callbacks, Reads()], **kwargs)

    trainer_module.build_trainer = with_reads
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        raw = compose(config_name="cpu_tiny_llama_config", overrides=overrides)
    result: dict[str, Any] = {"error": None, "error_type": None}
    try:
        run_with_nan_step(raw, nan_step, env={"MASTER_PORT": os.environ.get("MASTER_PORT", "29618")})
    except Exception as e:  # noqa: BLE001 - reported to the test, which checks the type
        result["error"], result["error_type"] = str(e), type(e).__name__
    module = seen["trainer"].lightning_module if "trainer" in seen else None
    guard = getattr(module, "nonfinite_guard", None)
    result["in_graph"] = None if guard is None else guard.in_graph
    result["param_device"] = seen.get("device")  # while training (Lightning's teardown moves the model back)
    result["params_finite"] = None if module is None else all(bool(p.detach().cpu().isfinite().all())
                                                              for p in module.parameters())
    result["device_to_host_per_step"] = {str(k): v for k, v in sorted(seen["reads"].items())}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
