"""Plot the loss and DPO reward curves of nxd_lc runs from their TensorBoard event files.

Usage::

    python examples/smollm2/plot.py nxd_lc_runs/smollm2_sft nxd_lc_runs/smollm2_dpo --out examples/smollm2/curves.png
    python examples/smollm2/plot.py SFT=nxd_lc_runs/smollm2_sft DPO=nxd_lc_runs/smollm2_dpo --smooth 0.6

Each argument is a run log directory (``LABEL=DIR`` names it; default label: the directory name); every
``events.out.tfevents.*`` file under it is read with TensorBoard's ``EventAccumulator`` (all points kept) and
the scalars of all files are merged by step (a later file, e.g. after a resume, wins at equal steps).

Figure (``--out``, PNG; needs matplotlib, the ``smollm2`` extra: ``pip install -e '.[smollm2]'``): one panel
per run with ``reduced_train_loss`` and ``val_loss`` against the step, then, when any run logged them, a panel
of ``rewards/accuracies`` and one of ``rewards/margins`` (tags ending in those names, e.g. a ``val_`` prefix,
are included). ``--smooth`` draws an exponential moving average over the raw (faint) train curve.

Series (``--json``, default ``--out`` with ``.json``): ``{label: {"dir": ..., "scalars": {tag: [[step,
value], ...]}}}`` with every scalar tag of every run, written even when matplotlib is missing (then the exit
status is 3 and a message says how to install it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

LOSS_TAGS = ("reduced_train_loss", "val_loss")
REWARD_PANELS = (("rewards/accuracies", "DPO reward accuracy"), ("rewards/margins", "DPO reward margin"))
NO_MATPLOTLIB = 3  # exit status when the PNG could not be drawn
Series = dict[str, list[tuple[int, float]]]


def event_files(log_dir: Path) -> list[Path]:
    """TensorBoard event files under ``log_dir`` (recursive), oldest first by name (names embed the time).

    Raises:
        FileNotFoundError: ``log_dir`` does not exist or holds no event file.
    """
    if not log_dir.is_dir():
        raise FileNotFoundError(f"run log directory {log_dir} does not exist")
    files = sorted(log_dir.rglob("events.out.tfevents.*"), key=lambda p: (p.name, str(p)))
    if not files:
        raise FileNotFoundError(f"no TensorBoard event files (events.out.tfevents.*) under {log_dir}; pass the "
                                f"run's log dir (exp_manager with create_tensorboard_logger: true)")
    return files


def read_scalars(log_dir: Path) -> Series:
    """All scalar series of a run: ``{tag: [(step, value), ...]}`` sorted by step, files merged (see module doc)."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    merged: dict[str, dict[int, float]] = {}
    for path in event_files(log_dir):
        acc = EventAccumulator(str(path), size_guidance={SCALARS: 0})  # 0: keep every point
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            points = merged.setdefault(tag, {})
            for event in acc.Scalars(tag):
                points[int(event.step)] = float(event.value)
    return {tag: sorted(points.items()) for tag, points in sorted(merged.items())}


def parse_run(arg: str) -> tuple[str, Path]:
    """``LABEL=DIR`` or ``DIR`` (label = the directory name) -> (label, path)."""
    label, sep, path = arg.partition("=")
    if sep and label and not Path(arg).exists():
        return label, Path(path)
    return Path(arg).resolve().name, Path(arg)


def ema(values: list[float], weight: float) -> list[float]:
    """Exponential moving average ``s_t = weight * s_{t-1} + (1 - weight) * x_t`` (TensorBoard's smoothing,
    without its debiasing), ``s_0 = x_0``; ``weight`` in [0, 1)."""
    out: list[float] = []
    for v in values:
        out.append(v if not out else weight * out[-1] + (1.0 - weight) * v)
    return out


def _tags_ending(series: Series, suffix: str) -> list[str]:
    return [t for t in series if t == suffix or t.endswith("_" + suffix) or t.endswith("/" + suffix)]


def draw(runs: dict[str, Series], out: Path, smooth: float = 0.0) -> None:
    """Write the PNG figure (see the module doc) of ``runs`` (label -> series) to ``out``.

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: no run has any of the plotted tags.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: list[tuple[str, list[tuple[str, str, list[tuple[int, float]]]]]] = []
    for label, series in runs.items():
        lines = [(label, t, series[t]) for t in LOSS_TAGS if t in series]
        if lines:
            panels.append((f"{label}: loss", lines))
    for suffix, title in REWARD_PANELS:
        lines = [(label, t, s[t]) for label, s in runs.items() for t in _tags_ending(s, suffix)]
        if lines:
            panels.append((title, lines))
    if not panels:
        raise ValueError(f"none of the runs logged {list(LOSS_TAGS)} or rewards/*; nothing to plot")
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
    for ax, (title, lines) in zip(axes[0], panels):
        for label, tag, points in lines:
            steps, values = [p[0] for p in points], [p[1] for p in points]
            name = tag if title.startswith(label) else f"{label} {tag}"
            marker = "o" if len(points) < 30 else None
            if smooth > 0 and tag == "reduced_train_loss":
                base = ax.plot(steps, values, alpha=0.3)[0]
                ax.plot(steps, ema(values, smooth), color=base.get_color(), label=f"{name} (EMA {smooth})")
            else:
                ax.plot(steps, values, marker=marker, markersize=3, label=name)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="run log directories, optionally LABEL=DIR")
    p.add_argument("--out", type=Path, default=Path("curves.png"), help="PNG path (default curves.png)")
    p.add_argument("--json", type=Path, default=None, help="series JSON path (default: --out with .json)")
    p.add_argument("--smooth", type=float, default=0.0, help="EMA weight in [0, 1) for the train loss")
    args = p.parse_args(argv)
    if not 0.0 <= args.smooth < 1.0:
        p.error(f"--smooth must be in [0, 1), got {args.smooth}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: read the runs, write the JSON, draw the PNG; 0, or 3 when matplotlib is missing."""
    args = _parse(argv)
    runs: dict[str, Series] = {}
    dirs: dict[str, str] = {}
    for arg in args.runs:
        label, path = parse_run(arg)
        if label in runs:
            raise ValueError(f"two runs are labelled {label!r}; name them LABEL=DIR")
        runs[label], dirs[label] = read_scalars(path), str(path)
    json_path = args.json or args.out.with_suffix(".json")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {label: {"dir": dirs[label], "scalars": s} for label, s in runs.items()}
    json_path.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"series: {json_path} ({', '.join(f'{k}: {len(v)} tags' for k, v in runs.items())})")
    if importlib.util.find_spec("matplotlib") is None:
        print("plot.py: matplotlib is not installed, so no PNG was drawn; install it with "
              "`pip install -e '.[smollm2]'` (or `pip install matplotlib`) and run again", file=sys.stderr)
        return NO_MATPLOTLIB
    draw(runs, args.out, args.smooth)
    print(f"figure: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
