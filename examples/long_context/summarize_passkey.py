"""Markdown table of the passkey extension demo: accuracy per length of each evaluated model and scoring.

    python examples/long_context/summarize_passkey.py nxd_lc_runs/passkey_extension
"""

from __future__ import annotations

import json
import os
import sys

MODELS = [("base", "base model (512, RoPE unscaled)"), ("yarn_zero_shot", "base + YaRN x4, zero-shot"),
          ("continued", "YaRN x4 + continuation at 2048")]


def main(out_dir: str) -> int:
    """Print the table; models whose JSON is missing are skipped."""
    rows = []
    lengths: list[int] = []
    for name, label in MODELS:
        path = os.path.join(out_dir, name, "retrieval.json")
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            result = json.load(f)
        lengths = result["meta"]["lengths"]
        r = result["tasks"]["passkey"]
        for scoring in result["meta"]["scorings"]:
            accs = " | ".join(f"{r['by_length'][scoring][str(L)]:.2f}" for L in lengths)
            rows.append(f"| {label} | {scoring} | {accs} | {r['effective_length'][scoring]} |")
    print("| model | scoring | " + " | ".join(str(L) for L in lengths) + " | effective length |")
    print("|---|---|" + "---|" * len(lengths) + "---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "nxd_lc_runs/passkey_extension"))
