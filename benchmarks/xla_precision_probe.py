"""Master weights on torch-xla under each precision mode's environment (issue 38): how many master elements 5 AdamW
steps at lr 1e-6 move on CPU, on one XLA-CPU device under nxd_lc's environment table (``XLA_USE_BF16`` /
``XLA_DOWNCAST_BF16`` = 0), and on one XLA-CPU device under NxDT's table (``XLA_USE_BF16=1`` for bf16SR,
``XLA_DOWNCAST_BF16=1`` for mixed_precision*, ``manual`` with ``xla_downcast_bf16: '1'``), plus the on-device element
type of the master weights and the last loss. Each XLA run is a fresh process (torch-xla reads the flags once).

Runs the scenario of ``tests/xla_scenarios_precision.py`` (nxd_lc's own training step on a tiny Llama, 87,360
parameters) through the test bed's launcher; needs the XLA lane's venv::

    OMP_NUM_THREADS=1 PJRT_DEVICE=CPU .venv-xla/bin/python -m benchmarks.xla_precision_probe

Writes ``benchmarks/results/xla_precision_probe_<stamp>.{json,md}``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]

# mode -> (manual keys, NxDT's flags for it)
MODES: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "fp32": ({}, {}),
    "bf16SR": ({}, {"XLA_USE_BF16": "1"}),
    "mixed_precision": ({}, {"XLA_DOWNCAST_BF16": "1"}),
    "mixed_precisionSR": ({}, {"XLA_DOWNCAST_BF16": "1"}),
    "autocast": ({}, {}),
    "manual": ({"xla_downcast_bf16": "1", "master_weights": True, "fp32_grad_acc": True}, {"XLA_DOWNCAST_BF16": "1"}),
}


def _xla(mode: str, manual: dict[str, Any], flags: dict[str, str]) -> dict[str, Any]:
    from xla_testbed import run_on_xla_devices

    saved = dict(os.environ)
    os.environ.update({"XLA_USE_BF16": "0", "XLA_DOWNCAST_BF16": "0", **flags})
    try:
        return run_on_xla_devices("xla_scenarios_precision:precision_steps", 1, {"mode": mode, "manual": manual},
                                  timeout_s=300).results[0]
    except AssertionError as e:  # a crash is a result here (bf16SR under XLA_USE_BF16)
        return {"error": str(e).split("--- output tail ---")[0].strip()[-300:]}
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main() -> None:
    from dist_utils import run_distributed
    from test_precision_xla import _cpu_entry

    rows = []
    for mode, (manual, flags) in MODES.items():
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "cpu.json")
            run_distributed(_cpu_entry, 1, out, {"mode": mode, "manual": manual})
            cpu = json.load(open(out))
        rows.append({"mode": mode, "nxdt_flags": flags, "cpu": cpu, "xla_nxd_lc": _xla(mode, manual, {}),
                     "xla_nxdt_flags": _xla(mode, manual, flags) if flags else None})
        print(mode, "done", flush=True)
    stamp = time.strftime("%Y%m%d_%H%M%S", time.gmtime())
    os.makedirs(os.path.join(REPO, "benchmarks", "results"), exist_ok=True)
    base = os.path.join(REPO, "benchmarks", "results", f"xla_precision_probe_{stamp}")
    with open(base + ".json", "w") as f:
        json.dump({"rows": rows, "method": __doc__}, f, indent=1)

    def cell(r: dict[str, Any] | None, total: int) -> str:
        if r is None:
            return "(same as nxd_lc)"
        if "error" in r:
            return "crash: " + r["error"].splitlines()[-1][:90]
        master = r["types"].get("master_weights") or r["types"]["parameters"]
        return f"{r['moved']:,} ({100 * r['moved'] / total:.1f}%), {master}, loss {r['losses'][-1]:.4f}"

    lines = ["| mode | CPU | XLA, nxd_lc's table (flags 0) | XLA, NxDT's flags |", "|---|---|---|---|"]
    for row in rows:
        total = row["cpu"]["total"]
        flags = " ".join(f"{k}={v}" for k, v in row["nxdt_flags"].items())
        lines.append(f"| {row['mode']} | {cell(row['cpu'], total)} | {cell(row['xla_nxd_lc'], total)} | "
                     f"{cell(row['xla_nxdt_flags'], total)} {flags} |")
    table = "\n".join(lines)
    with open(base + ".md", "w") as f:
        f.write("# Master elements moved by 5 AdamW steps at lr 1e-6 (master / parameter type on the device, last "
                "loss)\n\n" + table + "\n")
    print(table)


if __name__ == "__main__":
    main()
