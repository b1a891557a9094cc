"""Estimated longest trainable sequence on one accelerator: nxd_lc's memory plans against transformers + Liger-Kernel
+ gradient checkpointing (issue 27, item 5), for the 1.50B reference shape of ``benchmarks/accel_step.py``.

Not a measurement. nxd_lc's side: the activation estimate of each memory plan
(:func:`nxd_lc.models.common.memory_plan.estimate_bytes`, an upper bound of the FakeTensor-measured peak, within 2.2x
in ``tests/test_memory_plan.py``) plus the static bytes of the benchmark's step (bf16 parameters and gradients,
AdamW's two bf16 moments: 8 bytes per parameter); the longest ``L`` (a multiple of 4096) whose total fits the
device's memory. The peer's side: a straight line through its two longest measured peaks of the H200 run of
2026-11-26 (``--peer-points``, GiB at tokens; default 18.6 GiB at 64k and 28.3 GiB at 128k, from
``docs/experiments/gpu_h200.md``): with gradient checkpointing and Liger's kernels its memory grows linearly in L.

    python -m benchmarks.max_length [--device-gib 139] [--out benchmarks/results/max_length_estimate.json]

Writes the JSON and a markdown table next to it (``.md``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.accel_step import LLAMA_1B_UNTIED, dense_params
from nxd_lc.models.common.memory_plan import PLAN_ORDER, PlanShape, estimate_bytes

GIB = 2**30
STEP = 4096
ROOT = Path(__file__).resolve().parent.parent


def shape(tokens: int, fused_loss: bool, cfg: dict[str, Any] = LLAMA_1B_UNTIED) -> PlanShape:
    """The reference shape at TP 1, bf16 activations, ``tokens`` in the micro-batch."""
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    return PlanShape(tokens=tokens, hidden=cfg["hidden_size"], head_dim=cfg["hidden_size"] // heads,
                     heads_local=heads, kv_heads_local=kv, intermediate_local=cfg["intermediate_size"],
                     vocab_local=cfg["vocab_size"], layers=cfg["num_hidden_layers"], element_size=2,
                     fused_loss=fused_loss)


def static_bytes(cfg: dict[str, Any] = LLAMA_1B_UNTIED) -> int:
    """bf16 parameters + gradients + AdamW's two bf16 moments, all parameters (embedding included)."""
    params = dense_params(cfg) + cfg["vocab_size"] * cfg["hidden_size"]  # + the embedding table
    return 8 * params


def max_length(plan: str, loss_chunk: int | None, fused_loss: bool, device_bytes: int,
               limit: int = 16 * 2**20) -> int:
    """Longest multiple of :data:`STEP` tokens whose static + activation estimate fits ``device_bytes`` (0: none)."""
    budget = device_bytes - static_bytes()
    lo, hi = 0, limit // STEP
    while lo < hi:  # the estimate grows with L: binary search on L / STEP
        mid = (lo + hi + 1) // 2
        if estimate_bytes(shape(mid * STEP, fused_loss), plan, loss_chunk)[0] <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo * STEP


def peer_max_length(points: list[tuple[int, float]], device_gib: float) -> int:
    """The L where the line through the two measured (tokens, GiB) points reaches ``device_gib``."""
    (l1, g1), (l2, g2) = points
    slope = (g2 - g1) / (l2 - l1)
    return int(l2 + (device_gib - g2) / slope) // STEP * STEP


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.max_length", description=__doc__.split("\n")[0])
    p.add_argument("--device-gib", type=float, default=139.0, help="device memory in GiB (H200: ~139, H100: ~79)")
    p.add_argument("--peer-points", default="65536:18.6,131072:28.3",
                   help="the peer's two measured peaks, tokens:GiB,tokens:GiB")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "max_length_estimate.json"))
    args = p.parse_args(argv)
    points = [(int(a), float(b)) for a, b in (x.split(":") for x in args.peer_points.split(","))]
    device = int(args.device_gib * GIB)
    rows = []
    for fused in (False, True):
        for plan in PLAN_ORDER:
            chunks = (None,) if fused else (None, 1024)
            for chunk in chunks:
                rows.append({"plan": plan, "loss": "liger fused" if fused else ("tiled 1024" if chunk else "untiled"),
                             "max_tokens": max_length(plan, chunk, fused, device)})
    peer = peer_max_length(points, args.device_gib)
    best = max(r["max_tokens"] for r in rows)
    result = {"device_gib": args.device_gib, "static_gib": static_bytes() / GIB, "peer_points": points,
              "peer": "transformers + Liger-Kernel + gradient checkpointing (linear through measured peaks)",
              "peer_max_tokens": peer, "rows": rows, "best_max_tokens": best, "ratio_best_to_peer": best / peer,
              "note": "estimates, not measurements; nxd_lc's activation estimate is an upper bound (<= 2.2x)"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    lines = [f"# Estimated longest sequence on {args.device_gib:g} GiB (static {result['static_gib']:.1f} GiB)", "",
             "| nxd_lc plan | loss | max tokens |", "|---|---|---|"]
    lines += [f"| {r['plan']} | {r['loss']} | {r['max_tokens']:,} |" for r in rows]
    lines += ["", f"Peer ({result['peer']}): {peer:,} tokens. Best nxd_lc / peer: {best / peer:.2f}x.", "",
              result["note"] + "."]
    Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
