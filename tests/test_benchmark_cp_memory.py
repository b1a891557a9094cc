"""benchmarks/cp_memory.py: the origin tracker attributes live bytes to the creating op, and the fit / ratios
follow their definitions (hand-computed values)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.cp_memory import OriginTracker, analyse


def test_origin_tracker_attributes_live_bytes_at_the_peak() -> None:
    n = 1 << 20  # 4 MiB of fp32 per tensor (the tracker snapshots at 1-MiB peak growth)
    with OriginTracker() as tracker:
        a = torch.ones(n)
        b = a * 2
        peak_live = tracker.live
        del a
        c = b.view(2, -1)  # a view: no new storage
    assert peak_live == 8 * n and tracker.peak == 8 * n
    assert tracker.live == 4 * n  # a's storage was freed
    assert tracker.at_peak[("ones.default", (n,))] == 4 * n and tracker.at_peak[("mul.Tensor", (n,))] == 4 * n
    assert sum(tracker.at_peak.values()) == 8 * n
    del b, c


def test_slopes_and_max_length_ratios_follow_their_definitions() -> None:
    rows = [{"cp": cp, "algo": "ring", "seq_len": n, "tensor_peak_bytes": 100 + k * n, "rss_peak_bytes": 200 + k * n}
            for cp, k in ((1, 10), (2, 4)) for n in (1000, 2000, 4000)]
    out = analyse(rows, cap_bytes=100_100)
    cp1, cp2 = out["tensor_peak_bytes"]["cp1_ring"], out["tensor_peak_bytes"]["cp2_ring"]
    assert cp1["bytes_per_token"] == pytest.approx(10) and cp2["bytes_per_token"] == pytest.approx(4)
    assert cp2["slope_vs_cp1"] == pytest.approx(0.4)
    assert cp1["max_len_at_cap"] == pytest.approx(10_000) and cp2["max_len_at_cap"] == pytest.approx(25_000)
    assert cp2["max_len_vs_cp1"] == pytest.approx(2.5)
    assert out["rss_peak_bytes"]["cp2_ring"]["max_len_at_cap"] == pytest.approx((100_100 - 200) / 4)
