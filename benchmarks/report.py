"""Analysis of the long-context benchmark's raw measurements: FLOPs and MFU, fits, maxima under the cap, ratios,
and the markdown table. Pure functions over plain dicts (the JSON written by :mod:`benchmarks.long_context`).

Units: memory in bytes (tables in GiB = 2^30 bytes), time in seconds, throughput in tokens/s, FLOPs in FLOP.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = [
    "fmt_len",
    "calibrated_max_len",
    "linear_fit",
    "loglog_slope",
    "markdown_table",
    "matmul_params",
    "step_flops",
]

GIB = float(1 << 30)


def matmul_params(model: dict[str, Any]) -> int:
    """Parameters that take part in matrix multiplies (all linear weights incl. the lm head; not the embedding
    lookup, not the norms) of a Llama with HF config fields ``model``."""
    h, i, nl = model["hidden_size"], model["intermediate_size"], model["num_hidden_layers"]
    hd = h // model["num_attention_heads"]
    q, kv = model["num_attention_heads"] * hd, model["num_key_value_heads"] * hd
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i
    return nl * per_layer + model["vocab_size"] * h


def step_flops(model: dict[str, Any], seq_len: int) -> float:
    """Model FLOPs of one training step (forward + backward = 3x forward) on one sequence of ``seq_len`` tokens.

    ``6 N T`` for the matmul parameters ``N`` (Kaplan et al. 2020, arXiv:2001.08361, eq. 2.1 with the backward
    pass) plus the causal attention: ``QK^T`` and ``PV`` cost ``2 * 2 * T^2 * d_attn`` per layer forward without
    the mask, half of that under a causal mask (as FlashAttention's FLOP count, Dao 2023, arXiv:2307.08691),
    times 3 for training: ``6 * T^2 * d_attn * n_layers``. Recomputation (activation checkpointing) is not
    counted: MFU measures useful work (Chowdhery et al. 2022, PaLM, appendix B).
    """
    d_attn = model["hidden_size"]  # num_attention_heads * head_dim
    return 6.0 * matmul_params(model) * seq_len + 6.0 * seq_len**2 * d_attn * model["num_hidden_layers"]


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float] | None:
    """Least-squares ``y = slope * x + intercept`` and its coefficient of determination R^2.

    Returns None with fewer than 2 distinct x values.
    """
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    ss_res = sum((y - (slope * x + intercept)) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return {"slope": slope, "intercept": intercept, "r2": 1.0 - ss_res / ss_tot if ss_tot else 1.0, "n": n}


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Slope of ``log y`` against ``log x`` (1.0 = linear growth, 2.0 = quadratic); None with < 2 points."""
    fit = linear_fit([math.log(x) for x in xs], [math.log(y) for y in ys])
    return None if fit is None else fit["slope"]


def calibrated_max_len(points: Sequence[tuple[int, float]], cap: float) -> dict[str, Any]:
    """Longest length whose (calibrated) memory stays <= ``cap``, from ``(L, bytes)`` points sorted by L.

    Returns ``{"grid": largest grid L under the cap or None, "interpolated": L where the piecewise-linear curve
    through the points crosses the cap (None if the first point is already above it; the last L, flagged
    ``beyond_grid``, if no point is)}``.
    """
    grid, cross, beyond = None, None, False
    for k, (length, mem) in enumerate(points):
        if mem <= cap:
            grid = length
            continue
        if k > 0:
            (l0, m0) = points[k - 1]
            cross = int(l0 + (cap - m0) * (length - l0) / (mem - m0))
        break
    else:
        beyond = True
        cross = points[-1][0] if points else None
    return {"grid": grid, "interpolated": cross, "beyond_grid": beyond}


def fmt_len(length: int) -> str:
    """2048 -> '2k'; lengths that are not a multiple of 1024 stay as they are."""
    return f"{length // 1024}k" if length % 1024 == 0 else str(length)


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """The per-length table: one row per sequence length with both implementations side by side.

    ``rows``: dicts with ``seq_len`` and per implementation ``{impl}_mem`` (bytes), ``{impl}_mem_kind``
    (``measured`` | ``estimated`` | ``over cap`` ...), ``{impl}_tok_s``, ``{impl}_mfu``, plus ``mem_ratio`` and
    ``tok_s_ratio`` (nxd_lc / transformers).
    """
    head = ("| L | transformers peak RSS (GiB) | nxd_lc peak RSS (GiB) | memory nxd/hf | transformers tok/s "
            "| nxd_lc tok/s | tok/s nxd/hf | MFU hf | MFU nxd |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        cells = [fmt_len(r["seq_len"])]
        for impl in ("hf", "nxd"):
            mem, kind = r.get(f"{impl}_mem"), r.get(f"{impl}_mem_kind", "")
            cells.append(f"{_fmt(None if mem is None else mem / GIB, '.2f')} ({kind})" if kind else "—")
        cells.append(_fmt(r.get("mem_ratio"), ".3f"))
        cells += [_fmt(r.get("hf_tok_s"), ".0f"), _fmt(r.get("nxd_tok_s"), ".0f"), _fmt(r.get("tok_s_ratio"), ".2f")]
        cells += [_fmt(None if r.get(k) is None else 100 * r[k], ".1f") + ("%" if r.get(k) is not None else "")
                  for k in ("hf_mfu", "nxd_mfu")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_result(out: str, result: dict[str, Any], md: str) -> None:
    """Write a benchmark's ``result`` as JSON to ``out`` and its markdown table ``md`` beside it (``.md``).

    Creates the parent directory if needed; prints the table.
    """
    import json
    import os

    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write(md)
    print(md)
