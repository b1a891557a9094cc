"""Needle-in-a-haystack tasks after RULER (single, multi-key, multi-value, variable tracking) over a context length x
depth grid, haystacks from the held-out split of the run's corpus: see
:mod:`nxd_lc.eval.retrieval` and :mod:`nxd_lc.data.retrieval_tasks`.

Command line (one process, or torchrun at the config's TP x CP (x DP) layout)::

    python -m nxd_lc.cli.niah --config-name cpu_tiny_llama_config --hf-dir <hf dir> \\
        --tasks niah_single,niah_multikey --lengths 512,1024 --out results/niah
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from nxd_lc.cli import retrieval
from nxd_lc.data.retrieval_tasks import TASKS


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: :func:`nxd_lc.cli.retrieval.main` with the RULER-style tasks."""
    return retrieval.main(argv, prog="python -m nxd_lc.cli.niah", default_tasks=TASKS[1:])


if __name__ == "__main__":
    sys.exit(main())
