"""Peak host memory of a node at start-up under ``trainer.sequential_move_factor``, against building on every rank at
once.

Run from the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.startup_memory             # factors None, 2, 1; 1 round (~3 min)
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.startup_memory --rounds 3  # the published run (~7 min)
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.startup_memory --smoke     # tiny model, 1 round (~1.5 min)
    .venv/bin/python -m benchmarks.startup_memory --reanalyse benchmarks/results/startup_memory.json

**What runs.** One launch = ``N = 4`` gloo processes on this machine (one node, ``trainer.devices: 4``, TP = 4, one
torch thread each), each running training's start-up path up to the built model, in training's order
(:func:`nxd_lc.app.run._fit`): typed config (:func:`nxd_lc.app.validation.load_config` over
``conf/cpu_tiny_llama_config.yaml`` with the overrides of :func:`raw_config`), ``init_distributed``,
``parallel_state.initialize_model_parallel``, ``seed_everything``, then
``run_in_waves(build, factor, local_rank, LOCAL_WORLD_SIZE)`` (:mod:`nxd_lc.distributed.startup`) where ``build``
is :func:`nxd_lc.app.build.build_model` followed by ``model.to(runtime.device)``, as
``nxd_lc.app.run._build_and_move`` does.
A barrier just before ``run_in_waves`` starts every rank's build together; a barrier after it marks the node ready.

**Model** (:data:`STARTUP_MODEL`): Llama-3.2-1B's architecture (vocab 128256, hidden 2048, intermediate 8192,
32 heads / 8 KV heads, tied embeddings), cut to ``model.num_layers: 1``, fp32, ``model.use_cpu_initialization:
true``. Each rank then creates every full weight on the host, initialises it and keeps its quarter: the full
128256 x 2048 embedding table (1.05 GB) and again the full lm head (1.05 GB, initialised then replaced by the tied
embedding), one layer's full q/k/v, o, gate/up and down weights (243 MB), while its final shard is ~0.32 GB.
So the transient (one full table + the slice being cut from it) is ~4x the rank's final model.

**How memory is measured.** The parent reads ``/proc/<pid>/status`` of the 4 children every ``--poll-ms`` (5 ms
sleep; ~7 ms between samples here, ``sample_interval_ms`` in the JSON) and sums ``VmRSS`` (resident set, as asked:
what the node's memory accounting sees per process; a shared library page counts in every process) and ``RssAnon``
(anonymous pages only: heap and tensors, no file-backed library pages). **Peak total RSS** = the largest sum seen
over the launch. Each child also reports its own ``VmHWM`` (peak RSS, kernel-tracked) and its ``VmRSS`` just before
and just after the build; from those the **bound** of a factor is computed: with waves of ``f`` ranks, while wave
``w`` builds, the ranks of earlier waves hold their built model, later ones their pre-build RSS and wave ``w`` at
most its peaks; the bound is the largest such sum over the waves (for ``None``: the sum of the four peaks, reached
only if all four peak at the same moment). measured / bound says how close the node came to it.

**Time.** ``start-up wall`` = rank 0's time from the barrier before ``run_in_waves`` to the barrier after it (the
moment the whole node has its model): the waves serialise the build, which is their cost. On an idle 2-core machine
two ranks already fill the cores, so ``f = 2`` would cost nothing and ``f = 1`` 2x; when other jobs share the
cores, 4 building ranks get a larger share of them than 2 or 1, and the waves cost more. On a Trainium host (many
cores, 32-64 ranks per node) the serialisation is ``ceil(L / f)`` waves of one rank's build + move.

Rounds alternate the order of the factors (None, 2, 1, then 1, 2, None); each factor's ratio is against ``None`` of
the same round (the shared machine's load changes between rounds), summarised as the median over rounds.

Limit of what this shows (CPU): the "move" is cpu -> cpu (``.to`` returns the same tensors), so after its wave a
rank keeps its model in host memory, and the waves bound only the transient full-weight allocations. On Trainium
the host copy is freed once the model is on the device, so there the waves bound all of start-up's host memory
except ``f`` ranks' worth; that is not measured here. The table's last columns are only arithmetic for it: the
bound above with the ranks of earlier waves back at their pre-build RSS (``bound(..., host_freed=True)``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.long_context import ROOT, _free_port, _log, _machine, _write, reanalyse
from benchmarks.procs import GIB, _kill_all, _mem_available

__all__ = ["FACTORS", "STARTUP_MODEL", "analyse", "bound", "main", "raw_config"]

NUM_RANKS = 4
#: The factors compared; None (every rank at once) is the reference of every ratio.
FACTORS: tuple[int | None, ...] = (None, 2, 1)

#: Llama-3.2-1B's config.json fields (rope scaling left out: it does not change any weight).
STARTUP_MODEL: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "attention_bias": False,
    "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": None, "tie_word_embeddings": True,
    "initializer_range": 0.02, "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "float32",
}
#: Decoder layers built (``model.num_layers``): the embedding-sized transient dominates either way.
NUM_LAYERS = 1
SMOKE_MODEL_CONFIG = "conf/tiny_llama_config.json"


def raw_config(model_config: str, factor: int | None, num_layers: int | None) -> dict[str, Any]:
    """``conf/cpu_tiny_llama_config.yaml`` with the benchmark's overrides (4 ranks, TP = 4, ``model_config``,
    ``sequential_move_factor``), as a plain dict for :func:`nxd_lc.app.validation.load_config`."""
    from omegaconf import OmegaConf

    from nxd_lc.config.resolvers import register_resolvers

    register_resolvers()
    base = OmegaConf.load(ROOT / "conf" / "cpu_tiny_llama_config.yaml")
    overrides = {"trainer": {"devices": NUM_RANKS, "sequential_move_factor": factor},
                 "distributed_strategy": {"tensor_model_parallel_size": NUM_RANKS},
                 "model": {"model_config": model_config, "num_layers": num_layers,
                           "use_cpu_initialization": True}}
    return OmegaConf.to_container(OmegaConf.merge(base, overrides), resolve=True)  # type: ignore[return-value]


# ---- one rank (child process) -------------------------------------------------------------------------------------
def _status(pid: int | str = "self") -> dict[str, int]:
    """``VmRSS``, ``RssAnon`` and ``VmHWM`` of ``/proc/<pid>/status`` in bytes ({} once the process is gone)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in ("VmRSS", "RssAnon", "VmHWM"):
                    out[key] = int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def _param_bytes(model: Any, tp: int) -> dict[str, int]:
    """This rank's parameter bytes (distinct storages), the full model's (sharded ones x TP) and the largest full
    parameter's."""
    local: dict[int, int] = {}
    full, largest = 0, 0
    for p in model.parameters():
        nbytes, ptr = p.numel() * p.element_size(), p.untyped_storage().data_ptr()
        if ptr in local:
            continue  # tied: counted once
        local[ptr] = nbytes
        whole = nbytes * (tp if getattr(p, "tensor_model_parallel", False) else 1)
        full, largest = full + whole, max(largest, whole)
    return {"local": sum(local.values()), "full": full, "largest_full": largest}


def rank_main(args: argparse.Namespace) -> dict[str, Any]:
    """Training's start-up path up to the built model on this rank (module docstring); returns its figures."""
    import torch

    torch.set_num_threads(1)
    import pytorch_lightning as pl

    from nxd_lc.app.build import build_model
    from nxd_lc.app.validation import load_config
    from nxd_lc.distributed import collectives
    from nxd_lc.distributed import parallel_state as ps
    from nxd_lc.distributed.startup import run_in_waves, wave_of
    from nxd_lc.runtime.device import init_distributed, resolve_accelerator

    factor = None if args.factor == "none" else int(args.factor)
    cfg = load_config(raw_config(args.model_config, factor, args.num_layers or None), world_size=NUM_RANKS)
    runtime = init_distributed(resolve_accelerator(cfg.trainer.accelerator))
    ds = cfg.distributed_strategy
    ps.initialize_model_parallel(tensor_model_parallel_size=ds.tensor_model_parallel_size,
                                 pipeline_model_parallel_size=ds.pipeline_model_parallel_size,
                                 context_parallel_size=ds.context_parallel_size, kv_replicator=ds.kv_replicator)
    pl.seed_everything(cfg.seed, workers=True)
    stamps: dict[str, float] = {}

    def build() -> tuple[Any, Any]:  # nxd_lc.app.run._build_and_move's build
        stamps["build_start"] = time.time()
        hf_config, model = build_model(cfg)
        moved = model.to(runtime.device)
        stamps["build_end"] = time.time()
        return hf_config, moved

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.trainer.devices))
    collectives.barrier()
    before, t0 = _status(), time.time()
    _, model = run_in_waves(build, cfg.trainer.sequential_move_factor, runtime.local_rank, local_world)
    collectives.barrier()
    t1, after = time.time(), _status()
    return {"status": "ok", "rank": runtime.rank, "local_rank": runtime.local_rank,
            "wave": wave_of(runtime.local_rank, factor), "t_ready_start": t0, "t_ready_end": t1,
            "startup_s": t1 - t0, **stamps, "rss_before_build": before["VmRSS"], "anon_before_build":
            before["RssAnon"], "rss_after_build": after["VmRSS"], "anon_after_build": after["RssAnon"],
            "peak_rss": after["VmHWM"], "param_bytes": _param_bytes(model, ds.tensor_model_parallel_size)}


# ---- one launch (parent) ------------------------------------------------------------------------------------------
def _timeline(samples: list[tuple[float, int, int]], bucket_s: float = 0.5) -> list[list[float]]:
    """``[t (s from the first sample), max total RSS, max total RssAnon]`` per ``bucket_s`` (bytes), for the JSON."""
    out: dict[int, list[float]] = {}
    t_first = samples[0][0] if samples else 0.0
    for t, rss, anon in samples:
        k = int((t - t_first) / bucket_s)
        row = out.setdefault(k, [round(k * bucket_s, 3), 0, 0])
        row[1], row[2] = max(row[1], rss), max(row[2], anon)
    return [out[k] for k in sorted(out)]


def launch(args: argparse.Namespace, factor: int | None, model_config: str) -> dict[str, Any]:
    """Start the 4 ranks with ``factor``, sample their summed RSS until all exit; returns the launch's record.

    Never raises for a failing child: ``status`` is ``ok``, ``error`` (see ``log_tail``), ``timeout`` or
    ``low_memory`` (the machine's MemAvailable fell under ``--reserve-gib``: everything was killed)."""
    port = _free_port()
    outs = [tempfile.NamedTemporaryFile(prefix="nxd_startup_", suffix=".json", delete=False).name
            for _ in range(NUM_RANKS)]
    logs = [tempfile.TemporaryFile() for _ in range(NUM_RANKS)]
    argv = [sys.executable, "-m", "benchmarks.startup_memory", "rank", "--factor", str(factor).lower(),
            "--model-config", model_config, "--num-layers", str(args.num_layers)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(NUM_RANKS), "LOCAL_WORLD_SIZE": str(NUM_RANKS),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    start = time.monotonic()
    procs = [subprocess.Popen([*argv, "--out", out], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
             for r, (out, log) in enumerate(zip(outs, logs))]
    samples, tripped = _sample(procs, args, start)
    if tripped:
        _kill_all(procs)
    results = []
    for out in outs:
        try:
            results.append(json.loads(Path(out).read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            results.append(None)
        os.unlink(out)
    status = tripped or ("ok" if all(p.returncode == 0 for p in procs) and all(results) else "error")
    tail = ""
    for log in logs:
        log.seek(0)
        tail += log.read().decode("utf-8", errors="replace")[-2000:]
        log.close()
    best = max(samples, key=lambda s: s[1]) if samples else (0.0, 0, 0)
    return {"factor": factor, "status": status, "ranks": results, "wall_s": time.monotonic() - start,
            "peak_total_rss": best[1], "peak_total_anon": max((s[2] for s in samples), default=0),
            "t_peak": best[0], "num_samples": len(samples), "timeline": _timeline(samples),
            "sample_interval_ms": 1000 * (samples[-1][0] - samples[0][0]) / max(1, len(samples) - 1) if samples
            else None,
            "loadavg_1m_after": os.getloadavg()[0], **({"log_tail": tail[-4000:]} if status != "ok" else {})}


def _sample(procs: list[subprocess.Popen[bytes]], args: argparse.Namespace,
            start: float) -> tuple[list[tuple[float, int, int]], str | None]:
    """Sum the children's VmRSS / RssAnon every ``--poll-ms`` until all exit or a limit trips."""
    samples: list[tuple[float, int, int]] = []
    reserve, poll = int(args.reserve_gib * GIB), args.poll_ms / 1000.0
    while any(p.poll() is None for p in procs):
        now = time.time()
        stats = [_status(p.pid) for p in procs]
        samples.append((now, sum(s.get("VmRSS", 0) for s in stats), sum(s.get("RssAnon", 0) for s in stats)))
        if _mem_available() < reserve:
            return samples, "low_memory"
        if any(p.returncode not in (None, 0) for p in procs):
            return samples, "error"  # the others would wait for it at a barrier
        if time.monotonic() - start > args.timeout_s:
            return samples, "timeout"
        time.sleep(poll)
    return samples, None


# ---- analysis -------------------------------------------------------------------------------------------------------
def bound(ranks: Sequence[dict[str, Any]], factor: int | None, host_freed: bool = False) -> int:
    """Largest node total RSS the waves allow, from each rank's own figures (module docstring): while wave ``w``
    builds, earlier waves hold ``rss_after_build``, later ones ``rss_before_build``, wave ``w`` its peak
    (``peak_rss``). ``host_freed``: earlier waves back at ``rss_before_build``, i.e. what the node would hold if the
    move freed the host copy (Trainium); arithmetic, nothing measures it here."""
    waves = 1 if factor is None else math.ceil(len(ranks) / factor)
    done = "rss_before_build" if host_freed else "rss_after_build"
    best = 0
    for w in range(waves):
        total = 0
        for r in ranks:
            total += r[done] if r["wave"] < w else r["rss_before_build"] if r["wave"] > w else r["peak_rss"]
        best = max(best, total)
    return best


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def analyse(raw: dict[str, Any]) -> dict[str, Any]:
    """Per-factor figures and their ratios to ``None`` of the same round (module docstring).

    Raises:
        ValueError: no round where ``None`` succeeded (nothing to take ratios against).
    """
    per_factor: dict[str, dict[str, list[float]]] = {}
    for rnd in raw["rounds"]:
        by = {str(p["factor"]): p for p in rnd if p["status"] == "ok"}
        ref = by.get("None")
        if ref is None:
            continue
        for name, p in by.items():
            f = per_factor.setdefault(name, {})
            startup = p["ranks"][0]["startup_s"]
            bnd, freed = bound(p["ranks"], p["factor"]), bound(p["ranks"], p["factor"], host_freed=True)
            for key, value in (("peak_total_rss", p["peak_total_rss"]), ("peak_total_anon", p["peak_total_anon"]),
                               ("bound", bnd), ("bound_host_freed", freed), ("startup_s", startup),
                               ("rss_ratio", p["peak_total_rss"] / ref["peak_total_rss"]),
                               ("anon_ratio", p["peak_total_anon"] / ref["peak_total_anon"]),
                               ("startup_ratio", startup / ref["ranks"][0]["startup_s"]),
                               ("measured_over_bound", p["peak_total_rss"] / bnd),
                               ("host_freed_ratio", freed / bound(ref["ranks"], None, host_freed=True))):
                f.setdefault(key, []).append(value)
    if "None" not in per_factor:
        raise ValueError("analyse: factor None has no successful launch; every ratio is taken against it")
    summary = {name: {**{k: _median(v) for k, v in f.items()}, "per_round": f, "rounds": len(f["startup_s"])}
               for name, f in per_factor.items()}
    first = next(p for rnd in raw["rounds"] for p in rnd if p["status"] == "ok")
    sizes = first["ranks"][0]["param_bytes"]
    base = sum(r["rss_before_build"] for r in first["ranks"])
    return {"factors": summary, "param_bytes": sizes, "pre_build_total_rss": base,
            "markdown": markdown_table(summary, sizes, base)}


def markdown_table(summary: dict[str, Any], sizes: dict[str, int], base: int) -> str:
    """One row per factor: peak node RSS (total and anonymous), the bound, start-up wall time, ratios to None, and
    the arithmetic bound if the move freed the host copy."""
    def cell(x: float | None, spec: str) -> str:
        return "—" if x is None else format(x, spec)

    lines = ["| sequential_move_factor | waves | peak total RSS (GiB) | vs None | peak total RssAnon (GiB) | vs None "
             "| bound from per-rank figures (GiB) | measured / bound | start-up wall (s) | vs None "
             "| bound if the move freed the host copy (GiB, not measured) | vs None |",
             "|" + "---|" * 12]
    for name in ("None", "2", "1"):
        s = summary.get(name)
        if s is None:
            lines.append(f"| {name} | failed |" + " — |" * 10)
            continue
        waves = 1 if name == "None" else math.ceil(NUM_RANKS / int(name))
        lines.append("| " + " | ".join([
            name, str(waves), cell(s["peak_total_rss"] / GIB, ".2f"), cell(s["rss_ratio"], ".2f"),
            cell(s["peak_total_anon"] / GIB, ".2f"), cell(s["anon_ratio"], ".2f"), cell(s["bound"] / GIB, ".2f"),
            cell(s["measured_over_bound"], ".2f"), cell(s["startup_s"], ".1f"), cell(s["startup_ratio"], ".2f"),
            cell(s["bound_host_freed"] / GIB, ".2f"), cell(s["host_freed_ratio"], ".2f")])
            + " |")
    lines.append(f"\nPer rank: final parameters {sizes['local'] / GIB:.2f} GiB of {sizes['full'] / GIB:.2f} GiB "
                 f"(TP = {NUM_RANKS}); largest full weight created during the build {sizes['largest_full'] / GIB:.2f} "
                 f"GiB. Node total RSS before the build (4 ranks, after imports and process groups): "
                 f"{base / GIB:.2f} GiB. Medians over {max(s['rounds'] for s in summary.values())} round(s).")
    return "\n".join(lines)


# ---- harness --------------------------------------------------------------------------------------------------------
def collect(args: argparse.Namespace, model_config: str) -> dict[str, Any]:
    """``--rounds`` rounds of one launch per factor, the order alternating between rounds."""
    raw: dict[str, Any] = {"rounds": [], "loadavg_1m_start": os.getloadavg()[0],
                           "mem_available_start": _mem_available()}
    for r in range(args.rounds):
        order = FACTORS if r % 2 == 0 else FACTORS[::-1]
        rnd = []
        for factor in order:
            point = launch(args, factor, model_config)
            rnd.append(point)
            _log(f"round {r} factor {factor}: {point['status']}, peak total RSS "
                 f"{point['peak_total_rss'] / GIB:.2f} GiB, start-up "
                 f"{(point['ranks'][0] or {}).get('startup_s', float('nan')):.1f} s, launch {point['wall_s']:.0f} s, "
                 f"load {point['loadavg_1m_after']:.1f}")
        raw["rounds"].append(rnd)
    return raw


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.startup_memory", description=__doc__.split("\n")[0])
    p.add_argument("cmd", nargs="?", default="bench", choices=("bench", "rank"),
                   help="bench (default): the whole run; rank: one rank of a launch (internal)")
    p.add_argument("--smoke", action="store_true", help="tiny model (conf/tiny_llama_config.json), 1 round")
    p.add_argument("--rounds", type=int, default=1, help="rounds over the factors (order alternates)")
    p.add_argument("--num-layers", type=int, default=NUM_LAYERS, help="model.num_layers (0: config.json's)")
    p.add_argument("--poll-ms", type=float, default=5.0, help="RSS sampling interval of the parent")
    p.add_argument("--reserve-gib", type=float, default=1.5,
                   help="kill a launch when the machine's MemAvailable drops below this")
    p.add_argument("--timeout-s", type=float, default=300.0, help="wall-clock limit per launch")
    p.add_argument("--out", help="result JSON (default benchmarks/results/startup_memory.json; rank: its result)")
    p.add_argument("--reanalyse", metavar="JSON", help="recompute the analysis of a saved result file in place")
    p.add_argument("--factor", help="rank: sequential_move_factor ('none' or an integer)")
    p.add_argument("--model-config", help="rank: the config.json")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (module docstring) or one rank; returns the exit status (1 when a launch failed)."""
    args = _parser().parse_args(argv)
    if args.cmd == "rank":
        Path(args.out).write_text(json.dumps(rank_main(args)))
        return 0
    if args.reanalyse:
        return reanalyse(args.reanalyse, lambda r: analyse(r["raw"]))
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    if args.smoke:
        args.rounds, args.num_layers = 1, 0
    started = datetime.datetime.now()
    with tempfile.TemporaryDirectory(prefix="nxd_lc_startup_") as workdir:
        model_config = str(ROOT / SMOKE_MODEL_CONFIG)
        if not args.smoke:
            model_config = str(Path(workdir) / "config.json")
            Path(model_config).write_text(json.dumps(STARTUP_MODEL, indent=1))
        raw = collect(args, model_config)
    plan = {k: v for k, v in vars(args).items() if k not in ("cmd", "reanalyse", "factor", "model_config")}
    result = {"benchmark": "startup_memory", "started": started.isoformat(timespec="seconds"),
              "finished": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv[1:],
              "machine": _machine(), "plan": plan, "model": SMOKE_MODEL_CONFIG if args.smoke else STARTUP_MODEL,
              "raw": raw}
    failed = any(p["status"] != "ok" for rnd in raw["rounds"] for p in rnd)
    try:
        result["analysis"] = analyse(raw)
    except ValueError as e:
        result["analysis"] = {"error": str(e), "markdown": f"failed: {e}"}
    name = "startup_memory_smoke.json" if args.smoke else "startup_memory.json"
    path = _write(result, args.out or str(ROOT / "benchmarks" / "results" / name))
    print(result["analysis"]["markdown"])
    print(f"\nwritten {path} ({(datetime.datetime.now() - started).total_seconds():.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
