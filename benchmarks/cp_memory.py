"""Per-rank memory of context parallelism: live-tensor peak by origin, CP = 1 vs CP = 2 (ring and Ulysses).

Run from the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.cp_memory                  # 8k, 16k, 32k (~6 min)
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.cp_memory --lens 1024,2048 # quick

**What is measured.** The long-context benchmark's reference model (:data:`MODEL`: 4 layers, hidden 512, 8 heads /
2 KV heads, intermediate 1376, vocab 32000, fp32) with nxd_lc's memory configuration
(:data:`benchmarks.nxd_options.NXD_BEST`: full recomputation, tiled loss and MLP, flash attention), one forward +
backward of one random sequence of ``L`` tokens (micro batch 1), CP ranks as gloo processes with one torch thread
each. On every rank, :class:`OriginTracker` (the benchmark's live-bytes dispatch tracker,
:class:`benchmarks.memory_estimate.LiveBytesTracker`, on real tensors) records the peak of live tensor bytes
created during the step (parameters, built before, are not counted) and, at the peak, which ATen op created each
live storage and with what shape. The process's peak RSS (``ru_maxrss``) is recorded beside it.

**Allocator.** glibc's malloc serves large blocks with ``mmap`` only above a threshold that it raises (up to
32 MiB) each time such a block is freed; blocks below it come from the heap and their pages stay resident after
``free``. With the default, a process's peak RSS then keeps freed activations and says little about what is live
(measured: CP 1 peak RSS 1.60 GiB at 8k and 1.59 GiB at 16k). ``--malloc-mmap-threshold`` (default 1 MiB) fixes
the threshold (``MALLOC_MMAP_THRESHOLD_`` in the measured processes' environment), so large tensors are unmapped
when freed and RSS follows the live tensors; ``0`` keeps glibc's dynamic default.

**Reported** (JSON ``benchmarks/results/cp_memory.json`` + ``.md``): per CP size / algorithm / length the larger
rank's tensor peak and RSS; the bytes, at the peak, of tensors that have a full-length (``L``) dimension on a
CP > 1 rank (something sequence-long replicated would show up here); slopes (bytes per token, least squares over
the lengths) and their ratio CP 2 / CP 1; and the length at which each fit reaches ``--cap-gib``, as a ratio.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import tempfile
import weakref
from typing import Any

import torch

from benchmarks.memory_estimate import LiveBytesTracker
from benchmarks.report import write_result

MODEL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0)
_SNAPSHOT_STEP = 1 << 20  # re-take the at-peak composition when the peak grew by 1 MiB


class OriginTracker(LiveBytesTracker):
    """:class:`LiveBytesTracker` that also knows, for the live storages at the peak, the creating op and shape.

    Attributes:
        at_peak: ``Counter[(op name, shape)] -> bytes`` of the storages alive at the (last 1-MiB-resolution) peak.
    """

    def __init__(self) -> None:
        super().__init__()
        self.origin: dict[int, tuple[str, tuple[int, ...], int]] = {}
        self.at_peak: collections.Counter[tuple[str, tuple[int, ...]]] = collections.Counter()
        self._snapshot_at = 0
        self._op = ""

    def _register(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key not in self._refs:
            self.origin[key] = (self._op, tuple(t.shape), storage.nbytes())
            weakref.finalize(storage, self.origin.pop, key, None)
        super()._register(t)
        if self.live >= self.peak and self.live >= self._snapshot_at + _SNAPSHOT_STEP:
            self._snapshot_at = self.live
            self.at_peak = collections.Counter()
            for op, shape, nbytes in self.origin.values():
                self.at_peak[(op, shape)] += nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        """Remember the op's name for :meth:`_register`, then the parent's bookkeeping."""
        self._op = str(getattr(func, "__name__", func))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _worker(rank: int, world: int, seq_len: int, algo: str, out_dir: str, port: int) -> None:
    """One CP rank: build, shard the batch, one step under the tracker, write ``rank<r>.json``."""
    import torch.distributed as dist
    from transformers import LlamaConfig

    from benchmarks.nxd_options import NXD_BEST, nxd_loss
    from nxd_lc.config.schema import ModelConfig
    from nxd_lc.context import set_context_parallel_algo, shard_batch_for_context_parallel
    from nxd_lc.distributed import parallel_state
    from nxd_lc.models.common.checkpointing import apply_memory_techniques
    from nxd_lc.models.llama import LlamaForCausalLM

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    set_context_parallel_algo(algo)
    torch.manual_seed(0)
    opts = dict(NXD_BEST)
    model = LlamaForCausalLM(LlamaConfig(**MODEL), flash_attention=bool(opts.pop("flash_attention")))
    apply_memory_techniques(model, ModelConfig(**opts))
    ids = torch.randint(0, MODEL["vocab_size"], (1, seq_len))
    batch = {"input_ids": ids, "labels": torch.roll(ids, -1, 1), "position_ids": torch.arange(seq_len)[None]}
    batch = shard_batch_for_context_parallel(batch, rank, world, algo)
    with OriginTracker() as tracker:
        nxd_loss(model, batch).backward()
    full = sum(b for (_, shape), b in tracker.at_peak.items() if world > 1 and seq_len in shape)
    top = [[op, list(shape), nbytes] for (op, shape), nbytes in tracker.at_peak.most_common(12)]
    result = {"rank": rank, "tensor_peak_bytes": tracker.peak, "full_length_bytes_at_peak": full, "top": top,
              "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def measure(cp: int, algo: str, seq_len: int) -> dict[str, Any]:
    """Run one configuration in ``cp`` fresh processes; the larger rank's figures plus every rank's."""
    import torch.multiprocessing as mp

    from benchmarks.long_context import _free_port as free_port

    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(cp, seq_len, algo, out_dir, free_port()), nprocs=cp, join=True)
        ranks = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(cp)]
    worst = max(ranks, key=lambda r: r["tensor_peak_bytes"])
    return {"cp": cp, "algo": algo, "seq_len": seq_len, "tensor_peak_bytes": worst["tensor_peak_bytes"],
            "rss_peak_bytes": max(r["rss_peak_bytes"] for r in ranks),
            "full_length_bytes_at_peak": max(r["full_length_bytes_at_peak"] for r in ranks),
            "top_at_peak": worst["top"], "ranks": ranks}


def _fit(points: list[tuple[int, int]]) -> tuple[float, float]:
    """Least-squares ``bytes = a + b * L`` -> ``(a, b)``."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / max(sum((x - mx) ** 2 for x, _ in points), 1e-9)
    return my - b * mx, b


def analyse(rows: list[dict[str, Any]], cap_bytes: float) -> dict[str, Any]:
    """Slopes per (cp, algo, measure), CP 2 / CP 1 slope ratios and extrapolated max-length ratios at the cap."""
    out: dict[str, Any] = {}
    for measure_key in ("tensor_peak_bytes", "rss_peak_bytes"):
        fits = {}
        for key in sorted({(r["cp"], r["algo"]) for r in rows}):
            pts = [(r["seq_len"], r[measure_key]) for r in rows if (r["cp"], r["algo"]) == key]
            if len(pts) >= 2:
                a, b = _fit(pts)
                fits[f"cp{key[0]}_{key[1]}"] = {"intercept": a, "bytes_per_token": b,
                                               "max_len_at_cap": (cap_bytes - a) / b if b > 0 else None}
        base = fits.get("cp1_ring")
        for name, fit in fits.items():
            if base and name != "cp1_ring" and base["bytes_per_token"] > 0:
                fit["slope_vs_cp1"] = fit["bytes_per_token"] / base["bytes_per_token"]
                if fit["max_len_at_cap"] and base["max_len_at_cap"]:
                    fit["max_len_vs_cp1"] = fit["max_len_at_cap"] / base["max_len_at_cap"]
        out[measure_key] = fits
    return out


def table(result: dict[str, Any]) -> str:
    """Markdown tables of the rows and the fits."""
    gib = 2 ** 30
    lines = ["| CP | algo | L | tensor peak (GiB) | full-length tensors at peak (MiB) | peak RSS (GiB) |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['cp']} | {r['algo']} | {r['seq_len']} | {r['tensor_peak_bytes'] / gib:.3f} | "
                     f"{r['full_length_bytes_at_peak'] / 2**20:.1f} | {r['rss_peak_bytes'] / gib:.2f} |")
    lines += ["", "| measure | layout | KiB / token | slope vs CP 1 | max length at cap vs CP 1 |",
              "|---|---|---|---|---|"]
    for measure_key, fits in result["analysis"].items():
        for name, fit in fits.items():
            slope = fit.get("slope_vs_cp1")
            ratio = fit.get("max_len_vs_cp1")
            lines.append(f"| {measure_key.replace('_bytes', '')} | {name} | {fit['bytes_per_token'] / 1024:.2f} | "
                         f"{'—' if slope is None else f'{slope:.3f}'} | {'—' if ratio is None else f'{ratio:.2f}'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Measure every (CP, algorithm, length), write the JSON and the markdown table."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.cp_memory", description=__doc__.split("\n")[0])
    p.add_argument("--lens", default="8192,16384,32768",
                   help="comma-separated sequence lengths (>= 2 x 4096 so that every CP 2 rank holds a full MLP tile)")
    p.add_argument("--cap-gib", type=float, default=12.0, help="per-process memory budget for the max-length fit")
    p.add_argument("--malloc-mmap-threshold", type=int, default=1 << 20,
                   help="glibc MALLOC_MMAP_THRESHOLD_ for the measured processes, bytes (0: glibc's dynamic default)")
    p.add_argument("--out", default="benchmarks/results/cp_memory.json")
    args = p.parse_args(argv)
    lens = [int(x) for x in args.lens.split(",") if x]
    if args.malloc_mmap_threshold > 0:  # read by glibc at the start of each spawned process
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    rows = [measure(cp, algo, n) for n in lens for cp, algo in ((1, "ring"), (2, "ring"), (2, "ulysses"))]
    for r in rows:
        print(f"cp {r['cp']} {r['algo']:8s} L {r['seq_len']:6d}: tensor peak {r['tensor_peak_bytes'] / 2**20:8.1f} MiB"
              f"  full-length at peak {r['full_length_bytes_at_peak'] / 2**20:6.1f} MiB"
              f"  RSS {r['rss_peak_bytes'] / 2**20:8.1f} MiB", flush=True)
    result = {"torch": torch.__version__, "model": MODEL, "lens": lens, "rows": rows,
              "malloc_mmap_threshold": args.malloc_mmap_threshold,
              "analysis": analyse(rows, args.cap_gib * 2 ** 30)}
    write_result(args.out, result, table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
