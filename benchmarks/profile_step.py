"""Where a training step's time goes: transformers against nxd_lc configurations, by op category (torch.profiler).

Run from the repository root::

    .venv/bin/python -m benchmarks.profile_step                         # 4k and 16k, every configuration
    .venv/bin/python -m benchmarks.profile_step --lens 4096 --configs hf,memory,no_recompute

Each (configuration, length) runs in its own process with ``--threads`` torch threads (default 2): one warm-up step
at the same length, then one step timed with ``time.perf_counter`` per phase (forward, backward, optimizer; the
process's peak RSS ``VmHWM`` is read after it) and a
second step under ``torch.profiler.profile(with_flops=True)`` (CPU activity). The profiled step's op self-times are
summed into categories by op name (:data:`CATEGORIES`): GEMMs (``mm``/``addmm``/``bmm``), attention (the SDPA
kernels), loss (softmax / cross-entropy pieces), copies and layout, and everything else (elementwise). The
profiler's FLOP count of the GEMMs, against the model's GEMM FLOPs of a step (:func:`benchmarks.report.step_flops`
without attention), gives the recomputation factor directly (full checkpointing runs every layer's GEMMs twice
in forward). Timings come from the un-profiled step; the profiled step gives the shares.

Configurations (:data:`CONFIGS`): ``hf`` = transformers ``LlamaForCausalLM`` (sdpa); the others are nxd_lc with
``benchmarks.nxd_options.NXD_BEST`` overridden by the listed options (the same keys as ``--nxd-opts`` of the
long-context benchmark).

Writes ``benchmarks/results/profile_step.json`` and a markdown table beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.report import write_result

__all__ = ["CATEGORIES", "CONFIGS", "categorise", "main"]

ROOT = Path(__file__).resolve().parent.parent

#: nxd_lc configurations: overrides of NXD_BEST (``None`` marks transformers).
CONFIGS: dict[str, dict[str, Any] | None] = {
    "hf": None,
    "memory": {},  # NXD_BEST: full checkpointing + tiled MLP 4096 + tiled loss 1024
    "memory_compiled": {"compile": True, "tiled_mlp_chunk_size": None},
    "memory_save_attention": {"activations_checkpoint_save_attention": True},
    "memory_save_attention_compiled": {"compile": True, "tiled_mlp_chunk_size": None,
                                       "activations_checkpoint_save_attention": True},
    # NeMo's block method: the first N of the 4 layers checkpointed (attention kept), the rest not recomputed
    "block2_compiled": {"compile": True, "tiled_mlp_chunk_size": None, "activations_checkpoint_save_attention": True,
                        "activations_checkpoint_method": "block", "activations_checkpoint_num_layers": 2},
    "block3_compiled": {"compile": True, "tiled_mlp_chunk_size": None, "activations_checkpoint_save_attention": True,
                        "activations_checkpoint_method": "block", "activations_checkpoint_num_layers": 3},
    "selective": {"activations_checkpoint_granularity": "selective",
                  "activations_checkpoint_recompute": ["CoreAttention", "LlamaMLP"]},
    "no_recompute": {"activations_checkpoint_granularity": None, "tiled_mlp_chunk_size": None},
    "no_recompute_compiled": {"activations_checkpoint_granularity": None, "tiled_mlp_chunk_size": None,
                              "compile": True},
}

#: (category, substrings of the op name) in match order; the first match wins, "other" takes the rest.
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("gemm", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation")),
    ("attention", ("scaled_dot_product", "flash_attention", "nxd_lc::ring_attention")),
    ("loss", ("log_softmax", "nll_loss", "logsumexp", "cross_entropy")),
    ("copy_layout", ("aten::copy_", "aten::cat", "aten::clone", "aten::contiguous", "aten::_to_copy",
                     "aten::index", "aten::gather", "aten::scatter", "aten::repeat", "aten::expand",
                     "aten::embedding", "aten::fill_", "aten::zero_", "aten::zeros", "aten::empty")),
    ("inductor", ("CompiledFunction", "Torch-Compiled Region", "CompiledFxGraph", "## Call CompiledFxGraph")),
]


def categorise(name: str) -> str:
    """The category of one profiler op ``name`` (see :data:`CATEGORIES`); ``other`` if none matches."""
    for cat, keys in CATEGORIES:
        if any(k in name for k in keys):
            return cat
    return "other"


def _profile_child(config: str, seq_len: int, hf_dir: str, tokens_path: str, threads: int) -> dict[str, Any]:
    """One configuration at one length in this process: phase times of a plain step, categories of a profiled
    one."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.common import make_batch, rss_bytes
    from benchmarks.nxd_options import build_nxd_model, nxd_loss
    from benchmarks.step_worker import _build_hf

    torch.set_num_threads(threads)
    opts = CONFIGS[config]
    model = _build_hf(hf_dir, fake=False) if opts is None else build_nxd_model(hf_dir, opts).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    batch = make_batch(torch.load(tokens_path), seq_len)

    def forward() -> torch.Tensor:
        if opts is None:
            return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                         labels=batch["hf_labels"]).loss
        return nxd_loss(model, batch)

    def step() -> tuple[float, float, float, float]:
        t0 = time.perf_counter()
        loss = forward()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        return float(loss.detach()), t1 - t0, t2 - t1, t3 - t2

    step()  # warm-up (allocator, compilation)
    loss, fwd_s, bwd_s, opt_s = step()
    peak_rss = rss_bytes("VmHWM")  # before the profiler adds its own bookkeeping
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        step()
    cats: dict[str, float] = {}
    gemm_flops = 0.0
    for ev in prof.key_averages():
        cat = categorise(ev.key)
        cats[cat] = cats.get(cat, 0.0) + ev.self_cpu_time_total / 1e6
        if cat == "gemm":
            gemm_flops += float(ev.flops or 0)
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
    return {"config": config, "seq_len": seq_len, "loss": loss, "forward_s": fwd_s, "backward_s": bwd_s,
            "optimizer_s": opt_s, "step_s": fwd_s + bwd_s + opt_s, "peak_rss": peak_rss, "category_s": cats,
            "gemm_flops": gemm_flops,
            "top_ops": [{"name": e.key, "self_s": e.self_cpu_time_total / 1e6, "calls": e.count} for e in top],
            "threads": threads}


def _gemm_peak(threads: int) -> float:
    """fp32 GEMM FLOP/s of ``torch.mm`` on 4096^2 matrices (best of 5) in a child process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "gemm.json")
        subprocess.run([sys.executable, "-m", "benchmarks.step_worker", "gemm", "--out", out, "--threads",
                        str(threads)], cwd=ROOT, check=True)
        with open(out) as f:
            return float(json.load(f)["flops_per_s"])


def analyse(rows: list[dict[str, Any]], model: dict[str, Any], gemm_peak: float) -> list[dict[str, Any]]:
    """Per row: tokens/s, ratio to transformers at the same length, MFU, and the GEMM recomputation factor
    (profiled GEMM FLOPs / the model's GEMM FLOPs of one step)."""
    from benchmarks.report import matmul_params, step_flops

    hf = {r["seq_len"]: r for r in rows if r["config"] == "hf"}
    out = []
    for r in rows:
        n = r["seq_len"]
        base = hf.get(n)
        model_gemm = 6.0 * matmul_params(model) * n
        out.append({
            "config": r["config"], "seq_len": n, "tokens_per_s": n / r["step_s"],
            "vs_hf": (base["step_s"] / r["step_s"]) if base else None,
            "memory_vs_hf": (r["peak_rss"] / base["peak_rss"]) if base else None,
            "mfu": step_flops(model, n) / r["step_s"] / gemm_peak,
            "gemm_recompute_factor": r["gemm_flops"] / model_gemm if r["gemm_flops"] else None,
        })
    return out


def table(result: dict[str, Any]) -> str:
    """Markdown: per configuration and length, phase times, category shares of the profiled step, MFU."""
    cats = [c for c, _ in CATEGORIES] + ["other"]
    lines = ["| config | L | step s | fwd / bwd / opt s | tok/s vs hf | peak RSS GiB (vs hf) | MFU | GEMM recompute | "
             + " | ".join(f"{c} s" for c in cats) + " |",
             "|---|---|---|---|---|---|---|---|" + "---|" * len(cats)]
    for r, a in zip(result["rows"], result["analysis"]):
        vs = f"{a['vs_hf']:.3f}" if a["vs_hf"] is not None else "—"
        rf = f"{a['gemm_recompute_factor']:.2f}x" if a["gemm_recompute_factor"] else "—"
        mem = f"{r['peak_rss'] / 2**30:.2f}" + (f" ({a['memory_vs_hf']:.2f})" if a["memory_vs_hf"] else "")
        lines.append(f"| {r['config']} | {r['seq_len']} | {r['step_s']:.2f} | {r['forward_s']:.2f} / "
                     f"{r['backward_s']:.2f} / {r['optimizer_s']:.2f} | {vs} | {mem} | {a['mfu'] * 100:.1f}% | {rf} | "
                     + " | ".join(f"{r['category_s'].get(c, 0.0):.2f}" for c in cats) + " |")
    lines.append("")
    lines.append(f"- fp32 GEMM peak (torch.mm 4096^2, {result['threads']} threads, same run): "
                 f"{result['gemm_peak'] / 1e9:.0f} GFLOP/s; category seconds are profiler self-times of the "
                 "profiled step (profiling adds overhead; the step columns come from an un-profiled step)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run every (configuration, length) in its own process; write JSON + markdown; print the table."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_step", description=__doc__.split("\n")[0])
    p.add_argument("--lens", default="4096,16384", help="comma-separated sequence lengths")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {list(CONFIGS)}")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="tiny model (seconds; the smoke test)")
    p.add_argument("--out", default="benchmarks/results/profile_step.json")
    p.add_argument("--child", nargs=4, metavar=("CONFIG", "LEN", "HF_DIR", "TOKENS"), help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        config, n, hf_dir, tokens = args.child
        with open(args.child_out, "w") as f:
            json.dump(_profile_child(config, int(n), hf_dir, tokens, args.threads), f)
        return 0
    from benchmarks.common import REFERENCE_MODEL, SMOKE_MODEL, prepare_assets

    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")
    lens = [int(x) for x in args.lens.split(",") if x]
    model = SMOKE_MODEL if args.smoke else REFERENCE_MODEL
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        assets = prepare_assets(tmp, model, max(lens) + 1, tokens="bytes" if args.smoke else "bpe")
        gemm_peak = _gemm_peak(args.threads)
        for n in lens:
            for c in configs:
                out = os.path.join(tmp, f"{c}_{n}.json")
                subprocess.run([sys.executable, "-m", "benchmarks.profile_step", "--threads", str(args.threads),
                                "--child", c, str(n), assets.hf_dir, assets.tokens, "--child-out", out],
                               cwd=ROOT, check=True)
                with open(out) as f:
                    rows.append(json.load(f))
                print(f"{c:24s} L {n:6d}: step {rows[-1]['step_s']:.2f} s", flush=True)
        gemm_peak = max(gemm_peak, _gemm_peak(args.threads))
    result = {"model": model, "threads": args.threads, "gemm_peak": gemm_peak, "rows": rows,
              "analysis": analyse(rows, model, gemm_peak)}
    write_result(args.out, result, table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
