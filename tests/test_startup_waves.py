"""``trainer.sequential_move_factor``: ranks build / move their model in waves of that many local ranks."""

from __future__ import annotations

import json
import os
import time

import pytest
from dist_utils import run_distributed

from nxd_lc.distributed.startup import run_in_waves, wave_of


def _wave_worker(rank: int, world: int, factor: int | None, out_dir: str) -> None:
    def build() -> int:
        start = time.monotonic()
        time.sleep(0.3)
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
            json.dump([start, time.monotonic()], f)
        return rank * 10

    assert run_in_waves(build, factor, rank, world) == rank * 10


def _intervals(out_dir: str, world: int) -> list[tuple[float, float]]:
    out = []
    for r in range(world):
        with open(os.path.join(out_dir, f"{r}.json")) as f:
            out.append(tuple(json.load(f)))
    return out


@pytest.mark.compat
@pytest.mark.distributed
def test_sequential_move_factor_builds_in_waves(tmp_path) -> None:
    run_distributed(_wave_worker, 4, 2, str(tmp_path))
    spans = _intervals(str(tmp_path), 4)
    # wave 0 = local ranks 0, 1; wave 1 = 2, 3: every wave-1 build starts after every wave-0 build ended
    assert min(spans[2][0], spans[3][0]) >= max(spans[0][1], spans[1][1])
    # inside a wave the ranks overlap (they build at the same time)
    assert spans[1][0] < spans[0][1] and spans[3][0] < spans[2][1]


@pytest.mark.distributed
def test_without_factor_all_ranks_build_at_once(tmp_path) -> None:
    run_distributed(_wave_worker, 4, None, str(tmp_path))
    spans = _intervals(str(tmp_path), 4)
    assert max(s for s, _ in spans) < min(e for _, e in spans)  # all four builds overlap


def test_wave_assignment_and_bad_factor() -> None:
    assert [wave_of(r, 3) for r in range(7)] == [0, 0, 0, 1, 1, 1, 2]
    assert wave_of(5, None) == 0
    with pytest.raises(ValueError, match="trainer.sequential_move_factor must be >= 1"):
        run_in_waves(lambda: 0, 0, 0, 1)
