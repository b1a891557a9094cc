"""Turn one run's raw results (:func:`benchmarks.long_context.collect`) into the reported figures.

Definitions (all per implementation, all in one run):

* measured peak RSS: the child's ``VmHWM`` (bytes) over warm-up + timed steps; tokens/s = L / median timed step;
  MFU = :func:`benchmarks.report.step_flops` / step time / GEMM peak (the larger of the start and end GEMM runs).
* estimated RSS = (RSS after imports + fake-tensor peak) x calibration, calibration = the largest measured /
  uncalibrated-estimate ratio over the lengths where both exist (1.0 if none).
* longest fitting length: the longest measured length that finished under the cap; if the implementation never
  went over the cap, the longest estimated grid length under it (labelled estimated); ``interpolated`` is where
  the piecewise-linear calibrated estimate crosses the cap.
* linear fit of peak RSS against L (slope in bytes/token, R^2) over the measured points, and the log-log slope.
* CP=2: the per-process peak RSS (the larger rank) against L, fitted linearly and extrapolated to the cap; compared
  with the same extrapolation of nxd_lc CP=1's measured points.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.report import GIB, calibrated_max_len, fmt_len, linear_fit, loglog_slope, markdown_table, step_flops

__all__ = ["analyse"]

_NAMES = {"hf": "transformers (sdpa)", "nxd": "nxd_lc"}


def _gemm_peak(raw: dict[str, Any]) -> float | None:
    """The larger of the GEMM peaks measured at the start and the end of the run (FLOP/s), None if neither."""
    peaks = [g["flops_per_s"] for g in (raw.get("gemm", {}), raw.get("gemm_end", {})) if g.get("flops_per_s")]
    return max(peaks) if peaks else None


def _gflops(flops: float | None) -> str:
    return "—" if flops is None else f"{flops / 1e9:.0f}"


def _estimates(raw: dict[str, Any], impl: str) -> dict[int, int]:
    """L -> uncalibrated estimated RSS (bytes)."""
    est = raw["estimates"].get(impl, {})
    if est.get("status") != "ok":
        return {}
    return {p["seq_len"]: est["rss_after_import"] + p["peak_bytes"] for p in est["points"]}


def _measured_ok(raw: dict[str, Any], impl: str) -> list[dict[str, Any]]:
    return [p for p in raw["measured"].get(impl, []) if p["status"] == "ok"]


def _impl_summary(result: dict[str, Any], impl: str) -> dict[str, Any]:
    raw, cap, model = result["raw"], result["cap_bytes"], result["plan"]["model"]
    gemm = _gemm_peak(raw)
    est = _estimates(raw, impl)
    ok = _measured_ok(raw, impl)
    ratios = {p["seq_len"]: p["peak_rss"] / est[p["seq_len"]] for p in ok if p["seq_len"] in est}
    calib = max(ratios.values()) if ratios else 1.0
    cal_points = sorted((length, mem * calib) for length, mem in est.items())
    per_len: dict[int, dict[str, Any]] = {}
    for p in ok:
        step = statistics.median(p["step_s"])
        per_len[p["seq_len"]] = {"peak_rss": p["peak_rss"], "step_s": step, "tok_s": p["seq_len"] / step,
                                 "mfu": step_flops(model, p["seq_len"]) / step / gemm if gemm else None,
                                 "loss_first": p["losses"][0], "losses": p["losses"]}
    fits_measured = [p["seq_len"] for p in ok if p["peak_rss"] <= cap]
    went_over = [p["seq_len"] for p in raw["measured"].get(impl, []) if p["status"] in ("over_cap", "oom")]
    est_max = calibrated_max_len(cal_points, cap) if cal_points else {}
    longest = max(fits_measured) if fits_measured else None
    kind = "measured"
    if not went_over and est_max.get("grid") and (longest is None or est_max["grid"] > longest):
        longest, kind = est_max["grid"], "estimated"
    xs, ys = [p["seq_len"] for p in ok], [p["peak_rss"] for p in ok]
    under = [(x, y) for x, y in cal_points if y <= cap]
    return {
        "name": _NAMES[impl], "measured": per_len, "estimated_rss": dict(cal_points),
        "estimated_rss_uncalibrated": est, "measured_over_estimated": ratios, "calibration": calib,
        "went_over_cap_at": went_over, "longest_fit": longest, "longest_fit_kind": kind,
        "estimated_max": est_max,
        "fit_measured": linear_fit(xs, ys), "loglog_measured": loglog_slope(xs, ys) if len(xs) > 1 else None,
        "fit_estimated_under_cap": linear_fit([x for x, _ in under], [y for _, y in under]),
        "loglog_estimated_under_cap": loglog_slope([x for x, _ in under], [y for _, y in under])
        if len(under) > 1 else None,
    }


def _cp_summary(result: dict[str, Any], nxd: dict[str, Any]) -> dict[str, Any]:
    cap = result["cap_bytes"]
    ok = [p for p in result["raw"]["cp"] if p["status"] == "ok"]
    pts = {p["seq_len"]: {"per_rank_peak_rss": p["per_rank_peak_rss"], "peak_rss": max(p["per_rank_peak_rss"]),
                          "tok_s": p["seq_len"] / statistics.median(p["step_s"]),
                          "loss": p["losses"][-1]} for p in ok}
    fit = linear_fit(list(pts), [v["peak_rss"] for v in pts.values()])
    fit1 = nxd["fit_measured"]

    def extrapolate(f: dict[str, float] | None) -> int | None:
        return int((cap - f["intercept"]) / f["slope"]) if f and f["slope"] > 0 else None

    max_cp2, max_cp1 = extrapolate(fit), extrapolate(fit1)
    same_len = {length: v["peak_rss"] / nxd["measured"][length]["peak_rss"]
                for length, v in pts.items() if length in nxd["measured"]}
    return {"measured": pts, "fit": fit, "extrapolated_max_cp2": max_cp2, "extrapolated_max_cp1": max_cp1,
            "max_ratio_cp2_over_cp1": max_cp2 / max_cp1 if max_cp2 and max_cp1 else None,
            "slope_ratio_cp1_over_cp2": fit1["slope"] / fit["slope"] if fit and fit1 else None,
            "peak_cp2_over_cp1_same_len": same_len, "failed": [p["seq_len"] for p in result["raw"]["cp"]
                                                                if p["status"] != "ok"]}


def _rows(result: dict[str, Any], s: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    lengths = sorted(set(result["plan"]["est"]) | set(result["plan"]["real"]))
    over = {impl: {p["seq_len"]: p["peak_rss"] for p in result["raw"]["measured"].get(impl, [])
                   if p["status"] in ("over_cap", "oom")} for impl in s}
    rows = []
    for length in lengths:
        row: dict[str, Any] = {"seq_len": length}
        for impl, summ in s.items():
            m = summ["measured"].get(length)
            if m:
                row.update({f"{impl}_mem": m["peak_rss"], f"{impl}_mem_kind": "measured",
                            f"{impl}_tok_s": m["tok_s"], f"{impl}_mfu": m["mfu"]})
            elif length in over[impl]:
                row.update({f"{impl}_mem": over[impl][length], f"{impl}_mem_kind": "over cap, killed at"})
            elif length in summ["estimated_rss"]:
                row.update({f"{impl}_mem": summ["estimated_rss"][length], f"{impl}_mem_kind": "estimated"})
        if row.get("hf_mem") and row.get("nxd_mem"):
            row["mem_ratio"] = row["nxd_mem"] / row["hf_mem"]
        if row.get("hf_tok_s") and row.get("nxd_tok_s"):
            row["tok_s_ratio"] = row["nxd_tok_s"] / row["hf_tok_s"]
        rows.append(row)
    return rows


def _targets(s: dict[str, dict[str, Any]], cp: dict[str, Any]) -> dict[str, Any]:
    hf, nxd = s["hf"], s["nxd"]
    # a maximum is only known if the implementation went over the cap or its estimate crossed it inside the grid
    known = all(x["went_over_cap_at"] or not x["estimated_max"].get("beyond_grid", True) for x in (hf, nxd))
    ratio = nxd["longest_fit"] / hf["longest_fit"] if known and hf["longest_fit"] and nxd["longest_fit"] else None
    interp = (nxd["estimated_max"].get("interpolated"), hf["estimated_max"].get("interpolated"))
    tok = {length: nxd["measured"][length]["tok_s"] / hf["measured"][length]["tok_s"]
           for length in (4096, 16384) if length in nxd["measured"] and length in hf["measured"]}
    fit = nxd["fit_measured"]
    return {
        "max_len_ratio": ratio, "max_len_ratio_target_8x_met": ratio is not None and ratio >= 8,
        "max_len_ratio_interpolated": interp[0] / interp[1] if known and all(interp) else None,
        "tok_s_ratio": tok, "tok_s_4k_target_1x_met": tok.get(4096, 0) >= 1.0,
        "nxd_linear_r2": fit["r2"] if fit else None,
        "nxd_linear_target_met": bool(fit and fit["r2"] >= 0.99 and (nxd["loglog_measured"] or 2) <= 1.05),
        "cp2_max_ratio": cp.get("max_ratio_cp2_over_cp1"),
        "bytes_per_token": {k: v["fit_measured"]["slope"] if v["fit_measured"] else None for k, v in s.items()},
    }


def _markdown(result: dict[str, Any], s: dict[str, dict[str, Any]], cp: dict[str, Any],
              t: dict[str, Any]) -> str:
    cap = result["cap_bytes"] / GIB
    gemm = _gemm_peak(result["raw"])
    out = [markdown_table(_rows(result, s)), "",
           f"- fp32 GEMM peak (torch.mm 4096^2, 2 threads, same run): {_gflops(gemm)} GFLOP/s"]
    for summ in s.values():
        f, emax = summ["fit_measured"], summ["estimated_max"]
        out.append(f"- {summ['name']}: longest L under {cap:.0f} GiB = {summ['longest_fit']} "
                   f"({summ['longest_fit_kind']}; estimate crosses the cap at ~{emax.get('interpolated')}"
                   f"{' or beyond' if emax.get('beyond_grid') else ''}); "
                   + (f"measured slope {f['slope'] / 1024:.1f} KiB/token, R^2 {f['r2']:.4f}, "
                      f"log-log slope {summ['loglog_measured']:.3f}; " if f else "")
                   + "measured/estimated RSS " + ", ".join(f"{fmt_len(k)}: {v:.3f}"
                                                           for k, v in summ["measured_over_estimated"].items()))
    verdict = ("not determined (no maximum within the lengths run)" if t["max_len_ratio"] is None
               else "met" if t["max_len_ratio_target_8x_met"] else "MISSED")
    out.append(f"- max-length ratio nxd_lc/transformers: {t['max_len_ratio']} (target >= 8x: {verdict}); "
               "tokens/s ratio "
               + ", ".join(f"{fmt_len(k)}: {v:.2f}" for k, v in t["tok_s_ratio"].items())
               + f" (target >= 1.0x at 4k: {'met' if t['tok_s_4k_target_1x_met'] else 'MISSED'})")
    if cp.get("measured"):
        out.append("- CP=2 (nxd_lc, ring, 2 processes), per-process peak RSS: "
                   + ", ".join(f"{fmt_len(k)}: {v['peak_rss'] / GIB:.2f} GiB ({v['tok_s']:.0f} tok/s)"
                               for k, v in cp["measured"].items())
                   + f"; extrapolated max L CP=2 {cp['extrapolated_max_cp2']} vs CP=1 {cp['extrapolated_max_cp1']} "
                   f"(ratio {cp['max_ratio_cp2_over_cp1']})")
    return "\n".join(out)


def analyse(result: dict[str, Any]) -> dict[str, Any]:
    """Summary of ``result`` (the run's JSON without ``analysis``): per-implementation figures, CP, targets,
    the per-length table rows and the markdown (table + bullet summary)."""
    s = {impl: _impl_summary(result, impl) for impl in ("hf", "nxd")}
    cp = _cp_summary(result, s["nxd"]) if result["raw"]["cp"] else {}
    t = _targets(s, cp)
    return {"impls": s, "cp2": cp, "targets": t, "gemm_peak_flops_per_s": _gemm_peak(result["raw"]),
            "rows": _rows(result, s), "markdown": _markdown(result, s, cp, t)}
