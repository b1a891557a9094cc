"""Passkey retrieval (Mohtashami & Jaggi 2023) over a context length x depth grid: see :mod:`nxd_lc.eval.retrieval`.

Command line (one process, or torchrun at the config's TP x CP (x DP) layout)::

    python -m nxd_lc.eval.passkey --config-name cpu_tiny_llama_config --hf-dir <hf dir> \\
        --lengths 512,1024,2048 --depths 0,0.25,0.5,0.75,1 --num-samples 5 --out results/passkey
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from nxd_lc.eval import retrieval


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: :func:`nxd_lc.eval.retrieval.main` with the passkey task."""
    return retrieval.main(argv, prog="python -m nxd_lc.eval.passkey", default_tasks=("passkey",))


if __name__ == "__main__":
    sys.exit(main())
