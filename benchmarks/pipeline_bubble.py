"""Pipeline bubble of nxd_lc's 1F1B schedule at PP = 2, measured against (p-1)/(m+p-1), and per-stage peak memory.

Run from the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.pipeline_bubble            # m = 4, 8; 3 rounds (2-4 min)
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.pipeline_bubble --smoke    # tiny model, m = 4 (~20 s)
    .venv/bin/python -m benchmarks.pipeline_bubble --reanalyse benchmarks/results/pipeline_bubble.json

**Model and step.** :data:`PIPELINE_MODEL`: nxd_lc's Llama, 8 layers, hidden 256, 4 heads / 2 KV heads,
intermediate 688, vocab 512, fp32, seed-0 initialisation (the same weights at every pipeline split), micro batch 1
of ``--seq-len`` (128) random tokens. One **step** = :meth:`nxd_lc.pipeline.PipelineEngine.train_step` over ``m``
micro-batches (forward + backward of all of them, gradients accumulated; no optimizer step), PP = 2 (balanced
split, 4 layers per stage; stage 0 also holds the embedding, stage 1 the final norm, lm head and loss), two gloo
processes with one torch thread each (one core each on the 2-core machine). The PP = 1 reference runs the same
``m`` micro-batches through the whole model in one process (gradient accumulation, each micro-batch loss / m):
the same loss, which the run checks.

**Bubble** (per rank ``r``; step time ``T_r`` = that rank's wall time of ``train_step``, both ranks released
together by a barrier):

* ``idle`` (the headline figure): ``1 - busy_r / T_r``, where ``busy_r`` is the time the rank spent computing its
  stage. It is timed inside the step from hooks on the stage module (:class:`nxd_lc.pipeline.PipelineStageModule`),
  without touching library code or patching torch (:class:`benchmarks.pipeline_schedule.StageClock`: forward
  pre-hook and hook; identity autograd functions on the stage's output and input whose backward stamps the start
  and end of the stage's backward; the parameters' post-accumulate-grad hooks).
  Everything else in the step is idle: waiting for the neighbour (the bubble proper), gloo send / receive of the
  activation ``[1, S, H]`` and its gradient, the schedule's Python, and the final all-reduce of the loss.
* ``simulated``: an event simulation of torch's ``Schedule1F1B`` order (rank ``r`` runs ``p - r`` warm-up
  forwards, then backward / forward pairs, then the remaining backwards; a forward waits for the previous stage's
  forward of that micro-batch, a backward for the next stage's backward) with free communication
  (:func:`benchmarks.pipeline_schedule.simulate_1f1b`). Fed with each rank's median in-pipeline forward and
  backward times, it gives the bubble of these stage times (imbalance and forward / backward ratio included);
  fed with each step's own per-micro-batch times (``simulated_per_step``), it also includes their jitter. What
  the measurement has beyond the latter is overhead: transfers, Python, waking a blocked rank.
* ``alone``: ``1 - m * t_alone_r / T_r``: after every step each rank runs ``m`` forward + backward passes of its
  stage module alone (no communication; random input activation and output gradient of the right shape), both
  ranks at once; ``t_alone_r`` is their mean. This is "ideal time = m x (per-micro-batch compute of one stage)";
  it compares times taken at different moments, so on a shared machine it is the noisiest of the three.

Diagnostics in the JSON: ``p2p_one_way_s`` (a blocking send / receive ping-pong of the activation between the two
ranks, half the round trip), ``cpu_over_busy`` (the rank's thread CPU time in the step / its compute time: about 1
when it ran undisturbed, lower when other processes took its core) and ``bubble_idle_undisturbed`` (the steps in
which every rank had ``cpu_over_busy`` >= 0.9).

``formula`` = (p-1)/(m+p-1) (GPipe, Huang et al. 2019; 1F1B, Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", sec. 2.2.1): the idle fraction of every stage when
all stages take the same time per micro-batch and communication is free. Each figure is the median over all
timed steps of all rounds, averaged over the two ranks; rounds are separate process launches and alternate the
order of ``m``.

**Memory** (deterministic): the peak of live tensor bytes during one more step per ``m``, tracked op by op with
:class:`benchmarks.memory_estimate.LiveBytesTracker` (a ``TorchDispatchMode`` that adds each new storage and
subtracts it when Python frees it), seeded with every CPU tensor alive at the start of the step (found with
``gc``: parameters, buffers, the batch, the pipeline's receive buffers); gradients are set to None before the
step, as after ``zero_grad(set_to_none=True)``; taken from a round whose processes ran this ``m`` first (the
engine keeps every ``m``'s schedule, with its receive buffers). The same for the PP = 1 run; ``vs PP=1`` = stage
peak / PP = 1 peak. Each process's peak RSS over its timed steps (``VmHWM`` restarted with
``/proc/self/clear_refs``) is in the JSON too (every process holds ~0.37 GB of interpreter and libraries, which
pulls RSS ratios towards 1).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.common import hf_llama_config, rss_bytes
from benchmarks.long_context import ROOT, _free_port, _log, _machine, _write, reanalyse
from benchmarks.pipeline_schedule import StageClock, formula_bubble, simulate_1f1b
from benchmarks.precision import _reset_peak_rss
from benchmarks.procs import GIB, run_children

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["PIPELINE_MODEL", "SMOKE_PIPELINE_MODEL", "analyse", "main", "measure_pp", "measure_pp1", "tensor_peak"]

#: The benchmarked model (HF LlamaConfig fields): ~50 ms forward + backward per stage and micro-batch on one core.
PIPELINE_MODEL: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}

#: The smoke test's model (same architecture, milliseconds per micro-batch).
SMOKE_PIPELINE_MODEL: dict[str, Any] = {**PIPELINE_MODEL, "vocab_size": 128, "hidden_size": 64,
                                        "intermediate_size": 172, "num_hidden_layers": 2}
PP = 2


# ---- measurement (inside the worker processes) ------------------------------------------------------------------
def _batch(model: dict[str, Any], m: int, seq_len: int) -> dict[str, torch.Tensor]:
    """``m`` rows of ``seq_len`` random tokens (seed 1) with shifted labels, int64 ``[m, S]``."""
    import torch

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model["vocab_size"], (m, seq_len + 1), generator=g)
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


def _live_cpu_tensors() -> list[torch.Tensor]:
    import torch

    gc.collect()
    return [t for t in gc.get_objects() if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel()]


def tensor_peak(step: Callable[[], Any]) -> dict[str, int]:
    """Live tensor bytes ``before`` and at the ``peak`` of ``step()``, counting every CPU tensor alive before it."""
    from benchmarks.memory_estimate import LiveBytesTracker

    alive = _live_cpu_tensors()
    with LiveBytesTracker() as tracker:
        for t in alive:
            tracker._register(t)
        del alive
        before = tracker.live
        tracker.reset_peak()
        step()
    return {"before": before, "peak": tracker.peak}


def _zero_grad(params: Sequence[torch.Tensor]) -> None:
    for p in params:
        p.grad = None


def _build_rank_model(model: dict[str, Any], pp: int, rank: int) -> nn.Module:
    import torch

    from nxd_lc.models.llama import LlamaForCausalLM
    from nxd_lc.pipeline import rank_model_part

    torch.manual_seed(0)
    part = rank_model_part(model["num_hidden_layers"], pp, rank) if pp > 1 else {}
    return LlamaForCausalLM(hf_llama_config(model), **part).train()


def measure_pp1(model: dict[str, Any], ms: Sequence[int], seq_len: int, warmup: int, reps: int) -> dict[str, Any]:
    """PP = 1 reference in this process: the whole model, ``m`` micro-batches with gradient accumulation."""
    from nxd_lc.distributed import parallel_state as ps

    ps.initialize_model_parallel()
    net = _build_rank_model(model, 1, 0)
    params = list(net.parameters())
    out: dict[str, Any] = {"status": "ok", "rss_after_build": rss_bytes("VmRSS"), "points": {}}
    for m in ms:
        batch = _batch(model, m, seq_len)

        def step(m: int = m, batch: dict[str, torch.Tensor] = batch) -> float:
            total = 0.0
            for k in range(m):
                loss_sum, num_tokens = net.loss(batch["input_ids"][k:k + 1], batch["labels"][k:k + 1])
                loss = loss_sum / num_tokens / m
                loss.backward()
                total += float(loss.detach())
            return total

        reset = _reset_peak_rss()
        times, losses = [], []
        for i in range(warmup + reps):
            _zero_grad(params)
            t0 = time.perf_counter()
            losses.append(step())
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        peak_rss = rss_bytes("VmHWM") if reset else None
        _zero_grad(params)
        out["points"][str(m)] = {"step_s": times, "loss": losses[-1], "peak_rss_steps": peak_rss,
                                 "tensor_peak": tensor_peak(step)}
    return out


class _AloneRunner:
    """Forward + backward of this rank's stage module with no communication (module docstring, ``alone``)."""

    def __init__(self, engine: Any, model: dict[str, Any], batch: dict[str, torch.Tensor], m: int) -> None:
        import torch

        self.stage = engine.stage_modules[0]
        self.m = m
        ids = batch["input_ids"][:1]
        self.kwargs = {"position_ids": torch.arange(ids.shape[1]).unsqueeze(0), "labels": batch["labels"][:1]}
        g = torch.Generator().manual_seed(2)
        act = (1, ids.shape[1], model["hidden_size"])
        self.x = ids if self.stage.is_first else torch.randn(act, generator=g)
        self.grad = None if self.stage.is_last else torch.randn(act, generator=g)

    def __call__(self) -> float:
        import torch

        x = self.x if self.stage.is_first else self.x.detach().requires_grad_(True)
        t0 = time.perf_counter()
        out = self.stage(x, **self.kwargs)
        if self.grad is None:
            (out.sum() / self.m).backward()
        else:
            torch.autograd.backward(out, self.grad)
        return time.perf_counter() - t0


def _pp_step(engine: Any, params: Sequence[torch.Tensor], batch: dict[str, torch.Tensor]) -> tuple[float, ...]:
    """One timed ``train_step`` (gradients reset, ranks released together); returns (wall seconds, CPU seconds of
    this thread, loss)."""
    import torch.distributed as dist

    _zero_grad(params)
    dist.barrier()
    t0, c0 = time.perf_counter(), time.thread_time()
    loss = engine.train_step(batch)
    return time.perf_counter() - t0, time.thread_time() - c0, float(loss)


def p2p_one_way_s(shape: Sequence[int], reps: int = 20) -> list[float]:
    """One-way time (s) of a float32 ``shape`` tensor between pipeline ranks 0 and 1 over gloo: half the round
    trip of a blocking send / receive ping-pong, ``reps`` times after one warm-up exchange."""
    import torch
    import torch.distributed as dist

    buf, rank, out = torch.zeros(tuple(shape)), dist.get_rank(), []
    for i in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        if i:
            out.append((time.perf_counter() - t0) / 2)
    return out


def measure_pp(model: dict[str, Any], ms: Sequence[int], seq_len: int, warmup: int, reps: int) -> dict[str, Any]:
    """This process's pipeline rank (env RANK / WORLD_SIZE = 2 / MASTER_*): timed 1F1B steps with the hooks of
    :class:`StageClock`, the stage alone after each step, and one memory-tracked step per ``m``."""
    import torch.distributed as dist

    from nxd_lc.distributed import parallel_state as ps
    from nxd_lc.pipeline import PipelineEngine, stage_layer_ranges

    dist.init_process_group("gloo")
    ps.initialize_model_parallel(pipeline_model_parallel_size=dist.get_world_size())
    rank, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    net = _build_rank_model(model, pp, rank)
    engine = PipelineEngine(net, stage_layer_ranges(model["num_hidden_layers"], pp), virtual_size=1,
                            micro_batch_size=1, sequence_parallel=False)
    params = list(net.parameters())
    clock = StageClock(engine.stage_modules[0])
    out: dict[str, Any] = {"status": "ok", "rank": rank, "rss_after_build": rss_bytes("VmRSS"), "points": {},
                           "layers": engine.stage_modules[0].layer_ids}
    for m in ms:
        batch = _batch(model, m, seq_len)
        alone = _AloneRunner(engine, model, batch, m)
        for _ in range(warmup):
            _pp_step(engine, params, batch)
            alone()
        reset = _reset_peak_rss()
        point: dict[str, Any] = {"step_s": [], "step_cpu_s": [], "fwd_s": [], "bwd_s": [], "alone_s": []}
        for _ in range(reps):
            clock.recording = True
            step_s, cpu_s, loss = _pp_step(engine, params, batch)
            clock.recording = False
            durations = clock.take()
            dist.barrier()
            point["alone_s"].append([alone() for _ in range(m)])
            point["step_s"].append(step_s)
            point["step_cpu_s"].append(cpu_s)
            point["fwd_s"].append(durations["fwd_s"])
            point["bwd_s"].append(durations["bwd_s"])
        point["peak_rss_steps"] = rss_bytes("VmHWM") if reset else None
        point["loss"] = loss
        _zero_grad(params)
        dist.barrier()
        point["tensor_peak"] = tensor_peak(lambda batch=batch: engine.train_step(batch))
        out["points"][str(m)] = point
    out["p2p_one_way_s"] = p2p_one_way_s((1, seq_len, model["hidden_size"]))
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return out


# ---- analysis -----------------------------------------------------------------------------------------------------
def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def busy_of(point: dict[str, Any]) -> list[float]:
    """Compute seconds of each timed step of one rank's point (its forwards plus its backwards)."""
    return [sum(f) + sum(b) for f, b in zip(point["fwd_s"], point["bwd_s"])]


def _rank_summary(points: Sequence[dict[str, Any]], m: int) -> dict[str, Any]:
    """One rank's figures for one ``m``, pooled over rounds (each point: one round's result for this m).
    ``cpu_over_busy``: this rank's thread CPU time in the step / its compute wall time (about 1 when the rank ran
    undisturbed; below 1 when other processes took its core while it computed)."""
    steps = [s for p in points for s in p["step_s"]]
    busy = [b for p in points for b in busy_of(p)]
    alone = [sum(a) for p in points for a in p["alone_s"]]
    fwd = [x for p in points for f in p["fwd_s"] for x in f]
    bwd = [x for p in points for b in p["bwd_s"] for x in b]
    counts_ok = all(len(f) == len(b) == m for p in points for f, b in zip(p["fwd_s"], p["bwd_s"]))
    return {"step_s": _median(steps), "bubble_idle": _median([1 - b / s for b, s in zip(busy, steps)]),
            "bubble_alone": _median([1 - a / s for a, s in zip(alone, steps)]),
            "fwd_s": _median(fwd), "bwd_s": _median(bwd), "alone_mb_s": _median(alone) / m,
            "busy_mb_s": _median(busy) / m, "hooks_saw_every_micro_batch": counts_ok,
            "cpu_over_busy": _median([c / b for p in points for c, b in zip(p["step_cpu_s"], busy_of(p))]),
            "peak_rss_steps": _median([p["peak_rss_steps"] for p in points if p.get("peak_rss_steps")] or [0])}


#: A step is "undisturbed" when every rank's thread CPU time in it is at least this share of its compute time.
UNDISTURBED_CPU_SHARE = 0.9


def _undisturbed_bubbles(rounds: Sequence[Sequence[dict[str, Any]]]) -> list[float]:
    """Per-step idle bubble (mean over ranks) of the undisturbed steps; ``rounds``: per round, the ranks' points
    for one ``m``. On a shared machine another process can take a rank's core while it computes (its wall time
    grows, its CPU time does not), which stalls its neighbour too; these steps had no such stall."""
    out = []
    for points in rounds:
        for steps in zip(*[zip(p["step_s"], p["step_cpu_s"], busy_of(p)) for p in points]):
            if all(cpu >= UNDISTURBED_CPU_SHARE * busy for _, cpu, busy in steps):
                out.append(statistics.fmean(1 - busy / step for step, _, busy in steps))
    return out


def _simulated_per_step(rounds: Sequence[Sequence[dict[str, Any]]], m: int) -> list[float]:
    """1F1B simulation of every timed step with that step's own per-micro-batch stage times (their jitter
    included); ``rounds`` as in :func:`_undisturbed_bubbles`."""
    out = []
    for points in rounds:
        for fwd, bwd in zip(zip(*[p["fwd_s"] for p in points]), zip(*[p["bwd_s"] for p in points])):
            out.append(simulate_1f1b(fwd, bwd, m)["bubble"])
    return out


def _row(per_round: list[list[dict[str, Any]]], ref: dict[str, Any], m: int, p2p_s: list[float]) -> dict[str, Any]:
    """The figures of one ``m``: ``per_round`` = per round, the ranks' points; ``ref`` = the PP = 1 point;
    ``p2p_s`` = the one-way transfer times measured by rank 0."""
    ranks = [_rank_summary([points[r] for points in per_round], m) for r in range(PP)]
    first = next((points for points in per_round if points[0]["first_m"]), per_round[0])
    for r, x in enumerate(ranks):  # memory from a process that ran this m first (no other schedule's buffers alive)
        x["tensor_peak"], x["tensor_before"] = first[r]["tensor_peak"]["peak"], first[r]["tensor_peak"]["before"]
    sim = simulate_1f1b([x["fwd_s"] for x in ranks], [x["bwd_s"] for x in ranks], m)
    quiet = _undisturbed_bubbles(per_round)
    row = {"m": m, "p": PP, "formula": formula_bubble(PP, m), "ranks": ranks,
           "bubble_idle": statistics.fmean(x["bubble_idle"] for x in ranks),
           "bubble_idle_per_round": [statistics.fmean(_rank_summary([points[r]], m)["bubble_idle"] for r in range(PP))
                                     for points in per_round],
           "bubble_idle_undisturbed": _median(quiet) if quiet else None,
           "undisturbed_steps": [len(quiet), sum(len(points[0]["step_s"]) for points in per_round)],
           "bubble_alone": statistics.fmean(x["bubble_alone"] for x in ranks),
           "bubble_simulated": sim["bubble"], "simulated": sim,
           "bubble_simulated_per_step": _median(_simulated_per_step(per_round, m)),
           "step_s": max(x["step_s"] for x in ranks), "pp1_step_s": _median(ref["step_s"]),
           "pp1_tensor_peak": ref["tensor_peak"]["peak"],
           "memory_vs_pp1": [x["tensor_peak"] / ref["tensor_peak"]["peak"] for x in ranks],
           "loss_pp2": per_round[0][0]["loss"], "loss_pp1": ref["loss"], "p2p_one_way_s": _median(p2p_s)}
    row["ratio"] = row["bubble_idle"] / row["formula"]
    row["speedup_vs_pp1"] = row["pp1_step_s"] / row["step_s"]
    # idle time that the per-step simulation does not explain, next to what 2m blocking transfers cost
    row["unexplained_idle_s"] = row["step_s"] * (row["bubble_idle"] - row["bubble_simulated_per_step"])
    row["p2p_2m_transfers_s"] = 2 * m * row["p2p_one_way_s"]
    return row


def analyse(raw: dict[str, Any]) -> dict[str, Any]:
    """Rows per ``m`` (module docstring) from ``raw`` = ``{"pp1": worker result, "pp": [[rank results] per
    round]}``; adds the markdown table.

    Raises:
        ValueError: no successful PP = 2 round, or no PP = 1 result.
    """
    rounds = [r for r in raw["pp"] if all(x.get("status") == "ok" for x in r)]
    pp1 = raw["pp1"]
    if not rounds or pp1.get("status") != "ok":
        raise ValueError("analyse: needs the PP=1 result and at least one PP=2 round that succeeded on every rank")
    rows = []
    for key in sorted(rounds[0][0]["points"], key=int):
        per_round = [[{**rnd[r]["points"][key], "first_m": next(iter(rnd[r]["points"])) == key} for r in range(PP)]
                     for rnd in rounds]
        p2p = [t for rnd in rounds for t in rnd[0]["p2p_one_way_s"]]
        rows.append(_row(per_round, pp1["points"][key], int(key), p2p))
    return {"rows": rows, "rounds_ok": len(rounds), "markdown": markdown_table(rows)}


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """One row per m: the measured bubble, the formula and their ratio, the 1F1B simulation (median stage times;
    each step's own stage times), the alone-based bubble, the step time and each stage's peak tensor memory as a
    fraction of PP = 1's."""
    lines = ["| m | p | measured bubble (idle) | formula (p-1)/(m+p-1) | ratio measured / formula "
             "| 1F1B simulated, median stage times | 1F1B simulated, each step's stage times | alone-based "
             "| step (s) | stage peak memory vs PP=1 (stage 0 / stage 1) |", "|" + "---|" * 10]
    for r in rows:
        mem = " / ".join(f"{x:.2f}" for x in r["memory_vs_pp1"])
        lines.append(f"| {r['m']} | {r['p']} | {r['bubble_idle']:.3f} | {r['formula']:.3f} | {r['ratio']:.2f} | "
                     f"{r['bubble_simulated']:.3f} | {r['bubble_simulated_per_step']:.3f} | "
                     f"{r['bubble_alone']:.3f} | {r['step_s']:.3f} | {mem} |")
    return "\n".join(lines)


# ---- harness ------------------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pipeline_bubble", description=__doc__.split("\n")[0])
    p.add_argument("cmd", nargs="?", default="bench", choices=("bench", "pp1", "pp"),
                   help="bench (default): the whole run; pp1 / pp: one child measurement")
    p.add_argument("--smoke", action="store_true", help="tiny model, m = 4, 1 round (the smoke test)")
    p.add_argument("--micro-batches", default="4,8", help="comma-separated numbers of micro-batches m")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per micro-batch (micro batch size 1)")
    p.add_argument("--rounds", type=int, default=3, help="PP=2 launches (the order of m alternates)")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--timed-steps", type=int, default=8, help="timed PP=2 steps per m and round")
    p.add_argument("--pp1-steps", type=int, default=3, help="timed PP=1 steps per m (speed-up column only)")
    p.add_argument("--cap-gib", type=float, default=4.0, help="per-process peak-RSS cap in GiB")
    p.add_argument("--timeout-s", type=float, default=600.0, help="wall-clock limit per launch")
    p.add_argument("--out", help="result JSON (default benchmarks/results/pipeline_bubble.json; child: its result)")
    p.add_argument("--reanalyse", metavar="JSON", help="recompute the analysis of a saved result file in place")
    p.add_argument("--as-limit", type=int, default=0, help="child: RLIMIT_AS in bytes (0: none)")
    return p


def _child(args: argparse.Namespace, ms: list[int]) -> int:
    import resource

    if args.as_limit:
        resource.setrlimit(resource.RLIMIT_AS, (args.as_limit, args.as_limit))
    import torch

    torch.set_num_threads(1)
    model = SMOKE_PIPELINE_MODEL if args.smoke else PIPELINE_MODEL
    measure = measure_pp1 if args.cmd == "pp1" else measure_pp
    try:
        result = measure(model, ms, args.seq_len, args.warmup_steps, args.timed_steps)
    except MemoryError as e:
        result = {"status": "oom", "error": str(e)[:500]}
    Path(args.out).write_text(json.dumps(result))
    return 0


def _child_argv(args: argparse.Namespace, cmd: str, ms: Sequence[int], timed_steps: int) -> list[str]:
    return ["-m", "benchmarks.pipeline_bubble", cmd, "--micro-batches", ",".join(map(str, ms)), "--seq-len",
            str(args.seq_len), "--warmup-steps", str(args.warmup_steps), "--timed-steps", str(timed_steps),
            *(["--smoke"] if args.smoke else [])]


def _result_of(res: Any) -> list[dict[str, Any]]:
    """Each child's result, or a failure record with the log tail."""
    return [r if res.status == "ok" and r else {"status": res.status, "log_tail": res.log_tail[-2000:]}
            for r in res.results]


def collect(args: argparse.Namespace, ms: list[int]) -> dict[str, Any]:
    """The PP = 1 reference (one child), then ``--rounds`` PP = 2 launches (two children each). With ``--smoke``
    the PP = 1 child runs alongside the PP = 2 ranks (one launch; its timings are then not meaningful)."""
    cap, env = int(args.cap_gib * GIB), {"OMP_NUM_THREADS": "1"}
    pp1_argv = _child_argv(args, "pp1", ms, args.pp1_steps)
    raw: dict[str, Any] = {"pp1": {"status": "not run"}, "pp": [], "loadavg_1m": [os.getloadavg()[0]]}
    if not args.smoke:
        res = run_children([pp1_argv], cap_bytes=cap, timeout_s=args.timeout_s, envs=[env], cwd=str(ROOT))
        raw["pp1"] = _result_of(res)[0]
        _log(f"PP=1: {res.status} ({res.wall_s:.0f} s)")
    for r in range(args.rounds):
        order = ms if r % 2 == 0 else ms[::-1]
        port = _free_port()
        argvs = [_child_argv(args, "pp", order, args.timed_steps)] * PP
        envs = [{**env, "RANK": str(k), "WORLD_SIZE": str(PP), "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port)} for k in range(PP)]
        if args.smoke:
            argvs, envs = [*argvs, pp1_argv], [*envs, env]
        res = run_children(argvs, cap_bytes=cap, timeout_s=args.timeout_s, envs=envs, cwd=str(ROOT))
        results = _result_of(res)
        if args.smoke:
            raw["pp1"] = results.pop()
        raw["pp"].append(results)
        raw["loadavg_1m"].append(os.getloadavg()[0])
        _log(f"PP=2 round {r} (m = {order}): {res.status} ({res.wall_s:.0f} s, load {raw['loadavg_1m'][-1]:.1f})")
    return raw


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (module docstring) or one child; returns the exit status (1 when a launch failed)."""
    args = _parser().parse_args(argv)
    if args.smoke:
        args.micro_batches, args.seq_len, args.rounds, args.warmup_steps, args.timed_steps = "4", 32, 1, 1, 3
        args.pp1_steps = 1
    ms = [int(x) for x in args.micro_batches.split(",") if x]
    if not ms or min(ms) < PP:
        raise ValueError(f"--micro-batches: 1F1B needs m >= p = {PP} for every m, got {args.micro_batches!r}")
    if min(args.timed_steps, args.pp1_steps, args.rounds) < 1 or args.warmup_steps < 0:
        raise ValueError("--timed-steps, --pp1-steps and --rounds must be >= 1, --warmup-steps >= 0")
    if args.cmd != "bench":
        return _child(args, ms)
    if args.reanalyse:
        return reanalyse(args.reanalyse, lambda r: analyse(r["raw"]))
    started = datetime.datetime.now()
    raw = collect(args, ms)
    plan = {k: v for k, v in vars(args).items() if k not in ("cmd", "as_limit", "reanalyse")}
    result = {"benchmark": "pipeline_bubble", "started": started.isoformat(timespec="seconds"),
              "finished": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv[1:],
              "machine": _machine(), "plan": plan, "model": SMOKE_PIPELINE_MODEL if args.smoke else PIPELINE_MODEL,
              "raw": raw}
    failed = raw["pp1"].get("status") != "ok" or any(x.get("status") != "ok" for rnd in raw["pp"] for x in rnd)
    try:
        result["analysis"] = analyse(raw)
    except ValueError as e:
        result["analysis"] = {"error": str(e), "markdown": f"failed: {e}"}
    path = _write(result, args.out or str(ROOT / "benchmarks" / "results" / "pipeline_bubble.json"))
    print(result["analysis"]["markdown"])
    print(f"\nwritten {path} ({(datetime.datetime.now() - started).total_seconds():.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
