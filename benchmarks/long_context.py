"""Long-context memory / throughput benchmark: nxd_lc against transformers, one full training step per point.

Run from the repository root::

    .venv/bin/python -m benchmarks.long_context            # full run (~40 min on 2 cores)
    .venv/bin/python -m benchmarks.long_context --quick    # 2k-16k measured, smaller estimate grid
    .venv/bin/python -m benchmarks.long_context --smoke    # tiny model, every stage, ~1 min
    .venv/bin/python -m benchmarks.long_context --reanalyse benchmarks/results/<file>.json

What one run does (see benchmarks/README.md for the method and the latest numbers):

1. writes the seed-0 HF checkpoint of the reference model and the token data (:mod:`benchmarks.common`);
2. measures the fp32 GEMM peak (``torch.mm``, 2 threads) in a child process, at the start and again at the end
   (the larger is used: on a shared machine either may be depressed);
3. **estimates** peak memory of both implementations on a grid of lengths with FakeTensorMode
   (:mod:`benchmarks.memory_estimate`), and validates that accounting on real tensors at the smallest length;
4. **measures** peak RSS and tokens/s at each real length, each implementation in its own child process under the
   per-process cap (:mod:`benchmarks.procs`), one at a time; an implementation that went over the cap is not run
   at longer lengths;
5. measures nxd_lc with context parallelism (CP=2, ring; two gloo processes, same per-process cap);
6. writes ``benchmarks/results/long_context_<date>.json`` (raw points, analysis, machine, versions, git commit)
   and prints the markdown table (also written next to the JSON as ``.md``).

Figures are ratios against transformers measured in the same run; every memory figure is labelled measured or
estimated. Estimated RSS = RSS after imports + fake-tensor peak, times a calibration factor = the largest
measured/estimated ratio of that implementation (conservative).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import REFERENCE_MODEL, SMOKE_MODEL, prepare_assets
from benchmarks.nxd_options import NXD_BEST
from benchmarks.procs import GIB, ChildResult, run_children

__all__ = ["main"]

ROOT = Path(__file__).resolve().parent.parent
IMPLS = ("hf", "nxd")


def _lens(spec: str) -> list[int]:
    return [int(x) for x in spec.split(",") if x]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.long_context", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="real lengths 2k-16k, estimates to 256k, CP at 8k")
    p.add_argument("--smoke", action="store_true", help="tiny model and lengths (seconds; the smoke test)")
    p.add_argument("--real-lens", help="comma-separated measured lengths (default 2k..32k)")
    p.add_argument("--est-lens", help="comma-separated estimated lengths (default 2k..512k)")
    p.add_argument("--cp-lens", help="comma-separated CP=2 measured lengths (default 8k,16k,32k; '' to skip)")
    p.add_argument("--cap-gib", type=float, default=12.0, help="per-process peak-RSS cap in GiB")
    p.add_argument("--threads", type=int, default=2, help="torch threads per measurement (CP: 1 per rank)")
    p.add_argument("--nxd-opts", default="{}", help="JSON overrides of benchmarks.nxd_options.NXD_BEST")
    p.add_argument("--out", help="result JSON path (default benchmarks/results/long_context_<timestamp>.json)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="wall-clock limit per measurement")
    p.add_argument("--reanalyse", metavar="JSON", help="recompute the analysis of a saved result file in place")
    return p


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    """Model, token kind and the three length lists for this run."""
    if args.smoke:
        plan = {"model": SMOKE_MODEL, "tokens": "bytes", "real": [256, 512], "est": [256, 512, 1024],
                "cp": [512], "warmup_len": 256}
    elif args.quick:
        plan = {"model": REFERENCE_MODEL, "tokens": "bpe", "real": [2048, 4096, 8192, 16384],
                "est": [2048 << k for k in range(8)], "cp": [8192], "warmup_len": 16384}
    else:
        plan = {"model": REFERENCE_MODEL, "tokens": "bpe", "real": [2048 << k for k in range(5)],
                "est": [2048 << k for k in range(9)], "cp": [8192, 16384, 32768], "warmup_len": 16384}
    for key, attr in (("real", "real_lens"), ("est", "est_lens"), ("cp", "cp_lens")):
        if getattr(args, attr) is not None:
            plan[key] = _lens(getattr(args, attr))
    plan["est"] = sorted(set(plan["est"]) | set(plan["real"]) | set(plan["cp"]))
    return plan


def _git_commit() -> dict[str, Any]:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def _machine() -> dict[str, Any]:
    import torch
    import transformers

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    mem = next(int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines()
               if ln.startswith("MemTotal"))
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_total": mem, "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "platform": platform.platform(),
            "hostname": socket.gethostname(), **_git_commit()}


class Runner:
    """Launches the worker subcommands under the cap and keeps the raw results."""

    def __init__(self, args: argparse.Namespace, plan: dict[str, Any], hf_dir: str, tokens: str) -> None:
        self.args, self.plan, self.hf_dir, self.tokens = args, plan, hf_dir, tokens
        self.cap = int(args.cap_gib * GIB)

    def _worker(self, cmd: str, *extra: str, threads: int | None = None) -> list[str]:
        return ["-m", "benchmarks.step_worker", cmd, "--threads", str(threads or self.args.threads), *extra]

    def _run(self, argvs: list[list[str]], envs: list[dict[str, str]] | None = None) -> ChildResult:
        return run_children(argvs, cap_bytes=self.cap, timeout_s=self.args.timeout_s, envs=envs, cwd=str(ROOT))

    def _common(self, impl: str) -> list[str]:
        return ["--impl", impl, "--hf-dir", self.hf_dir, "--nxd-opts", self.args.nxd_opts,
                "--warmup-len", str(self.plan["warmup_len"])]

    def gemm(self) -> dict[str, Any]:
        size = "512" if self.args.smoke else "4096"
        res = self._run([self._worker("gemm", "--size", size)])
        return _only(res)

    def estimate(self, impl: str, lengths: list[int], real: bool = False) -> dict[str, Any]:
        extra = ["--real", "--tokens", self.tokens] if real else []
        res = self._run([self._worker("estimate", *self._common(impl), "--seq-lens",
                                      ",".join(map(str, lengths)), *extra)])
        return _only(res)

    def measure(self, impl: str, seq_len: int) -> dict[str, Any]:
        timed = 3 if seq_len <= 4096 else 1
        res = self._run([self._worker("run", *self._common(impl), "--seq-len", str(seq_len), "--tokens",
                                      self.tokens, "--timed-steps", str(timed))])
        return _point(res)

    def measure_cp(self, seq_len: int, cp: int = 2) -> dict[str, Any]:
        port = _free_port()
        argv = self._worker("run", *self._common("nxd"), "--seq-len", str(seq_len), "--tokens", self.tokens,
                            "--cp", str(cp), threads=max(1, self.args.threads // cp))
        envs = [{"RANK": str(r), "WORLD_SIZE": str(cp), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
                for r in range(cp)]
        res = self._run([argv] * cp, envs)
        point = _point(res)
        point["per_rank_peak_rss"] = [max(w, (r or {}).get("peak_rss", 0))
                                      for w, r in zip(res.watch_peak_rss, res.results)]
        if res.status == "ok":  # slowest rank's step; the loss is the mean of the ranks' (context_parallel_loss)
            point["step_s"] = [max(steps) for steps in zip(*(r["step_s"] for r in res.results))]
            point["losses"] = [sum(losses) / cp for losses in zip(*(r["losses"] for r in res.results))]
        return point


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _only(res: ChildResult) -> dict[str, Any]:
    if res.status != "ok" or res.results[0] is None:
        return {"status": res.status, "log_tail": res.log_tail[-2000:]}
    return res.results[0]


def _point(res: ChildResult) -> dict[str, Any]:
    """One measured point: the worker's JSON plus the harness's status and watchdog peak."""
    base = res.results[0] if res.results and res.results[0] else {}
    out = {**base, "status": res.status, "peak_rss": res.peak_rss(), "wall_s": res.wall_s,
           "loadavg_1m_after": os.getloadavg()[0]}
    if res.status not in ("ok",):
        out["log_tail"] = res.log_tail[-2000:]
    return out


def collect(args: argparse.Namespace, plan: dict[str, Any], workdir: str) -> dict[str, Any]:
    """Run every measurement of the plan (module docstring, steps 1-5); returns the raw results."""
    assets = prepare_assets(workdir, plan["model"], max(plan["real"] + plan["cp"]) + 1, plan["tokens"])
    runner = Runner(args, plan, assets.hf_dir, assets.tokens)
    raw: dict[str, Any] = {"gemm": runner.gemm(), "estimates": {}, "validation": {}, "measured": {}, "cp": []}
    _log(f"GEMM peak: {raw['gemm'].get('flops_per_s', 0) / 1e9:.1f} GFLOP/s")
    for impl in IMPLS:
        raw["estimates"][impl] = runner.estimate(impl, plan["est"])
        raw["validation"][impl] = runner.estimate(impl, [min(plan["real"])], real=True)
        _log(f"estimates {impl}: {raw['estimates'][impl].get('status')}, validation: "
             f"{raw['validation'][impl].get('status')}")
    over: set[str] = set()
    raw["measured"] = {impl: [] for impl in IMPLS}
    for seq_len in plan["real"]:
        for impl in IMPLS:
            if impl in over:
                raw["measured"][impl].append({"seq_len": seq_len, "status": "skipped (over cap at a shorter L)"})
                continue
            point = runner.measure(impl, seq_len)
            point["seq_len"] = seq_len
            raw["measured"][impl].append(point)
            if point["status"] in ("over_cap", "oom"):
                over.add(impl)
            _log(f"{impl} L={seq_len}: {point['status']} peak {point['peak_rss'] / GIB:.2f} GiB "
                 f"steps {point.get('step_s')}")
    for seq_len in plan["cp"]:
        point = runner.measure_cp(seq_len)
        point["seq_len"] = seq_len
        raw["cp"].append(point)
        _log(f"nxd CP=2 L={seq_len}: {point['status']} per-rank peak "
             f"{[round(x / GIB, 2) for x in point.get('per_rank_peak_rss', [])]} GiB")
        if point["status"] != "ok":
            break
    raw["gemm_end"] = runner.gemm()  # again at the end: on a shared machine the first one may be low
    _log(f"GEMM peak at the end: {raw['gemm_end'].get('flops_per_s', 0) / 1e9:.1f} GFLOP/s")
    return raw


def _log(msg: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}] {msg}", flush=True)


def _write(result: dict[str, Any], out: str | None) -> Path:
    if out is None:
        out = str(ROOT / "benchmarks" / "results" / f"long_context_{datetime.datetime.now():%Y%m%d_%H%M%S}.json")
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    path.with_suffix(".md").write_text(result["analysis"]["markdown"] + "\n")
    return path


def reanalyse(path: str, analyse_result: Any) -> int:
    """``--reanalyse <json>``: recompute ``result["analysis"]`` with ``analyse_result(result)`` from a saved result
    file, write it back in place (JSON + markdown) and print the table; returns exit status 0."""
    result = json.loads(Path(path).read_text())
    result["analysis"] = analyse_result(result)
    _write(result, path)
    print(result["analysis"]["markdown"])
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (module docstring); returns the process exit status (0 unless a measurement errored)."""
    from benchmarks.analysis import analyse

    args = _parser().parse_args(argv)
    if args.reanalyse:
        return reanalyse(args.reanalyse, analyse)
    plan = _plan(args)
    if args.smoke:
        args.cap_gib = min(args.cap_gib, 4.0)
    started = datetime.datetime.now()
    with tempfile.TemporaryDirectory(prefix="nxd_lc_bench_") as workdir:
        raw = collect(args, plan, workdir)
    result = {"benchmark": "long_context", "started": started.isoformat(timespec="seconds"),
              "finished": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv[1:],
              "machine": _machine(), "cap_bytes": int(args.cap_gib * GIB), "plan": plan,
              "nxd_options": {**NXD_BEST, **json.loads(args.nxd_opts)}, "raw": raw}
    result["analysis"] = analyse(result)
    path = _write(result, args.out)
    print(result["analysis"]["markdown"])
    print(f"\nwritten {path}")
    errors = [p for pts in raw["measured"].values() for p in pts if p["status"] in ("error", "timeout")]
    return 1 if errors or raw["gemm"].get("status") != "ok" else 0


if __name__ == "__main__":
    sys.exit(main())
