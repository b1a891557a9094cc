"""Markdown table of retrieval results: accuracy per length of each evaluated model, task and scoring.

    python examples/long_context/summarize_retrieval.py nxd_lc_runs/passkey_extension \\
        base="base model (512, RoPE unscaled)" yarn_zero_shot="base + YaRN x4, zero-shot" ...

Each ``name=label`` names a sub-directory of the output directory holding a ``retrieval.json`` written by
``python -m nxd_lc.cli.passkey`` / ``nxd_lc.cli.niah``; missing ones are skipped.
"""

from __future__ import annotations

import json
import os
import sys


def main(out_dir: str, models: list[tuple[str, str]]) -> int:
    """Print the table (one row per model x task x scoring)."""
    rows = []
    lengths: list[int] = []
    for name, label in models:
        path = os.path.join(out_dir, name, "retrieval.json")
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            result = json.load(f)
        lengths = result["meta"]["lengths"]
        for task, r in result["tasks"].items():
            for scoring in result["meta"]["scorings"]:
                accs = " | ".join(f"{r['by_length'][scoring][str(L)]:.2f}" for L in lengths)
                rows.append(f"| {label} | {task} | {scoring} | {accs} | {r['effective_length'][scoring]} |")
    print("| model | task | scoring | " + " | ".join(str(L) for L in lengths) + " | effective length |")
    print("|---|---|---|" + "---|" * len(lengths) + "---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 3 or any("=" not in a for a in sys.argv[2:]):
        sys.exit("usage: summarize_retrieval.py <out dir> <name>=<label> [<name>=<label> ...]")
    sys.exit(main(sys.argv[1], [tuple(a.split("=", 1)) for a in sys.argv[2:]]))  # type: ignore[misc]
