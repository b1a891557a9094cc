"""Precision-mode benchmark: tokens/s and memory of full optimizer steps per ``precision.type``, as ratios to fp32.

Run from the repository root::

    .venv/bin/python -m benchmarks.precision            # reference model, L = 2048, 2 rounds (~6 min, 2 cores)
    .venv/bin/python -m benchmarks.precision --smoke    # tiny model, every stage (~30 s)
    .venv/bin/python -m benchmarks.precision --reanalyse benchmarks/results/precision.json

Model, weights and tokens are those of the long-context benchmark (:mod:`benchmarks.common`: the issue-3
reference Llama, 4 layers / hidden 512 / 8 heads / 2 KV heads / vocab 32000, the seed-0 HF checkpoint, stdlib
BPE tokens, micro batch 1) with nxd_lc's memory options (:data:`benchmarks.nxd_options.NXD_BEST`). Each mode is
built the way training builds it: :class:`nxd_lc.lightning.module.NxDLanguageModel` applies the precision policy
(:mod:`nxd_lc.precision.policy`) and ``configure_optimizers`` builds AdamW (lr 1e-4, weight decay 0.01, wrapped in
:class:`nxd_lc.optim.NxDOptimizer` for bf16 parameters). One **step** = ``zero_grad`` + ``training_step``
(under ``torch.autocast("cpu", bfloat16)`` for ``autocast``, as Lightning's bf16-mixed plugin does) + backward
+ gradient reduction and norm + clipping at 1.0 + ``optimizer.step()``.

Per mode and round, one child process (:func:`benchmarks.procs.run_children`, under the same watchdog and cap as
the long-context benchmark) runs ``--warmup-steps`` steps, then ``--timed-steps`` timed steps, and reports:

* ``step_s``: wall time of each timed step (s); tokens/s = L / median step time;
* ``peak_rss``: the process's peak resident set (``VmHWM``, bytes) over its whole life (imports, weight
  loading, steps); ``peak_rss_train``: the same peak restarted after the model and optimizer were built
  (``/proc/self/clear_refs`` = 5), i.e. over the steps only;
* ``state_bytes``: bytes of parameters, gradients (the fp32 ``main_grad`` where it exists), fp32 master weights
  and optimizer state, summed from the tensors after a step -- deterministic; ``predicted_state_bytes`` is the
  same from the policy's dtypes alone, so a difference means the implementation does not do what the policy
  table says;
* ``step_tensor_peak``: the largest sum of live tensor bytes during one extra step, tracked op by op
  (:class:`benchmarks.memory_estimate.LiveBytesTracker` over real tensors, seeded with the tensors alive before
  the step) -- deterministic, and what explains ``peak_rss_train``.

Rounds alternate the mode order (fp32, A, B, ... then ..., B, A, fp32), so a linear drift of the shared
machine's speed hits fp32 and every other mode alike. Ratios are mode / fp32 of the same run: tokens/s over the
pooled timed steps of all rounds, memory of the median round.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.common import REFERENCE_MODEL, SMOKE_MODEL, make_batch, prepare_assets, rss_bytes
from benchmarks.long_context import ROOT, _log, _machine, _write, reanalyse
from benchmarks.procs import GIB, run_children

if TYPE_CHECKING:
    import torch

__all__ = ["MODES", "Mode", "analyse", "main", "measure_mode", "predicted_state_bytes", "state_bytes",
           "train_step"]

MIB = float(1 << 20)


@dataclasses.dataclass(frozen=True)
class Mode:
    """One benchmarked configuration: a label, ``precision.type`` and ``model.optim.name``."""

    label: str
    precision: str
    optim: str = "adamw"


#: The modes of issue 5, fp32 first (the reference of every ratio).
MODES: tuple[Mode, ...] = (
    Mode("fp32", "fp32"),
    Mode("bf16SR", "bf16SR"),
    Mode("bf16SR + adamw_fp32OptState", "bf16SR", "adamw_fp32OptState"),
    Mode("mixed_precision", "mixed_precision"),
    Mode("mixed_precisionSR", "mixed_precisionSR"),
    Mode("autocast", "autocast"),
)
_BY_LABEL = {m.label: m for m in MODES}
_LR, _WD, _CLIP = 1e-4, 0.01, 1.0


# ---- one mode, in-process ---------------------------------------------------------------------------------------
def build_module(hf_dir: str, mode: Mode, nxd_opts: dict[str, Any]) -> tuple[Any, Any]:
    """(NxDLanguageModel, optimizer) of ``mode`` over the checkpoint in ``hf_dir`` (fp32 weights, then the policy).

    Raises:
        ValueError: an unknown precision type / optimizer name or memory option (from nxd_lc).
    """
    from benchmarks.nxd_options import build_nxd_model
    from nxd_lc.config.schema import NxdConfig
    from nxd_lc.lightning.module import NxDLanguageModel

    cfg = NxdConfig()
    cfg.precision.type = mode.precision
    cfg.model.optim.name = mode.optim
    cfg.model.optim.lr, cfg.model.optim.weight_decay = _LR, _WD
    cfg.model.do_layer_norm_weight_decay = True  # as the NxDT reference config
    cfg.trainer.gradient_clip_val = _CLIP
    module = NxDLanguageModel(cfg, build_nxd_model(hf_dir, nxd_opts).train())
    return module, module.configure_optimizers()["optimizer"]


def train_step(module: Any, opt: Any, batch: dict[str, torch.Tensor],
               before_optimizer_step: Callable[[], None] | None = None) -> torch.Tensor:
    """One optimizer step as Lightning runs it (module docstring); returns the detached fp32 loss.

    ``before_optimizer_step`` (optional) is called after clipping, just before ``opt.step()``.
    """
    import torch

    opt.zero_grad(set_to_none=True)
    autocast = module.precision_policy.autocast_dtype
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        loss = module.training_step(batch, 0)
    loss.backward()
    module.on_before_optimizer_step(opt)
    module.configure_gradient_clipping(opt, _CLIP)
    if before_optimizer_step is not None:
        before_optimizer_step()
    opt.step()
    return loss.detach()


def _nbytes(tensors: Any) -> int:
    """Bytes of the distinct storages of ``tensors`` (an iterable of tensors or None)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.numel():
            seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
    return sum(seen.values())


def _master_tensors(opt: Any) -> list[Any]:
    """The optimizer's persistent fp32 copies of bf16 parameters (empty for a plain torch optimizer)."""
    from nxd_lc.optim import NxDOptimizer

    if not isinstance(opt, NxDOptimizer) or not opt.persistent:
        return []
    return [s.work.detach() for s in opt.slots if s.param.dtype != s.work.dtype]


def state_bytes(module: Any, opt: Any) -> dict[str, int]:
    """Bytes held between steps, from the tensors: ``params``, ``grads`` (``main_grad`` where a parameter has one,
    else ``.grad``), ``master_weights`` (fp32 copies of bf16 parameters), ``optimizer_state`` (every state tensor,
    incl. AdamW's 0-dim ``step``) and their ``total``. Call after a step, before the next ``zero_grad``."""
    from nxd_lc.distributed.grads import grad_of

    params = list(module.model.parameters())
    state = [v for st in opt.state.values() for v in st.values() if hasattr(v, "untyped_storage")]
    out = {"params": _nbytes(params), "grads": _nbytes(grad_of(p) for p in params),
           "master_weights": _nbytes(_master_tensors(opt)), "optimizer_state": _nbytes(state)}
    out["total"] = sum(out.values())
    return out


def predicted_state_bytes(policy: Any, num_params: int, moments: int = 2) -> dict[str, int]:
    """The same categories as :func:`state_bytes` from the policy's dtypes alone (``moments`` state tensors per
    parameter: 2 for AdamW, exp_avg and exp_avg_sq; the 0-dim ``step`` counters are left out)."""
    import torch

    size = {torch.float32: 4, torch.bfloat16: 2}
    grad = 4 if policy.fp32_grad_acc or not policy.low_precision_params else size[policy.param_dtype]
    out = {"params": num_params * size[policy.param_dtype], "grads": num_params * grad,
           "master_weights": num_params * 4 if policy.master_weights else 0,
           "optimizer_state": moments * num_params * size[policy.optim_state_dtype]}
    out["total"] = sum(out.values())
    return out


def _step_tensor_peak(module: Any, opt: Any, batch: dict[str, torch.Tensor]) -> dict[str, int]:
    """Live tensor bytes of one more step (module docstring): ``before`` it, ``peak`` during it, and the peaks of
    its two phases, ``forward_backward`` (up to and including clipping) and ``optimizer_step``."""
    from benchmarks.memory_estimate import LiveBytesTracker
    from nxd_lc.distributed.grads import grad_of

    params = list(module.model.parameters())
    alive = [*params, *(grad_of(p) for p in params), *(p.grad for p in params), *module.model.buffers(),
             *(s.work for s in getattr(opt, "slots", [])),
             *(v for st in opt.state.values() for v in st.values() if hasattr(v, "untyped_storage"))]
    with LiveBytesTracker() as tracker:
        for t in alive:
            if t is not None and t.numel():
                tracker._register(t)  # the tensors that exist already count from the start of the step
        before = tracker.live
        tracker.reset_peak()
        phases: dict[str, int] = {}

        def mark() -> None:
            phases["forward_backward"] = tracker.peak
            tracker.reset_peak()

        train_step(module, opt, batch, mark)
    phases["optimizer_step"] = tracker.peak
    return {"before": before, "peak": max(phases.values()), **phases}


def _reset_peak_rss() -> bool:
    """Restart this process's ``VmHWM`` (Linux ``/proc/self/clear_refs`` = 5); False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure_mode(hf_dir: str, tokens: torch.Tensor, mode: Mode, seq_len: int, warmup_steps: int = 2,
                 timed_steps: int = 3, nxd_opts: dict[str, Any] | None = None,
                 track_tensors: bool = True) -> dict[str, Any]:
    """Build ``mode``, run warm-up and timed steps on the [1, ``seq_len``] batch of ``tokens`` (int64 [N], N > L),
    and report step times (s), losses, tensor byte counts and this process's RSS figures (bytes; module
    docstring). Runs in the calling process: the RSS figures are the caller's (the harness runs it in a child).

    Raises:
        ValueError: ``warmup_steps`` < 1 or ``timed_steps`` < 1, too few tokens, or a bad mode (from nxd_lc).
    """
    if warmup_steps < 1 or timed_steps < 1:
        raise ValueError(f"--warmup-steps and --timed-steps must be >= 1, got {warmup_steps}, {timed_steps}")
    rss_import = rss_bytes("VmRSS")
    module, opt = build_module(hf_dir, mode, nxd_opts or {})
    batch = {k: v for k, v in make_batch(tokens, seq_len).items() if k in ("input_ids", "labels", "position_ids")}
    rss_built, peak_build = rss_bytes("VmRSS"), rss_bytes("VmHWM")
    reset = _reset_peak_rss()
    losses = [float(train_step(module, opt, batch)) for _ in range(warmup_steps)]
    times = []
    for _ in range(timed_steps):
        t0 = time.perf_counter()
        losses.append(float(train_step(module, opt, batch)))
        times.append(time.perf_counter() - t0)
    peak_train = rss_bytes("VmHWM")
    num_params = sum(p.numel() for p in module.model.parameters())
    out = {"status": "ok", "mode": mode.label, "precision": mode.precision, "optim": mode.optim,
           "policy": module.precision_policy.describe(), "seq_len": seq_len, "step_s": times, "losses": losses,
           "num_params": num_params, "state_bytes": state_bytes(module, opt),
           "predicted_state_bytes": predicted_state_bytes(module.precision_policy, num_params),
           "rss_after_import": rss_import, "rss_after_build": rss_built,
           "peak_rss": max(peak_build, peak_train), "peak_rss_build": peak_build,
           "peak_rss_train": peak_train if reset else None}
    if track_tensors:
        out["step_tensor_peak"] = _step_tensor_peak(module, opt, batch)
    return out


# ---- analysis -----------------------------------------------------------------------------------------------------
def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _ratio(x: float | None, ref: float | None) -> float | None:
    return None if x is None or not ref else x / ref


def _mode_summary(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Pooled figures of one mode's rounds (ok points only)."""
    steps = [s for p in points for s in p["step_s"]]
    seq_len = points[0]["seq_len"]
    tracked = [p["step_tensor_peak"] for p in points if p.get("step_tensor_peak")]
    return {"rounds": len(points), "tok_s": seq_len / _median(steps), "tok_s_best": seq_len / min(steps),
            "tok_s_per_round": [seq_len / _median(p["step_s"]) for p in points],
            "peak_rss": _median([p["peak_rss"] for p in points]),
            "peak_rss_train": _median([p["peak_rss_train"] for p in points if p.get("peak_rss_train")]),
            "state_bytes": points[0]["state_bytes"]["total"],
            "predicted_state_bytes": points[0]["predicted_state_bytes"]["total"],
            "state_breakdown": points[0]["state_bytes"], "step_tensor_peak": tracked[0]["peak"] if tracked else None,
            "step_tensor_phases": tracked[0] if tracked else None,
            "first_loss": points[0]["losses"][0], "last_loss": points[0]["losses"][-1]}


_RATIO_KEYS = ("tok_s", "tok_s_best", "peak_rss", "peak_rss_train", "state_bytes", "step_tensor_peak")


def analyse(raw: dict[str, list[dict[str, Any]]], gemm: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per-mode figures and their ratios to fp32 from ``raw`` (mode label -> list of per-round worker results).

    Definitions: ``tok_s`` = L / median of the pooled timed step times of all rounds (``tok_s_best``: L / the
    fastest step; ``tok_s_ratio_per_round``: round by round, against fp32 of the same round); ``peak_rss`` (and
    ``peak_rss_train``) = median over rounds; ``state_bytes`` and ``step_tensor_peak`` are deterministic (first
    round). ``<key>_ratio`` = mode's ``<key>`` / fp32's; ``state_matches_policy``: the tensors hold exactly the
    bytes the policy predicts (AdamW ``step`` counters aside, < 0.01%). ``gemm`` (optional, from the ``gemm``
    child) adds a line with this machine's fp32 and bf16 matmul rates under the table.

    Raises:
        ValueError: fp32 has no successful measurement (nothing to take ratios against).
    """
    summary: dict[str, Any] = {}
    for label, points in raw.items():
        ok = [p for p in points if p.get("status") == "ok"]
        summary[label] = _mode_summary(ok) if ok else {"status": [p.get("status") for p in points]}
    ref = summary.get("fp32", {})
    if "tok_s" not in ref:
        raise ValueError("analyse: fp32 has no successful measurement; every ratio is taken against fp32")
    for s in summary.values():
        if "tok_s" not in s:
            continue
        for key in _RATIO_KEYS:
            s[f"{key}_ratio"] = _ratio(s[key], ref[key])
        s["tok_s_ratio_per_round"] = [a / b for a, b in zip(s["tok_s_per_round"], ref["tok_s_per_round"])]
        s["state_matches_policy"] = abs(s["state_bytes"] - s["predicted_state_bytes"]) <= 1e-4 * s["state_bytes"]
    table = markdown_table(summary)
    if gemm and gemm.get("status") == "ok":
        table += (f"\n\nMatmul rate on this machine ({gemm['size']} x {gemm['size']}, {gemm['threads']} threads): "
                  f"fp32 {gemm['fp32_flops_per_s'] / 1e9:.0f} GFLOP/s, bf16 {gemm['bf16_flops_per_s'] / 1e9:.0f} "
                  "GFLOP/s.")
    return {"modes": summary, "markdown": table}


def _cell(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def markdown_table(summary: dict[str, Any]) -> str:
    """One row per mode: tokens/s (median step; and the fastest step's ratio, robust to load), peak RSS (whole
    process and steps only), state bytes, step tensor peak, each with its ratio to fp32 (memory in GiB = 2^30
    bytes, tensor bytes in MiB = 2^20 bytes)."""
    lines = ["| mode | tok/s | tok/s vs fp32 | fastest step vs fp32 | peak RSS (GiB) | vs fp32 "
             "| peak RSS of the steps (GiB) | vs fp32 | params+grads+master+optim (MiB) | vs fp32 "
             "| step tensor peak (MiB) | vs fp32 |", "|" + "---|" * 12]
    for label, s in summary.items():
        if "tok_s" not in s:
            lines.append(f"| {label} | failed: {s['status']} |" + " — |" * 10)
            continue
        gib = [None if s[k] is None else s[k] / GIB for k in ("peak_rss", "peak_rss_train")]
        mib = [None if s[k] is None else s[k] / MIB for k in ("state_bytes", "step_tensor_peak")]
        cells = [label, _cell(s["tok_s"], ".0f"), _cell(s["tok_s_ratio"], ".2f"), _cell(s["tok_s_best_ratio"], ".2f"),
                 _cell(gib[0], ".2f"), _cell(s["peak_rss_ratio"], ".2f"),
                 _cell(gib[1], ".2f"), _cell(s["peak_rss_train_ratio"], ".2f"),
                 _cell(mib[0], ".0f"), _cell(s["state_bytes_ratio"], ".3f"),
                 _cell(mib[1], ".0f"), _cell(s["step_tensor_peak_ratio"], ".3f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- harness ------------------------------------------------------------------------------------------------------
def _order(round_idx: int, labels: list[str]) -> list[str]:
    """Mode order of one round: as given in even rounds, reversed in odd ones (fp32 first, then last)."""
    return labels if round_idx % 2 == 0 else labels[::-1]


def _worker_argv(args: argparse.Namespace, label: str, hf_dir: str, tokens: str, track: bool) -> list[str]:
    argv = ["-m", "benchmarks.precision", "worker", "--mode", label, "--hf-dir", hf_dir, "--tokens", tokens,
            "--seq-len", str(args.seq_len), "--warmup-steps", str(args.warmup_steps), "--timed-steps",
            str(args.timed_steps), "--threads", str(args.threads), "--nxd-opts", args.nxd_opts]
    return argv + (["--track-tensors"] if track else [])


def collect(args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    """Every (round, mode) measurement, each in its own child process; returns ``{label: [result per round]}``
    and the GEMM rates."""
    model = SMOKE_MODEL if args.smoke else REFERENCE_MODEL
    assets = prepare_assets(workdir, model, args.seq_len + 1, "bytes" if args.smoke else "bpe")
    labels = [m.label for m in MODES if m.label in args.modes]
    raw: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    cap = int(args.cap_gib * GIB)
    gemm = run_children([["-m", "benchmarks.precision", "gemm", "--threads", str(args.threads)]], cap_bytes=cap,
                        timeout_s=600, cwd=str(ROOT))
    for r in range(args.rounds):
        for label in _order(r, labels):
            res = run_children([_worker_argv(args, label, assets.hf_dir, assets.tokens, track=r == 0)],
                               cap_bytes=cap, timeout_s=args.timeout_s, cwd=str(ROOT))
            result = res.results[0] or {}
            point = {**result, "status": res.status, "round": r, "peak_rss": result.get("peak_rss", res.peak_rss()),
                     "wall_s": res.wall_s, "loadavg_1m_after": os.getloadavg()[0]}
            if res.status != "ok":
                point["log_tail"] = res.log_tail[-2000:]
            raw[label].append(point)
            _log(f"round {r} {label}: {res.status}, median step {_cell(_median(point.get('step_s', [])), '.2f')} s,"
                 f" peak RSS {point['peak_rss'] / GIB:.2f} GiB")
    return {"modes": raw, "gemm": gemm.results[0] if gemm.status == "ok" else {"status": gemm.status}}


def _gemm(threads: int, n: int = 2048, repeats: int = 5) -> dict[str, Any]:
    """Best-of-``repeats`` ``torch.mm`` rate of two n x n matrices in fp32 and bf16 (FLOP/s = 2 n^3 / t)."""
    import torch

    torch.set_num_threads(threads)
    out: dict[str, Any] = {"status": "ok", "size": n, "threads": threads}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
        out[f"{name}_flops_per_s"] = 2.0 * n**3 / best
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.precision", description=__doc__.split("\n")[0])
    p.add_argument("cmd", nargs="?", default="bench", choices=("bench", "worker", "gemm"),
                   help="bench (default): the whole run; worker / gemm: one child measurement")
    p.add_argument("--smoke", action="store_true", help="tiny model, L=128, 1 round (seconds per mode)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per step (micro batch 1)")
    p.add_argument("--rounds", type=int, default=2, help="rounds over all modes (order alternates)")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--timed-steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads per child")
    p.add_argument("--modes", default=",".join(m.label for m in MODES), help="comma-separated mode labels")
    p.add_argument("--nxd-opts", default="{}", help="JSON overrides of benchmarks.nxd_options.NXD_BEST")
    p.add_argument("--cap-gib", type=float, default=12.0, help="per-process peak-RSS cap in GiB")
    p.add_argument("--timeout-s", type=float, default=900.0, help="wall-clock limit per child")
    p.add_argument("--out", help="result JSON (default benchmarks/results/precision.json; worker: its result)")
    p.add_argument("--reanalyse", metavar="JSON", help="recompute the analysis of a saved result file in place")
    p.add_argument("--as-limit", type=int, default=0, help="worker/gemm: RLIMIT_AS in bytes (0: none)")
    p.add_argument("--mode", help="worker: the mode label")
    p.add_argument("--hf-dir", help="worker: HF checkpoint directory")
    p.add_argument("--tokens", help="worker: torch.save'd int64 [N] token ids")
    p.add_argument("--track-tensors", action="store_true", help="worker: run the tracked extra step")
    return p


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if args.mode not in _BY_LABEL:
        raise ValueError(f"--mode: {args.mode!r} is not one of {list(_BY_LABEL)}")
    torch.set_num_threads(args.threads)
    return measure_mode(args.hf_dir, torch.load(args.tokens), _BY_LABEL[args.mode], args.seq_len,
                        args.warmup_steps, args.timed_steps, json.loads(args.nxd_opts), args.track_tensors)


def _child(args: argparse.Namespace) -> int:
    """A child measurement: set RLIMIT_AS before torch is imported, run, write the JSON (``oom`` on a failed
    allocation)."""
    import resource

    if args.as_limit:
        resource.setrlimit(resource.RLIMIT_AS, (args.as_limit, args.as_limit))
    try:
        result = _worker(args) if args.cmd == "worker" else _gemm(args.threads)
    except MemoryError as e:
        result = {"status": "oom", "error": str(e)[:500]}
    Path(args.out).write_text(json.dumps(result))
    return 0


_WORKER_ONLY = ("cmd", "mode", "hf_dir", "tokens", "track_tensors", "as_limit", "reanalyse")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (module docstring) or one child measurement; returns the exit status (1 when a mode
    failed)."""
    args = _parser().parse_args(argv)
    if args.cmd != "bench":
        return _child(args)
    if args.reanalyse:
        return reanalyse(args.reanalyse, lambda r: analyse(r["raw"]["modes"], r["raw"].get("gemm")))
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(args.modes) - set(_BY_LABEL))
    if unknown or "fp32" not in args.modes:
        raise ValueError(f"--modes: {unknown or 'fp32 missing'}; choose from {list(_BY_LABEL)} (fp32 required)")
    if args.smoke:
        args.seq_len, args.rounds, args.warmup_steps, args.timed_steps = 128, 1, 1, 2
    started = datetime.datetime.now()
    with tempfile.TemporaryDirectory(prefix="nxd_lc_prec_") as workdir:
        raw = collect(args, workdir)
    result = {"benchmark": "precision", "started": started.isoformat(timespec="seconds"),
              "finished": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv[1:],
              "machine": _machine(), "plan": {k: v for k, v in vars(args).items() if k not in _WORKER_ONLY},
              "model": SMOKE_MODEL if args.smoke else REFERENCE_MODEL, "raw": raw}
    result["analysis"] = analyse(raw["modes"], raw["gemm"])
    path = _write(result, args.out or str(ROOT / "benchmarks" / "results" / "precision.json"))
    print(result["analysis"]["markdown"])
    print(f"\nwritten {path} ({(datetime.datetime.now() - started).total_seconds():.0f} s)")
    return 1 if any(p["status"] != "ok" for pts in raw["modes"].values() for p in pts) else 0


if __name__ == "__main__":
    sys.exit(main())
