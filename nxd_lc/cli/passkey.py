"""Passkey retrieval (Mohtashami & Jaggi 2023) over a context length x depth grid: see
:mod:`nxd_lc.eval.retrieval` and :mod:`nxd_lc.data.retrieval_tasks`.

Command line (one process, or torchrun at the config's TP x CP (x DP) layout)::

    python -m nxd_lc.cli.passkey --config-name cpu_tiny_llama_config --hf-dir <hf dir> \\
        --lengths 512,1024,2048 --depths 0,0.25,0.5,0.75,1 --num-samples 5 --out results/passkey
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from nxd_lc.cli import retrieval


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: :func:`nxd_lc.cli.retrieval.main` with the passkey task."""
    return retrieval.main(argv, prog="python -m nxd_lc.cli.passkey", default_tasks=("passkey",))


if __name__ == "__main__":
    sys.exit(main())
