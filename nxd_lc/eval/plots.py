"""Pictures of long-context evaluations (matplotlib, Agg backend): the needle-in-a-haystack depth x length heatmap
and loss-by-position curves. matplotlib is the ``eval`` extra (``pip install 'nxd_lc[eval]'``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("plots need matplotlib: pip install 'nxd_lc[eval]' (or matplotlib>=3.8)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_retrieval_heatmaps(result: Mapping[str, Any], out_dir: str, title: str = "") -> list[str]:
    """One PNG per task of a :func:`nxd_lc.eval.retrieval.evaluate_grid` result: a depth (rows, 0 = start of the
    context) x length (columns) accuracy heatmap per scoring, side by side, cells annotated. Returns the paths
    (``<out_dir>/<task>_heatmap.png``).

    Raises:
        ImportError: matplotlib is not installed (names the extra).
    """
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    meta = result["meta"]
    lengths, depths, scorings = meta["lengths"], meta["depths"], meta["scorings"]
    paths = []
    for task, r in result["tasks"].items():
        fig, axes = plt.subplots(1, len(scorings), figsize=(1.2 + 1.1 * len(lengths) * len(scorings), 4.2),
                                 squeeze=False)
        for ax, scoring in zip(axes[0], scorings):
            grid = [[next(c[scoring] for c in r["cells"] if c["length"] == L and c["depth"] == d) for L in lengths]
                    for d in depths]
            im = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
            for i in range(len(depths)):
                for j in range(len(lengths)):
                    ax.text(j, i, f"{grid[i][j]:.2f}", ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(lengths)), [str(L) for L in lengths])
            ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
            ax.set_xlabel("context length (tokens)")
            if ax is axes[0][0]:  # shared rows: one label (a second one would overlap the first panel)
                ax.set_ylabel("needle depth")
            eff = r["effective_length"][scoring]
            ax.set_title(f"{task}: {scoring}\n(effective length {eff})", fontsize=9)
        fig.colorbar(im, ax=list(axes[0]), shrink=0.8, label="accuracy")
        if title:
            fig.suptitle(title, fontsize=10, y=1.03)  # above the two-line panel titles
        path = os.path.join(out_dir, f"{task}_heatmap.png")
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


def plot_loss_by_position(results: Mapping[str, Mapping[str, Any]], path: str, title: str = "") -> str:
    """Loss-by-position curves of several :func:`nxd_lc.eval.loss_by_position.loss_by_position` results (label ->
    result) in one PNG: mean loss per bucket at the bucket's midpoint (x: token position). Returns ``path``.

    Raises:
        ImportError: matplotlib is not installed (names the extra).
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, res in results.items():
        xs, ys = [], []
        edges = res["edges"]
        for (lo, hi), r in zip(zip(edges, edges[1:]), res["buckets"].values()):
            if r["num_tokens"]:
                xs.append((lo + hi) / 2)
                ys.append(r["loss"])
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel("token position")
    ax.set_ylabel("next-token loss (nats)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
