"""Step time during an asynchronous checkpoint save vs a synchronous one, on the CPU demo (TP=2 + SP, 2 processes).

Run from the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.async_checkpoint               # 2 rounds (~5 min)
    .venv/bin/python -m benchmarks.async_checkpoint --reanalyse benchmarks/results/async_checkpoint.json

**What runs.** ``torchrun --nproc_per_node=2 train.py --config-name cpu_tiny_llama_config`` (the demo: the ~7M
parameter Llama, TP = 2 with sequence parallelism, 2048-token sequences, global batch 4, xser checkpoints), with
``trainer.max_steps=20``, a checkpoint every 4 steps (``save_top_k: 2``), no validation, once with
``exp_manager.async_checkpointing: false`` and once ``true``; the order alternates between rounds.

**How step time is measured.** ``throughput/seqs_per_sec`` of every step from the run's TensorBoard events
(:class:`nxd_lc.lightning.callbacks.ThroughputLogger`: the time between the ends of consecutive steps); step time =
global batch / that. A save runs in the checkpoint callback at the end of its step, after the throughput logger, so
its cost lands in the *next* step's interval: steps 5, 9, 13, 17 carry the saves of steps 4, 8, 12, 16, and the
step after each (6, 10, ...) carries an asynchronous save's publication and the background thread's competition
for the cores, so a save's cost is measured over that pair. "Ordinary" = the other steps except the first two
(warm-up). Overhead = median pair time - 2 x median ordinary step; headline = async overhead / sync overhead of the
same round, and the medians over rounds.

What the CPU can show: the background thread shares the two cores (and the GIL, for pickling) with the two training
processes, so the overlap is partial; on Trainium the device computes the step while the host writes.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
STEPS, EVERY, GLOBAL_BATCH = 20, 4, 4


def _run(log_dir: str, asynchronous: bool) -> dict[int, float]:
    """One training run; returns {step: seconds} (step numbers from 1)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc_per_node=2", "train.py", "--config-name", "cpu_tiny_llama_config",
           f"exp_manager.explicit_log_dir={log_dir}", f"trainer.max_steps={STEPS}", "trainer.log_every_n_steps=1",
           "trainer.val_check_interval=1000", "trainer.limit_val_batches=0", "+trainer.enable_progress_bar=false",
           f"exp_manager.checkpoint_callback_params.every_n_train_steps={EVERY}",
           "exp_manager.checkpoint_callback_params.save_top_k=2",
           f"exp_manager.async_checkpointing={str(asynchronous).lower()}"]
    out = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                         check=False, timeout=1200)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    (events,) = glob.glob(os.path.join(log_dir, "tensorboard", "events.out.tfevents.*"))
    acc = EventAccumulator(events)
    acc.Reload()
    return {e.step: GLOBAL_BATCH / e.value for e in acc.Scalars("throughput/seqs_per_sec")}


def _split(times: dict[int, float]) -> tuple[list[float], list[float]]:
    """(time of each save's step pair: the step carrying the save + the next one, which carries an async
    publication and the background thread's competition for the cores), ordinary step times)."""
    save_steps = {s + 1 for s in range(EVERY, STEPS, EVERY)}
    ordinary = [t for s, t in times.items() if s > 2 and s not in save_steps and s - 1 not in save_steps]
    pairs = [times[s] + times[s + 1] for s in sorted(save_steps) if s in times and s + 1 in times]
    return pairs, ordinary


def analyse(result: dict[str, Any]) -> dict[str, Any]:
    """Per mode: median ordinary / save step and overhead; per round the async/sync overhead ratio."""
    per_round = []
    for r in result["rounds"]:
        row = {}
        for mode in ("sync", "async"):
            save, ordinary = _split({int(k): v for k, v in r[mode].items()})
            row[mode] = {"ordinary_s": statistics.median(ordinary), "save_pair_s": statistics.median(save),
                         "overhead_s": statistics.median(save) - 2 * statistics.median(ordinary)}
        row["overhead_ratio"] = row["async"]["overhead_s"] / row["sync"]["overhead_s"]
        row["save_pair_ratio"] = row["async"]["save_pair_s"] / row["sync"]["save_pair_s"]
        per_round.append(row)
    med = {k: statistics.median(r[k] for r in per_round) for k in ("overhead_ratio", "save_pair_ratio")}
    lines = ["| mode | ordinary step s | save step + next step s | save overhead s |", "|---|---|---|---|"]
    for mode in ("sync", "async"):
        vals = [statistics.median(r[mode][k] for r in per_round) for k in ("ordinary_s", "save_pair_s", "overhead_s")]
        lines.append(f"| {mode} | {vals[0]:.3f} | {vals[1]:.3f} | {vals[2]:.3f} |")
    lines.append(f"\nasync / sync, same round (median of {len(per_round)}): save overhead "
                 f"{med['overhead_ratio']:.2f}x, save step + next step {med['save_pair_ratio']:.2f}x")
    return {"per_round": per_round, "median": med, "markdown": "\n".join(lines)}


def _write(result: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(result, indent=2))
    path.with_suffix(".md").write_text(result["analysis"]["markdown"] + "\n")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (module docstring); returns 0."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.async_checkpoint")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / "async_checkpoint.json"))
    p.add_argument("--reanalyse", default=None)
    args = p.parse_args(argv)
    if args.reanalyse:
        from benchmarks.long_context import reanalyse

        return reanalyse(args.reanalyse, analyse)
    rounds = []
    for r in range(args.rounds):
        order = ("sync", "async") if r % 2 == 0 else ("async", "sync")
        row: dict[str, Any] = {}
        for mode in order:
            with tempfile.TemporaryDirectory() as tmp:
                row[mode] = _run(tmp, mode == "async")
                if mode == "async" or "ckpt_bytes" not in row:
                    row["ckpt_bytes"] = sum(os.path.getsize(f) for f in glob.glob(
                        os.path.join(tmp, "checkpoints", "*", "**", "*"), recursive=True) if os.path.isfile(f)) // 2
        rounds.append(row)
        print(f"round {r} done", flush=True)
    result = {"benchmark": "async_checkpoint", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "steps": STEPS, "every_n_train_steps": EVERY, "rounds": rounds}
    result["analysis"] = analyse(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _write(result, out)
    print(result["analysis"]["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
